"""The KV accounting audit, run by the core loop whenever the engine turns idle (as
SGLang's leak detector): with no request left, every block but the null block must be
free (ref count 0, in the free queue exactly once), the free queue's count must match
its links, and the prefix-cache map must name blocks that carry its hashes. Costs
O(blocks); runs once per idle period, never on the step path.
"""

from __future__ import annotations

from collections import Counter


def audit_idle_kv(kv) -> list[str]:
    """Problems found in an idle KVCacheManager's pool (empty: consistent). Each names the
    blocks and, for held ones, the requests still holding them."""
    pool = kv.pool
    problems = []
    in_queue = Counter(b.block_id for b in pool.free_queue)
    if sum(in_queue.values()) != pool.free_queue.num_free:
        problems.append(f"free queue counts {pool.free_queue.num_free} blocks but links {sum(in_queue.values())}")
    twice = sorted(i for i, n in in_queue.items() if n > 1)
    if twice:
        problems.append(f"blocks in the free queue more than once: {twice[:16]}")
    held = [b for b in pool.blocks[1:] if b.ref_cnt != 0]
    if held:
        owners = {rid: [b.block_id for b in blocks] for rid, blocks in kv.req_to_blocks.items() if blocks}
        ids = [f"{b.block_id}(ref {b.ref_cnt})" for b in held[:16]]
        problems.append(f"{len(held)} blocks still referenced with no request running: {ids}; tables: {owners}")
    missing = [b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0 and b.block_id not in in_queue]
    if missing:
        problems.append(f"{len(missing)} free blocks missing from the free queue: {missing[:16]}")
    stale = [h.hex()[:8] for h, b in pool.cached_blocks.items() if b.block_hash != h]
    if stale:
        problems.append(f"prefix-cache entries naming blocks with another hash: {stale[:16]}")
    return problems
