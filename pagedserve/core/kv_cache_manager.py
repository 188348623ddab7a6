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
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)

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
