"""The disk KV tier (issue 34) through the real HTTP server: `pagedserve serve` with a KV
pool too small for two documents. A document evicted by others comes back from disk with
the same greedy completion; after a graceful stop (SIGTERM) a new server on the same
directory serves it from disk at once, identically. Every answer is a 200, /health is ok
and the idle KV audit finds no leaked block."""

import time

import httpx
import pytest

pytest.importorskip("fastapi")

from tests.e2e.test_faults import Serve  # noqa: E402
from tests.server.test_server import metric, wait_idle  # noqa: E402

# blocks of 8 tokens, a pool of 24: one 90-token document (+6 generated) takes 12 blocks,
# so the second and third documents evict the first from memory
FLAGS = ["--block-size", "8", "--num-kv-blocks", "24", "--max-model-len", "128", "--kv-offload-bytes", "64MiB"]
DOCS = [[(11 * d + 5 * i) % 200 + 3 for i in range(90)] for d in range(3)]
DOC_BLOCKS = (len(DOCS[0]) - 1) // 8  # full blocks a lookup can hit (the last token is computed)


@pytest.fixture(scope="module")
def model(checkpoint):
    return checkpoint("llama")


def _complete(url: str, doc: list[int]) -> str:
    body = {"prompt": doc, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    wait_idle(url, within=10)
    return r.json()["choices"][0]["text"]


def _m(url: str, name: str) -> float:
    v = metric(url, "pagedserve:" + name)
    assert v is not None, f"no {name} in /metrics"
    return v


def _m_reaches(url: str, name: str, at_least: float, within: float = 10.0) -> float:
    """The metric once it reaches `at_least` (the tier writes on its own thread, behind
    the steps: the idle core reports when the writes are done)."""
    deadline = time.monotonic() + within
    while (v := _m(url, name)) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return v


def _healthy_no_leak(url: str):
    """/health is ok and the idle audit (run once the engine is idle) found nothing."""
    deadline = time.monotonic() + 5
    while True:
        r = httpx.get(url + "/health", timeout=5)
        assert r.status_code == 200, r.text
        audit = r.json()["kv_audit"]
        assert audit == {"failures": 0, "last_error": None}, audit
        if _m(url, "kv_blocks_used") == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert _m(url, "kv_blocks_used") == 0
    assert _m(url, "kv_audit_failures_total") == 0


def test_disk_tier_through_the_server_and_across_a_restart(model, tmp_path):
    store = tmp_path / "kv"
    s = Serve(model, *FLAGS, "--kv-offload-dir", str(store))
    try:
        assert _m(s.url, "kv_offload_enabled") == 1
        cold = _complete(s.url, DOCS[0])
        for d in DOCS[1:]:  # evict document 0 from memory
            _complete(s.url, d)
        assert _m_reaches(s.url, "kv_offload_written_blocks_total", DOC_BLOCKS) >= DOC_BLOCKS
        hits0 = _m(s.url, "kv_offload_hits_total")
        assert hits0 == 0  # three different documents: nothing came from disk yet
        assert _complete(s.url, DOCS[0]) == cold
        assert _m(s.url, "kv_offload_hits_total") - hits0 >= DOC_BLOCKS // 2  # read back from disk
        assert _m(s.url, "kv_offload_failed_blocks_total") == 0
        assert _m(s.url, "kv_offload_errors_total") == 0
        _healthy_no_leak(s.url)
        s.proc.terminate()  # SIGTERM: the graceful path (the core saves what it still caches)
        assert s.proc.wait(30) == 0
    finally:
        s.stop()

    again = Serve(model, *FLAGS, "--kv-offload-dir", str(store))  # the same directory
    try:
        assert _m(again.url, "kv_offload_stored_blocks") >= DOC_BLOCKS
        assert _m(again.url, "kv_offload_hits_total") == 0
        assert _complete(again.url, DOCS[0]) == cold  # the first request after the restart
        assert _m(again.url, "kv_offload_hits_total") == DOC_BLOCKS  # the whole prefix from disk
        assert _m(again.url, "prefix_cache_hits_total") == 8 * DOC_BLOCKS
        assert _m(again.url, "kv_offload_failed_blocks_total") == 0
        _healthy_no_leak(again.url)
    finally:
        again.stop()
