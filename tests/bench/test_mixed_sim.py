"""bench/mixed_sim.py: the step-time model's features and fit, and the simulated `bench
mixed` run on the real scheduler."""

import json
import random

import pytest

from pagedserve.bench import mixed_sim
from pagedserve.bench.mixed import arrival_times, make_mixed_workload, summarize_mixed

TRUE = {
    "const": 0.012, "decode_rows": 0.0025, "decode_ctx_k": 0.0009, "prefill_100": 0.03,
    "prefill_attn_1e5": 0.004, "prefill_over_128_100": -0.01, "prefill_over_256_100": -0.004,
}


def synthetic_log(path, steps=400, overhead=0.0015, seed=0):
    rng = random.Random(seed)
    cost = {"coef": TRUE, "overhead_s": 0.0}
    t = 1000.0
    with open(path, "w") as f:
        for _ in range(steps):
            rows = [[1, 1, rng.randint(20, 300)] for _ in range(rng.randint(0, 4))]
            rows += [[0, 1, rng.randint(1500, 3000)] for _ in range(rng.randint(0, 8))]
            if rng.random() < 0.4:
                rows.append([0, rng.choice([64, 128, 200, 256, 512, 2048]), rng.randint(0, 2000)])
            if not rows:
                rows = [[1, 1, 50]]
            sec = mixed_sim.step_seconds(cost, rows)
            t += sec + overhead
            f.write(json.dumps([t, sec, rows]) + "\n")


def test_features_split_decodes_from_prefill_chunks():
    f = dict(zip(mixed_sim.FEATURES, mixed_sim.step_features([[1, 1, 100], [0, 1, 2900], [0, 300, 1000]])))
    assert f["decode_rows"] == 2 and f["decode_ctx_k"] == 3.0
    assert f["prefill_100"] == 3.0 and f["prefill_attn_1e5"] == 300 * (1000 + 150) / 1e5
    assert f["prefill_over_128_100"] == pytest.approx(1.72) and f["prefill_over_256_100"] == pytest.approx(0.44)


def test_fit_recovers_the_model_and_the_loop_overhead(tmp_path):
    log = tmp_path / "steps.jsonl"
    synthetic_log(log)
    model = mixed_sim.fit([str(log)])
    for k, v in TRUE.items():
        assert model["coef"][k] == pytest.approx(v, abs=1e-6)
    assert model["overhead_s"] == pytest.approx(0.0015, abs=1e-6) and model["rms_ms"] < 1e-3
    assert model["steps"] == 400


def test_simulation_replays_the_benchmarks_workload_on_the_real_scheduler():
    cost = {"coef": TRUE, "overhead_s": 0.001}
    work = make_mixed_workload(40, 3)
    arrivals = arrival_times(40, 0.8, 3)
    runs = {p: mixed_sim.simulate(cost, p, 0.8, 40, 3) for p in ("fcfs", "length_aware")}
    for load in runs.values():
        res = load["results"]
        assert [r["cls"] for r in res] == [w["cls"] for w in work]
        assert all(r["ok"] and r["ttft"] > 0 and r["e2e"] >= r["ttft"] for r in res)
        assert load["duration"] >= arrivals[-1]
        s = summarize_mixed(load, 1000.0)
        assert s["completed"] == 40 and s["output_tok_s"] > 0
    assert mixed_sim.simulate(cost, "fcfs", 0.8, 40, 3) == runs["fcfs"]  # deterministic
    # the two policies make the same tokens (ignore_eos, exact lengths), in a different order
    assert sum(r["tokens"] for r in runs["fcfs"]["results"]) == sum(r["tokens"] for r in runs["length_aware"]["results"])
    assert runs["fcfs"]["results"] != runs["length_aware"]["results"]


def test_cli_fits_then_simulates(tmp_path, capsys):
    log = tmp_path / "steps.jsonl"
    synthetic_log(log, steps=100)
    cost = tmp_path / "cost.json"
    mixed_sim.main(["fit", str(log), "--out", str(cost)])
    capsys.readouterr()
    sets = ["--set", "long_lane_period=8", "--set", "max_num_batched_tokens=512", "--set", "enable_chunked_prefill=true"]
    mixed_sim.main(["run", "--cost", str(cost), "--rate", "0.5", "--num-requests", "20", *sets])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["policy"] for x in lines] == ["fcfs", "length_aware"]
    want = {"long_lane_period": 8, "max_num_batched_tokens": 512, "enable_chunked_prefill": True}
    assert all(x["completed"] == 20 and x["settings"] == want for x in lines)


def test_a_lone_request_is_timed_by_the_model():
    """One request arriving alone (a short chat turn for this seed): its first token ends its
    prefill step, each further one a decode step, each step timed by the model plus the
    loop's overhead."""
    cost = {"coef": TRUE, "overhead_s": 0.001}
    load = mixed_sim.simulate(cost, "fcfs", 0.01, 1, 5)
    (r,) = load["results"]
    (w,) = make_mixed_workload(1, 5)
    prompt, out = len(w["prompt"]), w["out"]
    assert w["cls"] == "short" and prompt <= 2048
    assert r["ttft"] == pytest.approx(mixed_sim.step_seconds(cost, [[0, prompt, 0]]))
    decode = [mixed_sim.step_seconds(cost, [[0, 1, prompt + k]]) for k in range(out - 1)]
    assert r["e2e"] == pytest.approx(r["ttft"] + sum(decode))
    assert r["tpot"] == pytest.approx(sum(decode) / (out - 1))
