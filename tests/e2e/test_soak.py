"""A short soak (pagedserve bench soak, in-process) against the tiny-model server: rounds of
concurrent streams with clients hanging up mid-stream and issue 17's bad inputs."""

import asyncio
import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("psutil")

from pagedserve.bench.soak import SoakConfig, run_soak, verdict  # noqa: E402
from tests.server.test_server import MODEL, Server  # noqa: E402


@pytest.fixture(scope="module")
def server(checkpoint):
    s = Server(checkpoint("llama"))
    yield s
    s.stop()


def test_short_soak_has_no_leaks_no_5xx_and_refuses_every_bad_input(server):
    cfg = SoakConfig(
        server.url,
        MODEL,
        rounds=2,
        streams=16,
        hangup=0.3,
        max_tokens=(8, 48),
        prompt_words=(4, 120),
        settle_s=10.0,
        pid=os.getpid(),  # the front end runs in this process, the engine core in a child
    )
    report = asyncio.run(run_soak(cfg))
    rounds = report["rounds"]
    print(
        [
            {
                k: r[k]
                for k in (
                    "whole",
                    "hung_up",
                    "leaked_blocks",
                    "tokens_after_hangup_est",
                    "duration_s",
                    "bad_inputs",
                )
            }
            for r in rounds
        ]
    )
    assert len(rounds) == 2
    for r in rounds:
        assert r["status_5xx"] == 0 and r["non_openai_error_bodies"] == 0
        assert r["leaked_blocks"] == 0 and r["running_after"] == 0 and r["waiting_after"] == 0
        assert r["broken"] == [] and r["failed"] == []
        assert len(r["bad_inputs"]) == 9 and r["bad_inputs_ok"], r["bad_inputs"]
        assert all(400 <= c["status"] < 500 for c in r["bad_inputs"].values())
        assert r["bad_inputs"]["oversized_body"]["status"] == 413
        assert r["probes_ok"] == "9/9" and r["health"] == 200
        assert r["whole"] + r["hung_up"] == 16 and r["hung_up"] == r["hangups_planned"]
        assert r["rss"]["total_mb"] > 0
    assert sum(r["hung_up"] for r in rounds) > 0  # the seed makes some clients leave
    assert report["verdict"]["pass"], report["verdict"]


def test_verdict_names_each_failed_goal():
    """The verdict is not a rubber stamp: each goal, broken in a synthetic round, is reported."""
    good = {
        "round": 1,
        "status_5xx": 0,
        "non_openai_error_bodies": 0,
        "bad_inputs_ok": True,
        "probes_ok": "9/9",
        "broken": [],
        "failed": [],
        "health": 200,
        "leaked_blocks": 0,
        "running_after": 0,
        "waiting_after": 0,
        "slowest_over_p99": 1.2,
        "rss": {"total_mb": 1000.0, "server_mb": 400.0, "children_mb": 600.0},
    }
    cfg = SoakConfig("http://x", "m")
    rounds = [dict(good, round=i + 1) for i in range(3)]
    assert verdict(rounds, cfg)["pass"]
    bad = [
        dict(good, round=1, status_5xx=2),
        dict(good, round=2, leaked_blocks=3, probes_ok="8/9"),
        dict(
            good,
            round=3,
            slowest_over_p99=4.0,
            bad_inputs_ok=False,
            rss={"total_mb": 1030.0, "server_mb": 400.0, "children_mb": 630.0},
        ),
    ]
    v = verdict(bad, cfg)
    assert not v["pass"]
    text = " | ".join(v["failures"])
    for needle in ("2 5xx", "not idle", "probes answered 8/9", "4.0x the p99", "bad inputs", "RSS grew 3.0%"):
        assert needle in text, (needle, text)
    assert v["rss_growth_after_round2_server"] == 0 and v["rss_growth_after_round2_core"] == 0.05
