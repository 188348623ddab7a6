import pytest

from pagedserve.core.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block_tokens


def test_free_queue_order_and_remove():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4] and q.num_free == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert q.block_ids() == [1, 3, 4, 2]
    for _ in range(4):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft()


def test_pool_allocates_in_order_and_null_block_is_reserved():
    pool = BlockPool(6)
    assert pool.num_usable_blocks == 5 and pool.num_free_blocks == 5
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in a)
    pool.free_blocks(reversed(a))
    # freed tail first: 4, 5 were never used, then 3, 2, 1
    assert pool.free_queue.block_ids() == [4, 5, 3, 2, 1]
    with pytest.raises(ValueError):
        pool.get_new_blocks(6)


def test_shared_refs_and_lazy_eviction():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2, 3])
    pool.cache_block(b, h)
    pool.touch([b])
    assert b.ref_cnt == 2 and pool.num_shared_refs == 1
    pool.free_blocks([b])
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.num_shared_refs == 0
    # still cached while free
    assert pool.get_cached_block(h) is b
    # reviving it takes it out of the free queue
    pool.touch([b])
    assert b.ref_cnt == 1 and b.block_id not in pool.free_queue.block_ids()
    pool.free_blocks([b])
    # evicted only when a fresh block needs it: the two never-used blocks go first
    pool.get_new_blocks(2)
    assert pool.get_cached_block(h) is b
    (again,) = pool.get_new_blocks(1)
    assert again is b and pool.get_cached_block(h) is None and b.block_hash is None


def test_hash_chain_depends_on_parent_and_salt():
    h1 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2]) == h1 and len(h1) == 16
    assert hash_block_tokens(h1, [1, 2]) != h1
    assert hash_block_tokens(None, [1, 2], "tenant-a") != h1
    assert hash_block_tokens(None, [1, 2], "tenant-a") != hash_block_tokens(None, [1, 2], "tenant-b")
