"""The second KV tier's decisions (vLLM's KV connector, scheduler side): which blocks go to
the disk store and which come back. The bytes move in the executor's connector
(executor/kv_offload_store.py), on its own I/O thread.

  * Save: the block pool records every cached block it evicts (`BlockPool.evicted`);
    at the end of each `schedule()` those blocks' K/V are copied out (before this step's
    forward overwrites their slots) and queued for writing; blocks the store already
    holds are skipped. At shutdown every cached block still in memory is saved too, so a
    restart finds the whole prefix cache.
  * Load: a waiting request at the head of the queue whose prefix continues, past the
    memory hits, in the store gets fresh blocks for the stored ones and a read is queued;
    it waits in WAITING_FOR_KV (out of the queue's head: others go on) while the thread
    reads. The manager holds one reference on every block of that prefix (the memory
    hits too, so nothing it needs is evicted meanwhile). When the read is done the
    verified blocks are copied in and registered in the prefix cache under their hashes;
    the request becomes WAITING, its prefix lookup now hits in memory, and the holds are
    dropped once it is admitted (or when it ends). A block that failed to read is freed
    uncached: the request recomputes from there.
Blocks in flight are ordinary pool blocks with a holder, so the idle KV audit sees them
like any other (no request left: no hold left).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

from pagedserve.core.block_pool import KVBlock
from pagedserve.core.request import Request

logger = logging.getLogger(__name__)


@dataclass
class _Load:
    job_id: int
    held: list[KVBlock]  # memory hits, then the blocks being filled, prefix order
    keys: list[bytes]  # store keys of the blocks being filled
    targets: list[KVBlock] = field(default_factory=list)
    done: bool = False


class KVOffloadManager:
    """Between a scheduler's KV cache manager (`kv`) and an executor's connector."""

    def __init__(self, kv, connector) -> None:
        self.kv = kv
        self.pool = kv.pool
        self.connector = connector
        self.pool.evicted = []  # the pool records evicted cached blocks from now on
        self.loads: dict[str, _Load] = {}
        self._by_job: dict[int, str] = {}
        self._ids = itertools.count()
        self.restored: set[int] = set()  # ids of blocks whose K/V came back from disk
        # counters (blocks)
        self.hit_blocks = 0  # blocks found in the store and queued for reading
        self.miss_blocks = 0  # full prompt blocks of admitted requests found in neither tier
        self.restored_blocks = 0  # read, verified, in the pool
        self.failed_blocks = 0  # queued but not served (bad checksum, gone, I/O error)
        self.saved_blocks = 0  # queued for writing

    @property
    def enabled(self) -> bool:
        return self.connector.enabled

    # -- save ---------------------------------------------------------------------------
    def flush_evictions(self) -> None:
        """End of schedule(): copy out this step's evicted cached blocks and queue them."""
        ev = self.pool.evicted
        if not ev:
            return
        self.pool.evicted = []
        for _, bid in ev:
            self.restored.discard(bid)
        self.saved_blocks += self.connector.save(ev)

    def save_all_cached(self) -> None:
        """Shutdown: queue every cached block still in memory (its K/V is computed: between
        steps every scheduled token has run)."""
        self.flush_evictions()
        self.saved_blocks += self.connector.save([(h, b.block_id) for h, b in self.pool.cached_blocks.items()])

    # -- load ---------------------------------------------------------------------------
    def start_load(self, req: Request) -> bool:
        """Queue a read of the stored blocks that extend `req`'s cached prefix; True if one
        was queued (the request must then wait for `ready`)."""
        kv, pool = self.kv, self.pool
        if req.request_id in self.loads or not self.connector.enabled or not kv.enable_caching:
            return False
        if req.sampling_params.prompt_logprobs is not None:
            return False
        kv.update_block_hashes(req)
        in_mem, keys = self._extend_prefix(req.block_hashes[: (req.num_tokens - 1) // kv.block_size])
        if not keys:
            return False
        revive = sum(1 for b in in_mem if b.ref_cnt == 0)
        if len(keys) + revive > pool.num_free_blocks:
            return False  # no room now: the request runs without the tier
        pool.touch(in_mem)
        targets = pool.get_new_blocks(len(keys))
        job = _Load(next(self._ids), in_mem + targets, keys, targets)
        self.loads[req.request_id] = job
        self._by_job[job.job_id] = req.request_id
        self.hit_blocks += len(keys)
        self.connector.load(job.job_id, keys, [b.block_id for b in targets])
        return True

    def _extend_prefix(self, hashes: list[bytes]) -> tuple[list[KVBlock], list[bytes]]:
        """Walk the chain: each logical block must be in memory or in the store for every
        KV cache group; returns (memory blocks, store keys) of the longest such prefix
        that ends with a stored block."""
        get, contains, keys_of = self.pool.get_cached_block, self.connector.contains, self.kv.cache_keys
        in_mem: list[KVBlock] = []
        keys: list[bytes] = []
        mem_at_last_key = 0
        for h in hashes:
            ks = keys_of(h)
            found = [get(k) for k in ks]
            missing = [k for k, b in zip(ks, found) if b is None]
            if missing and not all(contains(k) for k in missing):
                break
            in_mem.extend(b for b in found if b is not None)
            keys.extend(missing)
            if missing:
                mem_at_last_key = len(in_mem)
        return in_mem[:mem_at_last_key], keys

    def ready(self, req: Request) -> bool:
        job = self.loads.get(req.request_id)
        return job is None or job.done

    def poll(self) -> None:
        """Start of schedule(): finished reads are copied in (by the connector) and their
        blocks registered in the prefix cache; failed ones go back to the pool uncached."""
        for res in self.connector.poll():
            rid = self._by_job.pop(res.job_id, None)
            job = self.loads.get(rid) if rid is not None else None
            if job is None:
                continue
            for b, key, payload in zip(job.targets, job.keys, res.payloads):
                if payload is None:
                    self.failed_blocks += 1
                    continue
                self.pool.cache_block(b, key)
                self.restored.add(b.block_id)
                self.restored_blocks += 1
            job.done = True

    def has_pending(self) -> bool:
        return any(not j.done for j in self.loads.values())

    def on_admitted(self, req: Request, num_hit: int) -> None:
        bs = self.kv.block_size
        self.miss_blocks += max((req.num_tokens - 1) // bs - num_hit // bs, 0)
        self.release(req)

    def release_others(self, head: Request) -> None:
        """The head of the queue cannot be admitted and nothing runs: drop every other
        request's holds (restored blocks stay cached and free, so they are still likely
        hits), so that held blocks never stall the engine."""
        for rid in [r for r in self.loads if r != head.request_id]:
            self._drop(self.loads.pop(rid))

    def release(self, req: Request) -> None:
        """The request was admitted (it holds its blocks itself now) or ended: drop the
        manager's holds."""
        job = self.loads.pop(req.request_id, None)
        if job is not None:
            self._drop(job)

    def _drop(self, job: _Load) -> None:
        """A read still in flight is cancelled (its bytes are never copied in), so its
        blocks go back to the pool at once, uncached."""
        if not job.done:
            self._by_job.pop(job.job_id, None)
            self.connector.cancel(job.job_id)
        self.pool.free_blocks(reversed(job.held))

    # -- stats --------------------------------------------------------------------------
    def fill_stats(self, stats) -> None:
        """The tier's figures into an EngineStats (messages.py)."""
        c, store = self.connector.counters, self.connector.store
        stats.kv_offload_enabled = int(self.connector.enabled)
        stats.kv_offload_hit_blocks = self.restored_blocks
        stats.kv_offload_miss_blocks = self.miss_blocks
        stats.kv_offload_failed_blocks = self.failed_blocks + store.num_corrupt
        stats.kv_offload_corrupt_blocks = store.num_corrupt
        stats.kv_offload_saved_blocks = c.blocks_written
        stats.kv_offload_dropped_saves = c.saves_dropped
        stats.kv_offload_bytes_written = c.bytes_written
        stats.kv_offload_bytes_read = c.bytes_read
        stats.kv_offload_write_seconds = c.write_seconds
        stats.kv_offload_read_seconds = c.read_seconds
        stats.kv_offload_stored_blocks = len(store)
        stats.kv_offload_stored_bytes = store.bytes_used
        stats.kv_offload_errors = c.errors
