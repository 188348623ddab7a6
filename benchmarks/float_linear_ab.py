"""Float32 models: the blocked many-row kernel (FloatLinear, 12-128 rows) against the BLAS for
every linear, A/B in one process over a workload-W-like mix (64 requests, random prompts of
16-512 tokens, 16-256 output tokens, greedy, EOS ignored), prefix cache reset between runs.
Prints one JSON line: output tok/s per round and whether the tokens were identical.

    .venv/bin/python benchmarks/float_linear_ab.py [--model DIR] [--rounds 2]
(default model: the anchors' float32 SmolLM2 directory when present, else the embedded one
dequantized to float32)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from pagedserve import LLM, SamplingParams
from pagedserve.executor.quant.layers import FloatLinear


def main() -> None:
    anchors = os.path.expanduser("~/.cache/pagedserve-anchors/models/smollm2")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=anchors if os.path.isdir(anchors) else "default")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    kw = {"quantization": "none"} if a.model == "default" else {}
    llm = LLM(a.model, dtype="float32", kv_cache_memory_bytes=2 << 30, **kw)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(rng.randint(16, 512))]}
        for _ in range(64)
    ]
    sps = [SamplingParams(max_tokens=rng.randint(16, 256), ignore_eos=True, temperature=0) for _ in range(64)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    tok_s: dict[str, list[float]] = {"blas": [], "kernel": []}
    outs = {}
    for _ in range(a.rounds):
        for name, rows in (("blas", (1, 0)), ("kernel", FloatLinear.many_rows)):
            old, FloatLinear.many_rows = FloatLinear.many_rows, rows
            llm.reset_prefix_cache()
            t = time.perf_counter()
            res = llm.generate(prompts, sps, use_tqdm=False)
            dt = time.perf_counter() - t
            FloatLinear.many_rows = old
            tok_s[name].append(round(sum(len(r.outputs[0].token_ids) for r in res) / dt, 1))
            outs[name] = [r.outputs[0].token_ids for r in res]
    same = sum(x == y for x, y in zip(outs["blas"], outs["kernel"]))
    print(
        json.dumps({"bench": "float_linear_ab", "model": a.model, "tok_s": tok_s, "identical_requests": same})
    )


if __name__ == "__main__":
    main()
