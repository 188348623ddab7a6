"""The disk KV tier in the engine: greedy outputs identical with and without it (cold, warm
in memory, warm from disk with a pool too small to keep the documents, after a restart),
no leaked blocks, another model's namespace is empty, torn files are never served, I/O
errors degrade to no tier, a request aborted while its prefix is read leaks nothing."""

import errno
import os

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.core.kv_audit import audit_idle_kv
from pagedserve.core.request import RequestStatus
from pagedserve.executor.kv_offload_store import KVBlockStore

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# 5 documents of 41-73 tokens; blocks of 8 tokens; a pool of 24 blocks holds ~2 of them
DOCS = [[(7 * d + 3 * i) % 250 + 3 for i in range(41 + 8 * d)] for d in range(5)]
KW = dict(dtype="float32", max_model_len=128, block_size=8)


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model_dir, num_kv_blocks=200, enable_prefix_caching=False, **KW)
    outs = llm.generate([{"prompt_token_ids": d} for d in DOCS], GREEDY, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def _ask(llm, order):
    """One document at a time (each alone in the engine): its output tokens."""
    return [llm.generate({"prompt_token_ids": DOCS[d]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for d in order]


def _core(llm):
    return llm.engine.engine_core


def _tier_llm(model_dir, path, **kw):
    return LLM(model_dir, num_kv_blocks=24, kv_offload_dir=str(path), kv_offload_bytes="64MiB", **KW, **kw)


def test_same_outputs_cold_warm_from_disk_and_after_restart(model_dir, reference, tmp_path):
    llm = _tier_llm(model_dir, tmp_path)
    order = [0, 1, 2, 3, 4, 0, 1, 4, 4]  # 0 and 1 come back after eviction; 4 twice warm in memory
    assert _ask(llm, order) == [reference[d] for d in order]
    core = _core(llm)
    st = llm.get_stats()
    assert st.kv_offload_enabled and st.kv_offload_hit_blocks >= 8  # docs 0 and 1 came back from disk
    assert st.kv_offload_failed_blocks == 0 and st.kv_offload_errors == 0
    assert audit_idle_kv(core.scheduler.kv) == []
    assert core.scheduler.offload.loads == {}  # no hold left
    computed_warm = st.prompt_tokens - st.prefix_cache_hits
    llm.shutdown()  # saves what is still cached in memory
    # restart: the store's index is rebuilt; every document is a hit at once
    again = _tier_llm(model_dir, tmp_path)
    st0 = again.get_stats()
    assert st0.kv_offload_stored_blocks >= sum(len(d) // 8 for d in DOCS) - 1
    assert _ask(again, [3, 0]) == [reference[3], reference[0]]
    st = again.get_stats()
    assert st.kv_offload_hit_blocks == (len(DOCS[3]) - 1) // 8 + (len(DOCS[0]) - 1) // 8
    assert st.prefix_cache_hits == 8 * st.kv_offload_hit_blocks  # the restored blocks served the prompts
    assert audit_idle_kv(_core(again).scheduler.kv) == []
    # the live view marks the restored blocks (those not evicted since)
    from pagedserve.engine.live_view import block_view

    snap = _core(again).snapshot()
    assert 0 < len(snap["restored"]) <= st.kv_offload_hit_blocks
    assert block_view(snap)["restored"] == snap["restored"]
    again.shutdown()
    assert computed_warm < sum(len(DOCS[d]) for d in order)


def test_another_models_entries_are_refused(model_dir, reference, tmp_path):
    llm = _tier_llm(model_dir, tmp_path)
    _ask(llm, [0, 1, 2])
    llm.shutdown()
    # another KV dtype: another namespace, nothing found; outputs from its own compute
    other = _tier_llm(model_dir, tmp_path, kv_cache_dtype="bfloat16")
    st = other.get_stats()
    assert st.kv_offload_stored_blocks == 0
    _ask(other, [0])
    assert other.get_stats().kv_offload_hit_blocks == 0
    other.shutdown()
    assert len(os.listdir(tmp_path)) == 2


def test_torn_files_are_never_served(model_dir, reference, tmp_path):
    llm = _tier_llm(model_dir, tmp_path)
    _ask(llm, [0, 1])
    llm.shutdown()
    (ns,) = os.listdir(tmp_path)
    files = sorted(os.listdir(tmp_path / ns))
    for name in files:  # every stored block damaged: a crash mid-write, or bit rot
        p = tmp_path / ns / name
        data = bytearray(p.read_bytes())
        data[-3] ^= 0xFF
        p.write_bytes(bytes(data))
    again = _tier_llm(model_dir, tmp_path)
    assert _ask(again, [0, 1]) == [reference[0], reference[1]]
    st = again.get_stats()
    assert st.kv_offload_hit_blocks == 0 and st.kv_offload_corrupt_blocks > 0
    assert audit_idle_kv(_core(again).scheduler.kv) == []
    again.shutdown()


def test_disk_full_degrades_to_no_tier(model_dir, reference, tmp_path, monkeypatch):
    def full(self, *a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(KVBlockStore, "_write_file", full)
    llm = _tier_llm(model_dir, tmp_path)
    order = [0, 1, 2, 3, 4, 0]
    assert _ask(llm, order) == [reference[d] for d in order]
    assert _core(llm).scheduler.offload.connector.drain(10)  # writes are off the step loop
    st = llm.get_stats()
    assert not st.kv_offload_enabled and st.kv_offload_errors == 1 and st.kv_offload_hit_blocks == 0
    assert audit_idle_kv(_core(llm).scheduler.kv) == []
    llm.shutdown()


def test_abort_while_waiting_for_kv_leaks_nothing(model_dir, reference, tmp_path):
    llm = _tier_llm(model_dir, tmp_path)
    _ask(llm, [0, 1, 2, 3, 4])  # doc 0 evicted to disk
    core = _core(llm)
    conn = core.scheduler.offload.connector
    from pagedserve.messages import EngineCoreRequest

    core.add_request(EngineCoreRequest("r0", DOCS[0], GREEDY, 6))
    core.step()  # queues the read; the request waits for it
    req = core.scheduler.requests["r0"]
    assert req.status is RequestStatus.WAITING_FOR_KV
    core.abort_requests(["r0"])
    conn.drain(10)
    core.step()  # the cancelled read's result is dropped
    assert audit_idle_kv(core.scheduler.kv) == [] and core.scheduler.offload.loads == {}
    assert _ask(llm, [0]) == [reference[0]]
    llm.shutdown()


def test_hybrid_groups_round_trip_through_the_manager(tmp_path):
    """Sliding-window models (several KV cache groups): every group's block of a logical
    block is saved at eviction under its own key and comes back into fresh blocks that
    the hybrid prefix lookup then hits, bytes intact."""
    import torch

    from pagedserve.core.kv_cache_manager import make_kv_cache_manager
    from pagedserve.core.kv_offload import KVOffloadManager
    from pagedserve.core.request import Request
    from pagedserve.executor.kv_offload_store import KVOffloadConnector, kv_fingerprint

    kv = make_kv_cache_manager(11, 8, True, (None, 16))
    g = torch.Generator().manual_seed(0)
    caches = [tuple(torch.randn(11, 8, 1, 2, generator=g) for _ in range(2)) for _ in range(2)]
    conn = KVOffloadConnector(KVBlockStore(str(tmp_path), kv_fingerprint(t=1), 1 << 30), caches)
    mgr = KVOffloadManager(kv, conn)
    a = Request("a", list(range(33)), SamplingParams())
    kv.allocate_slots(a, 33)
    a_ids = kv.get_block_ids("a")[:8]  # 4 logical blocks x 2 groups
    want = [caches[0][0][b].clone() for b in a_ids]
    kv.free(a)
    kv.allocate_slots(Request("b", list(range(100, 140)), SamplingParams()), 40)  # evicts a's blocks
    mgr.flush_evictions()  # copied out here, at the end of the schedule
    for k, v in caches:  # then b's forward overwrites the slots
        k.normal_(generator=g)
        v.normal_(generator=g)
    assert conn.drain(10) and len(conn.store) == 8
    kv.free(Request("b", [], SamplingParams()))
    a2 = Request("a2", list(range(33)), SamplingParams())
    assert kv.get_computed_blocks(a2)[1] == 0  # gone from memory
    assert mgr.start_load(a2)
    assert conn.drain(10)
    mgr.poll()
    hits, n = kv.get_computed_blocks(a2)
    assert n == 32 and mgr.restored_blocks == 8
    live = [(b, w) for b, w in zip(hits, want) if b.block_id != 0]  # the window's unseen blocks are null
    assert len(live) == 6 and all(torch.equal(caches[0][0][b.block_id], w) for b, w in live)
    kv.allocate_slots(a2, 1, hits, n)
    mgr.on_admitted(a2, n)
    kv.free(a2)
    assert audit_idle_kv(kv) == [] and mgr.loads == {}
    conn.shutdown(1)


def test_flags_and_metrics():
    """--kv-offload-dir / --kv-offload-bytes reach the cache config; /metrics shows the tier."""
    import argparse

    pytest.importorskip("prometheus_client")
    from pagedserve.engine_args import EngineArgs
    from pagedserve.messages import EngineStats
    from pagedserve.server.metrics import ServerMetrics

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--kv-offload-dir", "/tmp/kvtier", "--kv-offload-bytes", "20GiB"])
    cc = EngineArgs.from_cli_args(ns).create_engine_config().cache
    assert cc.kv_offload_dir == "/tmp/kvtier" and cc.kv_offload_bytes == 20 * 2**30
    with pytest.raises(ValueError, match="kv_offload_bytes"):
        LLM("x", kv_offload_bytes=0)
    stats = EngineStats(*([0] * 16), kv_offload_enabled=1, kv_offload_hit_blocks=7, kv_offload_read_seconds=0.25)
    text = ServerMetrics(lambda: stats, "m").render().decode()
    assert 'pagedserve:kv_offload_hits_total{model_name="m"} 7.0' in text
    assert 'pagedserve:kv_offload_read_seconds_total{model_name="m"} 0.25' in text
    assert 'pagedserve:kv_offload_enabled{engine="0",model_name="m"} 1.0' in text


def test_holds_never_stall_the_head(tmp_path):
    """Two requests' prefixes read back; the second's holds are dropped when the head
    cannot be admitted with nothing running (its restored blocks stay cached)."""
    import torch

    from pagedserve.core.kv_cache_manager import make_kv_cache_manager
    from pagedserve.core.kv_offload import KVOffloadManager
    from pagedserve.core.request import Request
    from pagedserve.executor.kv_offload_store import KVOffloadConnector, kv_fingerprint

    kv = make_kv_cache_manager(9, 8, True)
    caches = [tuple(torch.zeros(9, 8, 1, 2) for _ in range(2))]
    conn = KVOffloadConnector(KVBlockStore(str(tmp_path), kv_fingerprint(t=2), 1 << 30), caches)
    mgr = KVOffloadManager(kv, conn)
    for rid, base in (("a", 0), ("b", 100)):  # 3 full blocks each, then evicted
        r = Request(rid, list(range(base, base + 25)), SamplingParams())
        kv.allocate_slots(r, 25)
        kv.free(r)
    kv.allocate_slots(Request("c", list(range(500, 564)), SamplingParams()), 64)
    mgr.flush_evictions()
    kv.free(Request("c", [], SamplingParams()))
    assert conn.drain(10) and len(conn.store) == 6
    a2, b2 = (Request(r, list(range(s, s + 25)), SamplingParams()) for r, s in (("a2", 0), ("b2", 100)))
    assert mgr.start_load(a2) and mgr.start_load(b2)
    assert kv.pool.num_free_blocks == 8 - 6
    conn.drain(10)
    mgr.poll()
    mgr.release_others(a2)
    assert list(mgr.loads) == ["a2"] and kv.pool.num_free_blocks == 8 - 3
    assert kv.get_computed_blocks(b2)[1] == 24  # b2's restored blocks are still cached, free
    mgr.release(a2)
    assert audit_idle_kv(kv) == []
    conn.shutdown(1)


def test_engine_core_process_saves_at_shutdown(model_dir, reference, tmp_path):
    """The core in its own process: the tier works there and its shutdown publishes what
    was still cached in memory, for the next engine."""
    llm = _tier_llm(model_dir, tmp_path, engine_core_process=True)
    assert _ask(llm, [0, 1]) == [reference[0], reference[1]]  # nothing evicted: all in memory
    assert llm.get_stats().kv_offload_enabled == 1
    llm.shutdown()
    again = _tier_llm(model_dir, tmp_path)
    assert _ask(again, [1]) == [reference[1]]
    assert again.get_stats().kv_offload_hit_blocks == (len(DOCS[1]) - 1) // 8
    again.shutdown()


def test_idle_core_reports_writes_that_finish_after_the_last_step(model_dir, tmp_path):
    """The tier writes on its own thread, behind the steps: the idle core says it has news
    (so the front end's metrics catch up) once the writes are done, and only then."""
    llm = _tier_llm(model_dir, tmp_path)
    core = _core(llm)
    core.on_idle()  # the first look records the counters
    assert core.on_idle() is False  # nothing moved
    _ask(llm, [0, 1, 2, 3, 4])  # the first documents are evicted and queued for writing
    core.kv_offload.connector.drain()
    assert not core.io_pending()
    assert core.kv_offload.connector.counters.blocks_written > 0
    assert core.on_idle() is True  # the writes finished after the last step
    assert core.on_idle() is False  # said once
    llm.shutdown()
