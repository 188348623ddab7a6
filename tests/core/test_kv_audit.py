"""core/kv_audit.py and the core's idle audit: a consistent idle pool passes, a leaked
reference, a block lost from the free queue and a stale prefix-cache entry are named."""

from pagedserve.core.kv_audit import audit_idle_kv
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.sampling_params import SamplingParams


def manager_after_one_request():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    r = Request("r", list(range(10)), SamplingParams(max_tokens=4), max_tokens=4)
    blocks, hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, 10, blocks, hit) is not None
    kv.free(r)
    return kv, r


def test_an_idle_pool_after_a_request_is_consistent():
    kv, _ = manager_after_one_request()
    assert audit_idle_kv(kv) == []


def test_a_leaked_reference_is_named_with_its_holder():
    kv, r = manager_after_one_request()
    blocks, hit = kv.get_computed_blocks(r)
    kv.allocate_slots(r, 10 - hit, blocks, hit)  # a request's blocks are held...
    held = kv.get_block_ids("r")
    (problem,) = audit_idle_kv(kv)  # ...while the engine believes it is idle
    assert "still referenced" in problem and str(held[0]) in problem and "'r'" in problem


def test_a_block_missing_from_the_free_queue_and_a_stale_hash():
    kv, _ = manager_after_one_request()
    pool = kv.pool
    lost = pool.free_queue.popleft()  # gone from the queue, ref count 0
    h, b = next(iter(pool.cached_blocks.items()))
    b.block_hash = b"x" * 16
    problems = audit_idle_kv(kv)
    assert any(f"missing from the free queue: [{lost.block_id}]" in p for p in problems)
    assert any("another hash" in p for p in problems)


def test_the_idle_core_audits_once_and_reports_in_its_stats(checkpoint):
    from pagedserve.core.engine_core import EngineCore
    from pagedserve.engine_args import EngineArgs

    core = EngineCore(EngineArgs(model=checkpoint("llama"), dtype="float32", num_kv_blocks=32).create_engine_config())
    assert core.on_idle() is False and core.get_stats().kv_audit_failures == 0
    core.scheduler.kv.pool.blocks[3].ref_cnt = 1  # a leak
    assert core.on_idle() is False  # audited already in this idle period
    core.step()  # any step ends the idle period
    assert core.on_idle() is True
    st = core.get_stats()
    assert st.kv_audit_failures == 1 and "block" in st.kv_audit_error
    assert core.on_idle() is False  # once per idle period
