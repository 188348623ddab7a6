"""The live view's documents, built in the front end's process from the engine core's raw
snapshot (`pagedserve.core.snapshot.build_snapshot`), off the step loop: each block's
owner, reference count, tokens and state, and the `/dashboard/state` document
(docs/dashboard.md).
"""

from __future__ import annotations

import time

from pagedserve.core.snapshot import SNAPSHOT_VERSION, STEP_FIELDS

# block states in block_view()["state"]
NULL, FREE, CACHED, USED, SHARED = -1, 0, 1, 2, 3
STATE_NAMES = {NULL: "null", FREE: "free", CACHED: "cached", USED: "used", SHARED: "shared"}


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
        "restored": list(snap.get("restored", ())),  # ids: K/V read back from the disk tier
        "_counts": (used, len(shared), stored),
    }


def percentiles(values, qs=(50, 90, 99)) -> dict:
    """Nearest-rank percentiles of a list of numbers ({"p50": ..., "count": n}; None when empty)."""
    v = sorted(values)
    out: dict = {"count": len(v)}
    for q in qs:
        out[f"p{q}"] = v[min(len(v) - 1, max(0, -(-q * len(v) // 100) - 1))] if v else None
    return out


def _request_doc(r: list, now: float, lanes: bool) -> dict:
    """One row of the snapshot's requests (core/snapshot.py `_row`) as the document's dict;
    `lanes`: the policy is length_aware (each request has a lane)."""
    return {
        "lane": ("short" if r[9] else "long") if lanes else None,
        "deadline_slack_s": round(r[10] - now, 3) if r[10] is not None else None,
        "id": r[0],
        "state": r[1],
        "prompt_tokens": r[2],
        "output_tokens": r[3],
        "computed_tokens": r[4],
        "cached_tokens": r[5],
        "preemptions": r[6],
        "age_s": round(max(now - r[7], 0.0), 3),
        "num_blocks": len(r[8]),
        "adapter": r[11],
    }


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
    lanes = snap.get("policy") == "length_aware"
    requests = [_request_doc(r, now, lanes) for r in snap["requests"]]
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
        "policy": snap.get("policy", "fcfs"),
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
