from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.sampling_params import SamplingParams


def make_req(rid, n, start=0, salt=None):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=8), cache_salt=salt)


def test_allocate_on_demand_exact_ids():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    r = make_req("a", 6)
    assert [b.block_id for b in kv.allocate_slots(r, 6)] == [1, 2]
    r.num_computed_tokens = 6
    assert list(kv.allocate_slots(r, 2)) == []  # fits in block 2
    r.num_computed_tokens = 8
    assert [b.block_id for b in kv.allocate_slots(r, 1)] == [3]
    assert kv.get_block_ids("a") == [1, 2, 3]
    assert kv.num_used_blocks == 3
    kv.free(r)
    assert kv.num_used_blocks == 0
    assert kv.pool.free_queue.block_ids()[-3:] == [3, 2, 1]


def test_allocate_returns_none_and_changes_nothing_when_short():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    a, b = make_req("a", 8), make_req("b", 8)
    assert kv.allocate_slots(a, 8) is not None
    assert kv.allocate_slots(b, 8) is None
    assert kv.num_used_blocks == 2 and kv.get_block_ids("b") == []


def test_prefix_hit_leaves_last_token_and_shares_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_req("a", 8)
    kv.allocate_slots(a, 8)
    b = make_req("b", 8)
    blocks, n = kv.get_computed_blocks(b)
    # 8 tokens = 2 full blocks, but the last token must be recomputed: only 1 block hits
    assert n == 4 and [x.block_id for x in blocks] == [1]
    kv.allocate_slots(b, 4, blocks, n)
    assert kv.get_block_ids("b") == [1, 3]
    assert kv.pool.blocks[1].ref_cnt == 2 and kv.pool.num_shared_refs == 1
    c = make_req("c", 9)  # 2 full blocks + 1 token
    blocks, n = kv.get_computed_blocks(c)
    assert n == 8 and [x.block_id for x in blocks] == [1, 2]


def test_salt_isolates():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    kv.allocate_slots(make_req("a", 9, salt="x"), 9)
    assert kv.get_computed_blocks(make_req("b", 9, salt="y"))[1] == 0
    assert kv.get_computed_blocks(make_req("c", 9))[1] == 0
    assert kv.get_computed_blocks(make_req("d", 9, salt="x"))[1] == 8


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    kv = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable
    a = make_req("a", 9)
    kv.allocate_slots(a, 9)  # blocks 1, 2, 3 (1 and 2 full, cached)
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [4, 3, 2, 1]
    b = make_req("b", 9)
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8
    kv.allocate_slots(b, 1, blocks, n)  # revives 1, 2 and takes a fresh block (4)
    assert kv.get_block_ids("b") == [1, 2, 4]
    kv.free(b)
    # a request with other tokens evicts the LRU ones: 3 first (a's tail), then 4 ... 1 last
    c = make_req("c", 16, start=100)
    kv.allocate_slots(c, 16)
    assert kv.get_block_ids("c") == [3, 4, 2, 1]
    assert kv.pool.num_cached_blocks == 4  # c's own full blocks, a's are gone
