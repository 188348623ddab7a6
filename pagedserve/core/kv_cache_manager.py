"""Per-request block tables over a `BlockPool`: on-demand allocation and prefix reuse.

Invariants:
  * `req_to_blocks[r]` holds `ceil(tokens_allocated(r) / block_size)` blocks, in order;
    block i holds the K/V of tokens [i * block_size, (i + 1) * block_size);
  * the first `num_cached_blocks[r]` blocks of r are full and were offered to the prefix
    cache (registered, unless an identical block already was).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.core.block_pool import BlockPool, KVBlock, extend_block_hashes
from pagedserve.core.request import Request

_NO_BLOCKS: tuple[KVBlock, ...] = ()


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # -- prefix cache -----------------------------------------------------------
    def update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` to every full block of its known tokens."""
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt, lora_id=request.lora_int_id
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest chain of cached full blocks that prefixes the request's tokens.

        Never the whole sequence: at least its last token is recomputed, so that its
        logits exist. None for a request that wants prompt logprobs (as vLLM): a cached
        position has no logits to give. Returns (blocks, number of tokens they hold);
        touches nothing.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in request.block_hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def cache_keys(self, block_hash: bytes) -> list[bytes]:
        """The prefix-cache keys of one logical block (one per KV cache group)."""
        return [block_hash]

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # -- allocation -------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> Sequence[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` are prefix-cache hits (first scheduling only). Returns the
        freshly allocated blocks (possibly none), or None, changing nothing, when the
        pool is short: the scheduler then preempts or waits.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, ())
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        # Fast path (most decodes): the tokens fit in the blocks held and fill none.
        if (
            blocks
            and not new_computed_blocks
            and total <= len(blocks) * self.block_size
            and (not self.enable_caching or total // self.block_size <= self.num_cached_blocks.get(rid, 0))
        ):
            return _NO_BLOCKS
        new_computed_blocks = new_computed_blocks or []
        num_required = cdiv(total, self.block_size) - len(blocks) - len(new_computed_blocks)
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_required, 0) + num_revived > self.pool.num_free_blocks:
            return None
        if not blocks:
            blocks = self.req_to_blocks[rid] = []
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_required) if num_required > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, total)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # The tokens scheduled this step are known ids, and every layer writes its K/V
        # before any attention reads, so a block is shareable from the step that fills it.
        self.update_block_hashes(request)
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        if end > start:
            self.num_cached_blocks[request.request_id] = end

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks holding the first `num_tokens` tokens (after rejected
        speculative guesses); the rest go back to the pool. They were never offered to the
        prefix cache (they held no known tokens)."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks and len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            self.pool.free_blocks(reversed(tail))

    def free(self, request: Request) -> None:
        """Release all blocks of the request, tail first (the tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    # -- stats ------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_usable_blocks

    @property
    def request_capacity_blocks(self) -> int:
        """The longest request the cache can ever hold, in blocks of its tokens (admission)."""
        return self.pool.num_usable_blocks

    def blocks_held_at(self, num_tokens: int) -> int:
        """Physical blocks one request of `num_tokens` holds at most."""
        return cdiv(num_tokens, self.block_size)


def make_kv_cache_manager(
    num_blocks: int,
    block_size: int,
    enable_caching: bool = True,
    group_windows: Sequence[int | None] | None = None,
    max_num_batched_tokens: int | None = None,
) -> KVCacheManager:
    """One full-attention group (None or (None,)): the plain manager; else the hybrid one."""
    if not group_windows or tuple(group_windows) == (None,):
        return KVCacheManager(num_blocks, block_size, enable_caching)
    return HybridKVCacheManager(num_blocks, block_size, enable_caching, group_windows, max_num_batched_tokens)


class HybridKVCacheManager(KVCacheManager):
    """KV cache groups (vLLM's hybrid allocator): the layers are split into G groups of one
    attention kind each (full, or a sliding window W), every group the same number of
    layers, so one block of the pool is the same bytes for any group. A request holds one
    block table per group; a sliding group's blocks wholly before every future query's
    window go back to the pool as the request moves on (their entries become the null
    block), so at 8k tokens a 5-local : 1-global model holds ~1/4 of the full layout.

    At the scheduler's calls every group's table is flattened, logical block major:
    entry j * G + g is group g's block for tokens [j * bs, (j + 1) * bs) (the null block
    where a sliding group holds none). `allocate_slots` returns the entries it appended,
    `get_computed_blocks` hits in the same layout, `get_block_ids` the whole flat table.

    Invariants (beyond the pool's):
      * `tables[r][g]` has one entry per logical block of r's allocated tokens, in order;
      * a sliding group's entry j is the null block iff j < `released[r][g]`, which is
        first_visible(num_computed_tokens(r)) // bs at the last allocation: no query from
        r's next position on reads those positions;
      * a block's ref count = the number of (request, group) tables holding it;
      * prefix-cache keys are (block hash, group); a hit of k blocks has every full
        group's k blocks and each sliding group's blocks from the first one the next query
        sees (the rest null).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        group_windows: Sequence[int | None],
        max_num_batched_tokens: int | None = None,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        if len(group_windows) > 255:
            raise ValueError(f"at most 255 KV cache groups, got {len(group_windows)}")
        self.windows = tuple(group_windows)
        self.num_groups = len(self.windows)
        self.max_chunk = max_num_batched_tokens
        self.tables: dict[str, list[list[KVBlock]]] = {}
        self.released: dict[str, list[int]] = {}
        self.null = self.pool.null_block

    @property
    def req_to_blocks(self) -> dict[str, list[KVBlock]]:  # noqa: D102 (the snapshot's view)
        null = self.null
        return {r: [b for t in tables for b in t if b is not null] for r, tables in self.tables.items()}

    @req_to_blocks.setter
    def req_to_blocks(self, value) -> None:  # the base constructor's empty dict
        pass

    def _key(self, h: bytes, g: int) -> bytes:
        return h if g == 0 else h + bytes((g,))

    def cache_keys(self, block_hash: bytes) -> list[bytes]:
        return [self._key(block_hash, g) for g in range(self.num_groups)]

    def _first_visible_block(self, num_tokens: int, window: int) -> int:
        """The first block a query at position `num_tokens` can see through `window`."""
        return max(0, num_tokens - window + 1) // self.block_size

    # -- prefix cache -----------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest prefix of full blocks every group can serve: each full-attention
        group all of its blocks, each sliding group the blocks the next query sees."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self.update_block_hashes(request)
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        get = self.pool.get_cached_block
        found = [[get(self._key(h, g)) for h in hashes] for g in range(self.num_groups)]
        k = len(hashes)
        for g, w in enumerate(self.windows):
            if w is None:
                k = next((j for j, b in enumerate(found[g]) if b is None), k) if k else 0
        k = self._longest_window_hit(found, k)
        hits: list[KVBlock] = []
        firsts = [0 if w is None else self._first_visible_block(k * self.block_size, w) for w in self.windows]
        for j in range(k):
            hits.extend(found[g][j] if j >= firsts[g] else self.null for g in range(self.num_groups))
        return hits, k * self.block_size

    def _longest_window_hit(self, found: list[list[KVBlock | None]], k: int) -> int:
        """The largest k' <= k at which every sliding group has the blocks from the first
        one a query at k' * bs sees up to k' - 1 cached (runs of hits, one pass a group)."""
        ok = [True] * (k + 1)
        for g, w in enumerate(self.windows):
            if w is None:
                continue
            run = 0
            for j in range(k):
                run = run + 1 if found[g][j] is not None else 0
                ok[j + 1] = ok[j + 1] and run >= j + 1 - self._first_visible_block((j + 1) * self.block_size, w)
        return max(j for j in range(k + 1) if ok[j])

    # -- allocation -------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> Sequence[KVBlock] | None:
        """As the base manager's, over every group: first the blocks the request's sliding
        groups no longer see go back to the pool, then G blocks per new logical block."""
        rid, bs, G = request.request_id, self.block_size, self.num_groups
        tables = self.tables.get(rid)
        if tables is not None:
            self._release_out_of_window(rid, tables, request.num_computed_tokens)
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        have = len(tables[0]) if tables else 0
        hits = new_computed_blocks or []
        if (
            tables
            and not hits
            and total <= have * bs
            and (not self.enable_caching or total // bs <= self.num_cached_blocks.get(rid, 0))
        ):
            return _NO_BLOCKS
        num_logical = max(cdiv(total, bs) - have - len(hits) // G, 0)
        live_hits = [b for b in hits if b is not self.null]
        if num_logical * G + sum(1 for b in live_hits if b.ref_cnt == 0) > self.pool.num_free_blocks:
            return None
        if tables is None:
            tables = self.tables[rid] = [[] for _ in range(G)]
            self.released[rid] = [0] * G
        if hits:
            self.pool.touch(live_hits)
            for j in range(len(hits) // G):
                for g in range(G):
                    tables[g].append(hits[j * G + g])
            self.released[rid] = [self._leading_nulls(t) for t in tables]
        new_blocks = self.pool.get_new_blocks(num_logical * G) if num_logical else []
        for i, b in enumerate(new_blocks):
            tables[i % G].append(b)
        if self.enable_caching:
            self._cache_group_blocks(request, tables, total)
        return new_blocks

    def _leading_nulls(self, table: list[KVBlock]) -> int:
        return next((j for j, b in enumerate(table) if b is not self.null), len(table))

    def _release_out_of_window(self, rid: str, tables: list[list[KVBlock]], num_computed: int) -> None:
        released = self.released[rid]
        for g, w in enumerate(self.windows):
            if w is None:
                continue
            first = min(self._first_visible_block(num_computed, w), len(tables[g]))
            start = released[g]
            if first > start:
                table = tables[g]
                gone = [b for b in table[start:first] if b is not self.null]
                table[start:first] = [self.null] * (first - start)
                released[g] = first
                self.pool.free_blocks(reversed(gone))

    def _cache_group_blocks(self, request: Request, tables: list[list[KVBlock]], num_tokens: int) -> None:
        self.update_block_hashes(request)
        rid = request.request_id
        start = self.num_cached_blocks.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            h = request.block_hashes[i]
            for g in range(self.num_groups):
                b = tables[g][i]
                if b is not self.null:
                    self.pool.cache_block(b, self._key(h, g))
        if end > start:
            self.num_cached_blocks[rid] = end

    def trim(self, request: Request, num_tokens: int) -> None:
        """Every group keeps the blocks of the first `num_tokens` tokens."""
        tables = self.tables.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if tables and len(tables[0]) > keep:
            for t in tables:
                tail = [b for b in t[keep:] if b is not self.null]
                del t[keep:]
                self.pool.free_blocks(reversed(tail))

    def free(self, request: Request) -> None:
        tables = self.tables.pop(request.request_id, None)
        self.released.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if tables:
            self.pool.free_blocks(b for t in tables for b in reversed(t) if b is not self.null)

    def get_block_ids(self, request_id: str) -> list[int]:
        tables = self.tables.get(request_id)
        if not tables:
            return []
        return [t[j].block_id for j in range(len(tables[0])) for t in tables]

    # -- capacity ---------------------------------------------------------------
    def _sliding_cap(self, w: int) -> int:
        """Blocks a sliding group holds at most: the window plus a step's chunk."""
        chunk = self.max_chunk if self.max_chunk is not None else 1 << 40
        return cdiv(w - 1 + chunk, self.block_size) + 1

    def blocks_held_at(self, num_tokens: int) -> int:
        n = cdiv(num_tokens, self.block_size)
        return sum(n if w is None else min(n, self._sliding_cap(w)) for w in self.windows)

    @property
    def request_capacity_blocks(self) -> int:
        """The most blocks of tokens one request can have with all groups' blocks in the pool."""
        bs, usable = self.block_size, self.pool.num_usable_blocks
        lo, hi = 0, usable if None in self.windows else 1 << 30  # sliding groups only: no bound
        while lo < hi:  # blocks_held_at is monotone in the length
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.blocks_held_at(mid * bs) <= usable else (lo, mid - 1)
        return lo
