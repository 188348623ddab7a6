"""Scheduler overhead: `schedule()` + `update_from_output()` per step with N running decodes.

    python -m pagedserve.bench.scheduler_overhead [--sizes 64 256 1024] [--steps 200]

Prints one JSON line per size (us/step, us per running request) and checks them against
the goal of 100 us fixed + 2 us per request. No model runs: the executor is replaced by a
dictionary of sampled tokens, so only CPU bookkeeping is timed.
"""

from __future__ import annotations

import argparse
import json
import time

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.engine_core import freeze_startup_objects
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.messages import ModelRunnerOutput
from pagedserve.sampling_params import SamplingParams


def measure(num_reqs: int, steps: int, block_size: int = 16, prompt_len: int = 64) -> dict:
    max_tokens = steps + 64
    need_blocks = num_reqs * (-(-(prompt_len + max_tokens) // block_size)) + 1
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=num_reqs,
            max_num_batched_tokens=max(num_reqs * prompt_len, 2048),
            max_model_len=prompt_len + max_tokens,
        ),
        CacheConfig(block_size=block_size),
        need_blocks,
    )
    freeze_startup_objects()  # as LLMEngine does once it has started
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_reqs):
        prompt = [(i * 31 + j) % 30000 for j in range(prompt_len)]
        sched.add_request(Request(f"r{i}", prompt, params, max_tokens=max_tokens))
    # prefill everything first (not timed)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput({sr.req_id: 7 for sr in so.scheduled if sr.sample}))
    assert sched.num_running == num_reqs
    tok = 11
    t_sched = t_upd = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        ro = ModelRunnerOutput({sr.req_id: tok for sr in so.scheduled})  # the "executor"
        t2 = time.perf_counter()
        sched.update_from_output(so, ro)
        t3 = time.perf_counter()
        t_sched += t1 - t0
        t_upd += t3 - t2
        assert len(so.scheduled) == num_reqs
    per_step_us = (t_sched + t_upd) / steps * 1e6
    goal_us = 100 + 2 * num_reqs
    return {
        "bench": "scheduler_overhead",
        "running_requests": num_reqs,
        "block_size": block_size,
        "steps": steps,
        "schedule_us_per_step": round(t_sched / steps * 1e6, 1),
        "update_us_per_step": round(t_upd / steps * 1e6, 1),
        "total_us_per_step": round(per_step_us, 1),
        "us_per_request": round(per_step_us / num_reqs, 2),
        "goal_us_per_step": goal_us,
        "meets_goal": per_step_us <= goal_us,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)
    for n in args.sizes:
        print(json.dumps(measure(n, args.steps, args.block_size)), flush=True)


if __name__ == "__main__":
    main()
