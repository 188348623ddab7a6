"""The live view's data: a cheap raw snapshot taken in the engine core's loop, and the
per-block view built from it off the loop (in the front end).

`build_snapshot(core)` runs between two steps, in the core's process, at most every
`snapshot_interval_ms` (engine/core_proc.py): O(blocks held + cached) attribute reads,
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

from pagedserve.engine.request import RequestStatus

SNAPSHOT_VERSION = 1
# one step record: see EngineCore._record_step
STEP_FIELDS = ("time", "prefill_tokens", "decode_tokens", "num_reqs", "joined", "finished", "preempted", "seconds")
MAX_WAITING_LISTED = 256  # waiting requests listed by id (all are counted)
MAX_STEPS = 300  # step records per snapshot (the timeline)

# block states in block_view()["state"]
NULL, FREE, CACHED, USED, SHARED = -1, 0, 1, 2, 3
STATE_NAMES = {NULL: "null", FREE: "free", CACHED: "cached", USED: "used", SHARED: "shared"}

_STATUS = {
    RequestStatus.WAITING: "waiting",
    RequestStatus.RUNNING: "running",
    RequestStatus.PREEMPTED: "preempted",
}


def build_snapshot(core) -> dict:
    """The raw state of an EngineCore (call between steps, from the core's thread).

    requests: [id, status, prompt tokens, output tokens, computed tokens, prefix-cache hit
    tokens, preemptions, arrival time, [block ids in order]] for every running request
    and the first MAX_WAITING_LISTED waiting ones (waiting requests hold no block)."""
    sched = core.scheduler
    kv = sched.kv
    pool = kv.pool
    req_to_blocks = kv.req_to_blocks
    no_blocks = ()
    block_id = attrgetter("block_id")
    reqs = []
    for r in sched.running:
        reqs.append(
            [
                r.request_id,
                "running",
                len(r.prompt_token_ids),
                len(r.output_token_ids),
                r.num_computed_tokens,
                max(r.num_cached_tokens, 0),
                r.num_preemptions,
                r.arrival_time,
                list(map(block_id, req_to_blocks.get(r.request_id, no_blocks))),
            ]
        )
    waiting = sched.waiting
    num_preempted = 0
    for r in _iter_queue(waiting):
        if r.status is RequestStatus.PREEMPTED:
            num_preempted += 1
    for r in islice(_iter_queue(waiting), MAX_WAITING_LISTED):
        reqs.append(
            [
                r.request_id,
                _STATUS.get(r.status, "waiting"),
                len(r.prompt_token_ids),
                len(r.output_token_ids),
                r.num_computed_tokens,
                max(r.num_cached_tokens, 0),
                r.num_preemptions,
                r.arrival_time,
                list(map(block_id, req_to_blocks.get(r.request_id, no_blocks))),
            ]
        )
    cached_free = _cached_free_ids(pool)
    records = core.step_records
    steps = list(islice(records, max(len(records) - MAX_STEPS, 0), None)) if records else []
    return {
        "version": SNAPSHOT_VERSION,
        "time": time.time(),
        "block_size": kv.block_size,
        "num_blocks": pool.num_blocks,  # block ids 0..num_blocks-1; 0 is the null block
        "requests": reqs,
        "num_running": len(sched.running),
        "num_waiting": len(waiting),
        "num_preempted": num_preempted,
        "cached_free": cached_free,
        "stats": dataclasses.asdict(core.get_stats()),
        "steps": steps,
        "cost_s": 0.0,  # filled in by the publisher (the time this call took)
    }


def _cached_free_ids(pool) -> list[int]:
    """Ids of the free blocks that still hold a cached prefix: from whichever is shorter,
    the free queue or the prefix-cache map."""
    fq = pool.free_queue
    if fq.num_free < len(pool.cached_blocks):
        out, b, tail = [], fq._head.next_free, fq._tail  # the queue's own links (O(free))
        while b is not tail:
            if b.block_hash is not None:
                out.append(b.block_id)
            b = b.next_free
        return out
    return [b.block_id for b in pool.cached_blocks.values() if b.ref_cnt == 0]


def _iter_queue(waiting):
    """The waiting queue in order, without sorting a priority heap (its order is the
    heap's; good enough for a view)."""
    heap = getattr(waiting, "_heap", None)
    if heap is not None:
        return (e[3] for e in heap)
    return iter(waiting)


def block_view(snap: dict) -> dict:
    """Per-block columns from a raw snapshot, indexed by block id (O(blocks)):
    state (NULL/FREE/CACHED/USED/SHARED), owner (index into snap["requests"] of the first
    holder, -1 if none), ref (holders), tokens (tokens stored); plus `owners` for shared
    blocks only: {block id: [request indices]}."""
    n, bs = snap["num_blocks"], snap["block_size"]
    state = [FREE] * n
    owner = [-1] * n
    ref = [0] * n
    tokens = [0] * n
    shared: dict[int, list[int]] = {}
    for bid in snap["cached_free"]:
        state[bid] = CACHED
    used = stored = 0
    for k, req in enumerate(snap["requests"]):
        computed, ids = req[4], req[8]
        full = min(computed // bs, len(ids))
        for i, bid in enumerate(ids):
            if ref[bid]:
                if ref[bid] == 1:
                    shared[bid] = [owner[bid]]
                    state[bid] = SHARED
                shared[bid].append(k)
            else:
                owner[bid] = k
                state[bid] = USED
                t = bs if i < full else max(computed - i * bs, 0)
                tokens[bid] = t
                used += 1
                stored += t
            ref[bid] += 1
    if n:
        state[0], ref[0] = NULL, 1
    return {
        "state": state,
        "owner": owner,
        "ref": ref,
        "tokens": tokens,
        "owners": shared,
        "_counts": (used, len(shared), stored),
    }


def percentiles(values, qs=(50, 90, 99)) -> dict:
    """Nearest-rank percentiles of a list of numbers ({"p50": ..., "count": n}; None when empty)."""
    v = sorted(values)
    out: dict = {"count": len(v)}
    for q in qs:
        out[f"p{q}"] = v[min(len(v) - 1, max(0, -(-q * len(v) // 100) - 1))] if v else None
    return out


def state_view(snap: dict | None, latency: dict | None = None, now: float | None = None, window_s: float = 5.0) -> dict:
    """The `/dashboard/state` document (docs/dashboard.md) from a raw snapshot."""
    now = time.time() if now is None else now
    if snap is None:
        return {"version": SNAPSHOT_VERSION, "ready": False, "time": now, "latency": latency or {}}
    bs = snap["block_size"]
    blocks = block_view(snap)
    n_used, n_shared, stored = blocks.pop("_counts")
    n_cached = len(snap["cached_free"])
    usable = snap["num_blocks"] - 1
    requests = [
        {
            "id": r[0],
            "state": r[1],
            "prompt_tokens": r[2],
            "output_tokens": r[3],
            "computed_tokens": r[4],
            "cached_tokens": r[5],
            "preemptions": r[6],
            "age_s": round(max(now - r[7], 0.0), 3),
            "num_blocks": len(r[8]),
        }
        for r in snap["requests"]
    ]
    steps = snap["steps"]
    cols = {f: [row[i] for row in steps] for i, f in enumerate(STEP_FIELDS)}
    recent = [row for row in steps if row[0] > now - window_s]
    span = min(window_s, max(now - steps[0][0] + steps[0][7], 1e-9)) if steps else window_s
    stats = snap["stats"]
    return {
        "version": SNAPSHOT_VERSION,
        "ready": True,
        "time": snap["time"],
        "age_s": round(max(now - snap["time"], 0.0), 3),
        "snapshot_cost_ms": round(snap.get("cost_s", 0.0) * 1e3, 3),
        "step": stats.get("num_steps", 0),
        "block_size": bs,
        "kv": {
            "num_blocks": usable,
            "used": n_used,
            "shared": n_shared,
            "cached_free": n_cached,
            "free": usable - n_used - n_cached,
            "usage": n_used / usable if usable else 0.0,
            "utilization": stats.get("kv_utilization", 1.0),
            "stored_tokens": stored,
        },
        "blocks": blocks,
        "requests": requests,
        "queues": {
            "running": snap["num_running"],
            "waiting": snap["num_waiting"] - snap["num_preempted"],
            "preempted": snap["num_preempted"],
        },
        "steps": cols,
        "throughput": {
            "window_s": window_s,
            "prefill_tokens_per_s": sum(r[1] for r in recent) / span,
            "decode_tokens_per_s": sum(r[2] for r in recent) / span,
            "steps_per_s": len(recent) / span,
            "mean_step_ms": 1e3 * sum(r[7] for r in recent) / len(recent) if recent else None,
        },
        "latency": latency or {},
        "stats": stats,
    }
