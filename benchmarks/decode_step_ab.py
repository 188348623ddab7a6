"""A model runner's decode step alone (no scheduler, no server), for A/B runs of two checkouts
(BENCHMARKS section 65): B requests with --context cached tokens each, greedy steps straight
through ModelRunner.execute_model (pagedserve.bench.forward's driver), median ms of the last
13 of 16 steps per batch size. Run it under each checkout in turn, in separate processes:

    git worktree add /tmp/wt REV
    for i in 1 2; do
      PYTHONPATH=/tmp/wt .venv/bin/python benchmarks/decode_step_ab.py --model M --batches 1 16 64
      .venv/bin/python benchmarks/decode_step_ab.py --model M --batches 1 16 64
    done

Prints one JSON line: the checkout's path, dtype and {batch: ms}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import pagedserve
from pagedserve.bench.forward import _DecodeDriver
from pagedserve.executor.loader import load_hf_config_dict, resolve_model_path
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.model_runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16, help="tokens a KV block")
    ap.add_argument("--amx-exact-rows", type=int, default=None,
                    help="set_amx_exact_rows first (0: the exact AMX few-row kernel off; section 66)")
    a = ap.parse_args()
    if a.amx_exact_rows is not None:
        from pagedserve.executor.quant import kernels

        kernels.set_amx_exact_rows(a.amx_exact_rows)
    path = resolve_model_path(a.model)
    runner = ModelRunner(path, ModelConfig.from_hf_dict(load_hf_config_dict(path)), dtype=a.dtype, device="cpu")
    block = a.block_size
    runner.initialize_kv_cache(max(a.batches) * (-(-(a.context + a.steps + 8) // block)) + 2, block)
    ms = {}
    for b in a.batches:
        drv = _DecodeDriver(runner, b, a.context, block)
        ts = []
        for _ in range(a.steps):
            t = time.perf_counter()
            drv.step()
            ts.append(time.perf_counter() - t)
        ms[b] = round(statistics.median(ts[3:]) * 1e3, 2)
        del drv
    root = os.path.dirname(os.path.dirname(os.path.abspath(pagedserve.__file__)))
    print(json.dumps({"checkout": root, "model": a.model, "dtype": a.dtype, "context": a.context, "block_size": block,
                      "step_ms": ms}))


if __name__ == "__main__":
    main()
