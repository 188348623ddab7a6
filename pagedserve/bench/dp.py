"""Data parallelism: prefix-cache hit rate of 2 replicas routed by prefix, 2 replicas
round-robin, and one engine, on the same shared-prefix workload, same run.

    pagedserve bench dp [--model default] [--groups 16] [--per-group 8] [--system-len 512]
        [--question-len 32] [--output-len 8] [--concurrency 16] [--num-kv-blocks N]
        [--configs dp1,dp2-prefix,dp2-rr,dp1-2x] [--seed 0]

--groups system prompts of --system-len random tokens, each shared by --per-group
requests with their own --question-len token question; all requests are shuffled and
run through AsyncLLM (engine cores in their own processes) with at most --concurrency
in flight. --num-kv-blocks is per engine (per replica): small enough that one engine
cannot keep every system prompt cached, the router's choice shows in the hit rate
(dp1-2x: one engine with twice the blocks, the KV memory of the two replicas).
Hit rate = prompt tokens found in the prefix caches / prompt tokens looked up, summed
over the replicas; "ideal" is what a single unbounded cache would get (every request
but the first of its group hits its whole system prompt, in full blocks). One JSON line
per configuration, then one with the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

# name -> (replicas, routing, KV blocks per engine as a multiple of --num-kv-blocks);
# dp1-2x: one engine with the KV memory of two replicas
CONFIGS = {
    "dp1": (1, "prefix", 1),
    "dp1-2x": (1, "prefix", 2),
    "dp2-prefix": (2, "prefix", 1),
    "dp2-rr": (2, "round_robin", 1),
}


def workload(a: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(a.seed)
    systems = [[rng.randrange(10, vocab) for _ in range(a.system_len)] for _ in range(a.groups)]
    prompts = [
        s + [rng.randrange(10, vocab) for _ in range(a.question_len)]
        for s in systems
        for _ in range(a.per_group)
    ]
    rng.shuffle(prompts)
    return prompts


async def drive(llm, prompts: list[list[int]], output_len: int, concurrency: int) -> float:
    from pagedserve import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, p: list[int]) -> None:
        async with sem:
            stream = await llm.add_request({"prompt_token_ids": p}, params, f"dp-{i}")
            async for _ in stream:
                pass

    t = time.perf_counter()
    await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    return time.perf_counter() - t


def run_config(a: argparse.Namespace, name: str, prompts: list[list[int]]) -> dict:
    from pagedserve.engine.async_engine import AsyncLLM
    from pagedserve.engine_args import EngineArgs

    dp, routing, kv_mult = CONFIGS[name]
    args = EngineArgs(
        model=a.model,
        dtype=a.dtype,
        load_format=a.load_format,
        num_kv_blocks=a.num_kv_blocks * kv_mult if a.num_kv_blocks else None,
        max_model_len=a.system_len + a.question_len + a.output_len + 16,
        data_parallel_size=dp,
        dp_routing=routing,
        engine_core_process=True,
    )
    t0 = time.perf_counter()
    llm = AsyncLLM.from_engine_args(args)
    start_s = time.perf_counter() - t0
    try:
        wall = asyncio.run(drive(llm, prompts, a.output_len, a.concurrency))
        reps = llm.replicas
        per = reps.stats
        s = llm.stats
        return {
            "config": name,
            "data_parallel_size": dp,
            "routing": routing if dp > 1 else None,
            "requests": len(prompts),
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "hit_rate": round(s.prefix_cache_hit_rate, 4),
            "per_engine_hit_rate": [round(x.prefix_cache_hit_rate, 4) for x in per],
            "per_engine_prompt_tokens": [x.prompt_tokens for x in per],
            "routed": {f"{i}/{why}": n for (i, why), n in sorted(reps.routed.items())},
            "kv_blocks_per_engine": per[0].kv_blocks_total,
            "computed_tokens": s.computed_tokens,
            "wall_s": round(wall, 2),
            "startup_s": round(start_s, 2),
        }
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="per engine (default: memory-based)")
    ap.add_argument("--configs", default="dp1,dp2-prefix,dp2-rr")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None, help="also write the results here")
    a = ap.parse_args(argv)

    from pagedserve.core.engine_core import resolve_config
    from pagedserve.engine_args import EngineArgs

    vocab = resolve_config(EngineArgs(model=a.model).create_engine_config()).model_config.vocab_size
    prompts = workload(a, vocab)
    bs = 16
    full = a.system_len // bs * bs
    ideal = a.groups * (a.per_group - 1) * full / (len(prompts) * (a.system_len + a.question_len))
    results = []
    for name in a.configs.split(","):
        r = run_config(a, name, prompts)
        r["ideal_hit_rate"] = round(ideal, 4)
        print(json.dumps(r), flush=True)
        results.append(r)
    by = {r["config"]: r["hit_rate"] for r in results}
    if "dp1" in by:
        ratios = {
            f"{k}_vs_dp1": round(v / by["dp1"], 4) if by["dp1"] else None for k, v in by.items() if k != "dp1"
        }
        print(json.dumps({"hit_rate": by, **ratios}), flush=True)
        results.append({"hit_rate": by, **ratios})
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
