"""An engine's prefill and decode times in this process, for A/B runs of two checkouts of the
tree (BENCHMARKS section 59): run it under each in turn, e.g.

    git worktree add /tmp/wt REV
    for i in 1 2; do
      PYTHONPATH=/tmp/wt .venv/bin/python benchmarks/q8_engine_step.py --model FILE.gguf --quantization gguf_q8
      .venv/bin/python benchmarks/q8_engine_step.py --model FILE.gguf --quantization gguf_q8
    done

Prefill: one 256-token prompt (random token ids) to its first token, median of --rounds (no prefix
caching). Decode: --batch requests of 64-token prompts, ms a step over --tokens greedy steps
(ignore_eos), median of --rounds. Prints one JSON line with the checkout's path and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import pagedserve
from pagedserve import LLM, SamplingParams
from pagedserve.executor.quant import kernels
from pagedserve.model_files import default_model_path


def ids(seed: int, n: int, vocab: int) -> list[int]:
    return [(seed * 7919 + j * 131) % (vocab - 200) + 100 for j in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    model = default_model_path() if a.model == "default" else a.model
    llm = LLM(model=model, quantization=a.quantization, dtype=a.dtype, max_model_len=1024, enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([{"prompt_token_ids": ids(0, 32, vocab)}], one, use_tqdm=False)  # warm-up
    prefill = []
    for r in range(a.rounds):
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids(r + 1, 256, vocab)}], one, use_tqdm=False)
        prefill.append((time.perf_counter() - t) * 1e3)
    decode = {}
    for b in a.batch:
        prompts = [{"prompt_token_ids": ids(100 + i, 64, vocab)} for i in range(b)]
        steps = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            t_first = time.perf_counter() - t
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=a.tokens + 1, ignore_eos=True, temperature=0),
                         use_tqdm=False)
            steps.append((time.perf_counter() - t - t_first) / a.tokens * 1e3)
        decode[b] = round(statistics.median(steps), 2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(pagedserve.__file__)))
    rev = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", root, "status", "--porcelain", "-uno"], capture_output=True, text=True).stdout)
    print(json.dumps({"bench": "q8_engine_step", "tree": root, "rev": rev + ("+" if dirty else ""), "isa": kernels.current_isa(),
                      "model": a.model, "quantization": a.quantization, "prefill_256_ms": round(statistics.median(prefill), 1),
                      "decode_ms_a_step": decode}), flush=True)


if __name__ == "__main__":
    main()
