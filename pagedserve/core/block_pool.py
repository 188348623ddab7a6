"""The pool of fixed-size KV-cache blocks: free list, reference counts, prefix-cache map.

Invariants (checked by the property tests):
  * every block except the null block is either free (ref_cnt == 0, in the free queue)
    or in use (ref_cnt > 0, not in the free queue);
  * a block's ref_cnt equals the number of block tables that hold it;
  * a free block may still carry a hash (it is "cached"): it is reused by a prefix hit
    until it is evicted, lazily, when a fresh block is needed;
  * `cached_blocks[h] is b` implies `b.block_hash == h`.
All operations are O(1) per block: the free queue is an intrusive doubly linked list.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Iterator, Sequence


class KVBlock:
    """Metadata of one physical KV block (the tensors live in the executor)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order (front is evicted first).

    Blocks freed last go to the back, so the least recently used cached block is
    evicted first. `remove` takes a block out of the middle in O(1) (a prefix hit on a
    free cached block).
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        """The free blocks, front (next evicted) first. O(n)."""
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free

    def block_ids(self) -> list[int]:
        """Free block ids, front (next evicted) first. O(n): for tests and debugging."""
        return [b.block_id for b in self]


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra: str | None = None, lora_id: int = 0
) -> bytes:
    """Chained 128-bit hash of one full block: (parent hash, its tokens, extra keys). A LoRA
    adapter's blocks (`lora_id` > 0) hash in a domain of their own (blake2b's personalization),
    so blocks of two adapters, or of an adapter and the base model, never match."""
    h = hashlib.blake2b(digest_size=16, person=b"lora" + lora_id.to_bytes(8, "little") if lora_id else b"")
    h.update(parent_hash or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"\x01salt:" + extra.encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    extra: str | None = None,
    limit: int | None = None,
    lora_id: int = 0,
) -> list[bytes]:
    """Append to `hashes` (the chain of the first len(hashes) blocks) the hashes of the
    further full blocks of `token_ids`, up to `limit` blocks in all; returns `hashes`."""
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    for i in range(len(hashes), n):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra, lora_id))
    return hashes


class BlockPool:
    """`num_blocks` blocks; block 0 is the null block (padding), never handed out."""

    NULL_BLOCK_ID = 0

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[bytes, KVBlock] = {}
        # sum over blocks of max(ref_cnt - 1, 0): the extra holders of shared blocks
        self.num_shared_refs = 0
        # (hash, block id) of every cached block evicted since the disk KV tier last took
        # them (core/kv_offload.py); None: no tier, nothing recorded
        self.evicted: list[tuple[bytes, int]] | None = None

    # -- allocation -------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.free_queue.num_free

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks from the front of the free queue (evicting their cached hash)."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one holder to each block (a prefix hit or a fork); revives free cached blocks."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            else:
                self.num_shared_refs += 1
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one holder from each block; blocks reaching 0 join the back of the free queue,
        in the given order (callers pass a request's blocks tail first, so the tail is evicted
        before the prefix that others are likelier to share)."""
        for b in ordered_blocks:
            if b.ref_cnt > 1:
                self.num_shared_refs -= 1
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, b
            if b.ref_cnt == 0:
                if b.block_hash is not None and not self.enable_caching:
                    b.block_hash = None
                self.free_queue.append(b)

    # -- prefix cache -----------------------------------------------------------
    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full block under its hash. If another block already holds the same
        content, the first one stays the canonical copy and this one stays uncached."""
        if block.block_hash is not None:
            return
        if block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        h = block.block_hash
        if h is not None and self.cached_blocks.get(h) is block:
            del self.cached_blocks[h]
            if self.evicted is not None:
                self.evicted.append((h, block.block_id))
        block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash. Blocks in use stay allocated; only reuse is lost."""
        for b in self.cached_blocks.values():
            b.block_hash = None
        self.cached_blocks.clear()

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)
