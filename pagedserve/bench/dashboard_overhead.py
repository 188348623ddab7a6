"""What the live view (`/dashboard`) costs the engine core's step loop.

    python -m pagedserve.bench.dashboard_overhead [--blocks 3000 20000] [--model default --steps 200]

1. `build_snapshot` (+ pickling, as the core process sends it) with a full KV cache of
   N blocks: 256 running requests sharing a prefix, some cached-but-free blocks; and
   `state_view` (the /dashboard/state document, built in the server's process).
2. The step loop on a real model (`--model`, default SmolLM2-135M): steps with the step
   records and a snapshot every 250 ms (taken and pickled exactly as
   `EngineCoreProc._send` does) against the same steps without; the snapshot and record
   time is measured directly, so the share does not drown in the machine's noise.
One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
from collections import deque

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.engine_core import EngineCore, freeze_startup_objects
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.snapshot import build_snapshot
from pagedserve.engine.live_view import state_view
from pagedserve.messages import EngineCoreOutputs, ModelRunnerOutput
from pagedserve.sampling_params import SamplingParams


class _Core:
    """What build_snapshot reads from an EngineCore, over a bare scheduler."""

    def __init__(self, sched: Scheduler) -> None:
        self.scheduler = sched
        self.step_records = deque([(time.time(), 0, 256, 256, 0, 0, 0, 0.05, 0)] * 300, maxlen=512)

    def get_stats(self):
        return self.scheduler.make_stats()


def snapshot_cost(num_blocks: int, num_reqs: int = 256, block_size: int = 16, reps: int = 30) -> dict:
    # fill ~90% of the cache with running requests sharing a 4-block prefix; ~5% stays
    # cached-but-free (finished requests' blocks)
    per_req = max(int(0.9 * (num_blocks - 1) / num_reqs), 6)
    prompt_len = per_req * block_size - 1
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=num_reqs + 32, max_num_batched_tokens=1 << 30, max_model_len=prompt_len + 8),
        CacheConfig(block_size=block_size),
        num_blocks,
    )
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    shared = list(range(1, 4 * block_size + 1))
    n_done = max(int(0.05 * num_blocks / per_req), 1)
    for i in range(num_reqs + n_done):
        tail = [(i * 131 + j) % 30000 + 100 for j in range(prompt_len - len(shared))]
        sched.add_request(Request(f"req-{i:05d}", shared + tail, params, max_tokens=4))
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput({sr.req_id: 7 for sr in so.scheduled}))
    sched.finish_requests([f"req-{i:05d}" for i in range(num_reqs, num_reqs + n_done)], RequestStatus.FINISHED_ABORTED)
    freeze_startup_objects()
    core = _Core(sched)
    build, pick, view, size = [], [], [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        snap = build_snapshot(core)
        t1 = time.perf_counter()
        data = pickle.dumps(EngineCoreOutputs([], core.get_stats(), snapshot=snap), protocol=pickle.HIGHEST_PROTOCOL)
        t2 = time.perf_counter()
        doc = json.dumps(state_view(pickle.loads(data).snapshot), separators=(",", ":"))
        t3 = time.perf_counter()
        build.append(t1 - t0)
        pick.append(t2 - t1)
        view.append(t3 - t2)
        size = len(data)
    med = statistics.median
    core_ms = (med(build) + med(pick)) * 1e3
    return {
        "bench": "dashboard_snapshot",
        "num_blocks": num_blocks,
        "blocks_used": sched.kv.num_used_blocks,
        "cached_free": len(snap["cached_free"]),
        "running": len(sched.running),
        "build_snapshot_ms": round(med(build) * 1e3, 3),
        "pickle_ms": round(med(pick) * 1e3, 3),
        "core_cost_ms": round(core_ms, 3),
        "share_of_loop_at_250ms": round(core_ms / 250, 5),
        "message_bytes": size,
        "state_view_json_ms": round(med(view) * 1e3, 3),
        "state_json_bytes": len(doc),
    }


def step_loop(
    model: str, steps: int, num_reqs: int, interval_ms: int = 250, rounds: int = 3, quantization=None
) -> dict:
    from pagedserve.engine_args import EngineArgs

    config = EngineArgs(model=model, max_model_len=1024, quantization=quantization).create_engine_config()
    core = EngineCore(config)
    params = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0)

    def run(on: bool, tag: str) -> dict:
        core.step_records = None
        if on:
            core.enable_step_records()
        for i in range(num_reqs):
            prompt = [(i * 37 + j) % 2000 + 10 for j in range(64)]
            core.add_request(_ecr(f"{tag}-{i}", prompt, params, steps))
        step_s = snap_s = 0.0
        n = 0
        due = 0.0
        while core.has_unfinished_requests():
            t0 = time.perf_counter()
            core.step()
            t1 = time.perf_counter()
            step_s += t1 - t0
            n += 1
            if on and t1 >= due:  # as EngineCoreProc._send
                snap = core.snapshot()
                pickle.dumps(EngineCoreOutputs([], core.get_stats(), snapshot=snap), protocol=pickle.HIGHEST_PROTOCOL)
                cost = time.perf_counter() - t1
                snap_s += cost
                due = t1 + max(interval_ms / 1e3, cost / 0.005)
        print(f"# {tag}: {n} steps, {step_s / max(n, 1) * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
        return {"steps": n, "step_s": step_s, "snapshot_s": snap_s}

    offs, ons = [], []
    run(False, "warm")
    for r in range(rounds):  # interleaved, so that drift hits both alike
        offs.append(run(False, f"off{r}"))
        ons.append(run(True, f"on{r}"))
    # the step records' own cost: the same record call on this workload's batch, timed alone
    rec = _record_cost(core, num_reqs)
    off_step = statistics.median(o["step_s"] / o["steps"] for o in offs)
    on_step = statistics.median(o["step_s"] / o["steps"] for o in ons)
    snap_per_step = statistics.median(o["snapshot_s"] / o["steps"] for o in ons)
    return {
        "bench": "dashboard_step_loop",
        "model": model,
        "quantization": quantization,
        "num_reqs": num_reqs,
        "steps_per_run": offs[0]["steps"],
        "rounds": rounds,
        "step_ms_off": round(off_step * 1e3, 3),
        "step_ms_on": round(on_step * 1e3, 3),
        "wall_ratio_on_off": round(on_step / off_step, 4),
        "snapshot_ms_per_step": round(snap_per_step * 1e3, 4),
        "record_us_per_step": round(rec * 1e6, 2),
        "measured_overhead_share": round((snap_per_step + rec) / off_step, 5),
    }


def _ecr(rid, prompt, params, max_tokens):
    from pagedserve.messages import EngineCoreRequest

    return EngineCoreRequest(rid, prompt, params, max_tokens)


def _record_cost(core: EngineCore, batch: int, reps: int = 2000) -> float:
    from pagedserve.messages import CachedRequestData, EngineCoreOutput, SchedulerOutput

    shares = [
        CachedRequestData(req_id=f"r{i}", token_ids=[1], num_computed_tokens=100, block_ids=[], sample=True)
        for i in range(batch)
    ]
    so = SchedulerOutput(shares, batch)
    outs = [EngineCoreOutput(f"r{i}", [1]) for i in range(batch)]
    core.enable_step_records()
    t0 = time.perf_counter()
    for _ in range(reps):
        core._record_step(so, outs, 0.0)
    return (time.perf_counter() - t0) / reps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="*", default=[3000, 20000])
    ap.add_argument("--model", default="default", help="'' skips the step-loop measurement")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--num-reqs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", default=None, help="as the engine argument ('none': dequantized)")
    a = ap.parse_args(argv)
    for n in a.blocks:
        print(json.dumps(snapshot_cost(n)), flush=True)
    if a.model:
        print(json.dumps(step_loop(a.model, a.steps, a.num_reqs, rounds=a.rounds, quantization=a.quantization)), flush=True)


if __name__ == "__main__":
    main()
