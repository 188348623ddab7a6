"""Engine-option A/B under load, offline: the default model, N random 256-token prompts at
once, 128 sampled tokens each (ignore_eos), one engine per configuration in this process, run
alternately so a noisy stretch of the machine hits every one.

    python benchmarks/offline_ab.py [--configs kv_cache_dtype=auto kv_cache_dtype=float16]
        [--requests 64] [--rounds 2]

A configuration is comma-separated LLM(...) keyword arguments, e.g.
`quantization=gguf_q8,kv_cache_dtype=float16` (`default` for none). Section 22's runs were
`--configs kv_cache_dtype=auto kv_cache_dtype=float16`.

Prints one JSON line per run: output tokens/s, the seconds of steps that held prefill work
and of decode-only steps, and the median decode-only step (engine step records).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def prompts(seed: int, n: int) -> list[list[int]]:
    """n random 256-token prompts; a new seed each round, so no prefix-cache hits."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(n)]


def parse_config(config: str) -> dict:
    """`k=v,k2=v2` (integers as ints) -> keyword arguments; `default` -> none."""
    if config == "default":
        return {}
    pairs = (kv.split("=", 1) for kv in config.split(","))
    return {k: int(v) if v.isdigit() else v for k, v in pairs}


def run(llm, work) -> dict:
    from pagedserve import SamplingParams

    core = llm.engine.core.engine_core
    sp = SamplingParams(max_tokens=128, min_tokens=128, ignore_eos=True, temperature=1.0, seed=1)
    core.enable_step_records(100000)
    core.step_records.clear()
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in work], sp, use_tqdm=False)
    wall = time.perf_counter() - t
    recs = list(core.step_records)  # (.., prefill tokens, decode tokens, .., seconds)
    decode = [r[7] for r in recs if r[1] == 0]
    return {
        "tok_s": round(len(work) * 128 / wall, 1),
        "prefill_s": round(sum(r[7] for r in recs if r[1] > 0), 1),
        "decode_s": round(sum(decode), 1),
        "decode_step_ms": round(statistics.median(decode) * 1e3, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["kv_cache_dtype=auto", "kv_cache_dtype=float16"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()

    from pagedserve import LLM, SamplingParams

    llms = {c: LLM("default", **parse_config(c)) for c in a.configs}
    for llm in llms.values():  # warm-up
        llm.generate([{"prompt_token_ids": prompts(-1, 1)[0][:32]}], SamplingParams(max_tokens=8), use_tqdm=False)
    for r in range(a.rounds):
        work = prompts(r, a.requests)
        for c in a.configs if r % 2 == 0 else a.configs[::-1]:
            print(json.dumps({"config": c, "round": r} | run(llms[c], work)), flush=True)


if __name__ == "__main__":
    main()
