"""The live view's raw data: a cheap snapshot taken in the engine core's loop (the
per-block view is built from it off the loop, in the front end: engine/live_view.py).

`build_snapshot(core)` runs between two steps, in the core's process, at most every
`snapshot_interval_ms` (core/core_proc.py): O(blocks held + cached) attribute reads,
no per-block dicts. It records, per request in the running batch and the head of the
waiting queue, its block ids and progress; the ids of the cached-but-free blocks; the
stats; the recent step records. Everything else (each block's owner, reference count,
tokens, state) follows from those and is derived by `block_view()` / `state_view()`
where the `/dashboard/state` document is built (the server's process), so the step loop
pays only for the copy. Measured in BENCHMARKS.md ("Dashboard").
"""

from __future__ import annotations

import dataclasses
import time
from itertools import islice
from operator import attrgetter

from pagedserve.core.request import RequestStatus

SNAPSHOT_VERSION = 1
# one step record: see EngineCore._record_step
STEP_FIELDS = (
    "time", "prefill_tokens", "decode_tokens", "num_reqs", "joined", "finished", "preempted", "seconds", "short_tokens"
)
MAX_WAITING_LISTED = 256  # waiting requests listed by id (all are counted)
MAX_STEPS = 300  # step records per snapshot (the timeline)


_STATUS = {
    RequestStatus.WAITING: "waiting",
    RequestStatus.RUNNING: "running",
    RequestStatus.PREEMPTED: "preempted",
    RequestStatus.WAITING_FOR_KV: "waiting_for_kv",
}


def build_snapshot(core) -> dict:
    """The raw state of an EngineCore (call between steps, from the core's thread).

    requests: [id, status, prompt tokens, output tokens, computed tokens, prefix-cache hit
    tokens, preemptions, arrival time, [block ids in order]] for every running request
    and the first MAX_WAITING_LISTED waiting ones (waiting requests hold no block)."""
    sched = core.scheduler
    kv = sched.kv
    pool = kv.pool
    waiting = sched.waiting
    reqs = [_row(r, "running", kv.req_to_blocks) for r in sched.running]
    reqs += [_row(r, _STATUS.get(r.status, "waiting"), kv.req_to_blocks) for r in islice(waiting.unordered(), MAX_WAITING_LISTED)]
    num_preempted = sum(1 for r in waiting.unordered() if r.status is RequestStatus.PREEMPTED)
    cached_free = _cached_free_ids(pool)
    records = core.step_records
    steps = list(islice(records, max(len(records) - MAX_STEPS, 0), None)) if records else []
    return {
        "version": SNAPSHOT_VERSION,
        "time": time.time(),
        "block_size": kv.block_size,
        "policy": sched.config.scheduling_policy,
        "num_blocks": pool.num_blocks,  # block ids 0..num_blocks-1; 0 is the null block
        "requests": reqs,
        "num_running": len(sched.running),
        "num_waiting": len(waiting),
        "num_preempted": num_preempted,
        "cached_free": cached_free,
        # blocks whose K/V were read back from the disk KV tier (until evicted again)
        "restored": sorted(sched.offload.restored) if getattr(sched, "offload", None) is not None else [],
        "stats": dataclasses.asdict(core.get_stats()),
        "steps": steps,
        "cost_s": 0.0,  # filled in by the publisher (the time this call took)
    }


def _row(r, status: str, req_to_blocks) -> list:
    return [
        r.request_id,
        status,
        len(r.prompt_token_ids),
        len(r.output_token_ids),
        r.num_computed_tokens,
        max(r.num_cached_tokens, 0),
        r.num_preemptions,
        r.arrival_time,
        list(map(_block_id, req_to_blocks.get(r.request_id, ()))),
        r.is_short,
        r.ttft_deadline,
        r.lora_request.lora_name if r.lora_request is not None else None,
    ]


_block_id = attrgetter("block_id")


def _cached_free_ids(pool) -> list[int]:
    """Ids of the free blocks that still hold a cached prefix: from whichever is shorter,
    the free queue or the prefix-cache map."""
    fq = pool.free_queue
    if fq.num_free < len(pool.cached_blocks):
        return [b.block_id for b in fq if b.block_hash is not None]
    return [b.block_id for b in pool.cached_blocks.values() if b.ref_cnt == 0]
