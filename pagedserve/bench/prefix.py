"""Shared KV pages: prefix caching and n > 1 sampling, with and without caching, same run.

    python -m pagedserve.bench.prefix [--model default] [--requests 64] [--system-len 1024]
        [--question-len 64] [--output-len 32] [--n 8] [--n-prompts 16]

(a) --requests requests share a --system-len token system prompt, each with its own
    --question-len token question and --output-len output tokens (greedy, ignore_eos).
(b) n-way parallel sampling of --n-prompts prompts.
Reports peak KV blocks, prompt tokens computed and wall time; JSON lines with ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def run(llm, prompts, params) -> dict:
    eng = llm.engine
    s0 = llm.get_stats()
    for i, p in enumerate(prompts):
        eng.add_request(f"b{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, params)
    peak = 0
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, eng.get_stats().kv_blocks_used)
    wall = time.perf_counter() - t
    s = llm.get_stats()
    gen = s.generation_tokens - s0.generation_tokens
    n_seqs = len(prompts) * params.n
    computed = s.computed_tokens - s0.computed_tokens
    return {
        "wall_s": round(wall, 4),
        "peak_kv_blocks": peak,
        "prompt_tokens_computed": computed
        - (gen - n_seqs),  # each sequence's first token comes from its prefill
        "prefix_cache_hit_tokens": s.prefix_cache_hits - s0.prefix_cache_hits,
        "generated_tokens": gen,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--n-prompt-len", type=int, default=200)
    ap.add_argument("--skip", choices=["a", "b"], default=None)
    a = ap.parse_args(argv)
    from pagedserve import LLM, SamplingParams

    rng = random.Random(0)
    llms = {
        c: LLM(a.model, dtype=a.dtype, block_size=a.block_size, enable_prefix_caching=c)
        for c in (True, False)
    }
    vocab = llms[True].engine.model_config.vocab_size
    tok = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    bs = a.block_size
    if a.skip != "a":
        system = tok(a.system_len)
        prompts = [system + tok(a.question_len) for _ in range(a.requests)]
        sp = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
        res = {c: run(llms[c], prompts, sp) for c in (True, False)}
        ideal = -(-a.system_len // bs) + a.requests * -(
            -(a.question_len + a.output_len + a.system_len % bs) // bs
        )
        print(
            json.dumps(
                {
                    "bench": "prefix_shared_system_prompt",
                    "model": a.model,
                    "requests": a.requests,
                    "system_len": a.system_len,
                    "question_len": a.question_len,
                    "output_len": a.output_len,
                    "with_caching": res[True],
                    "without_caching": res[False],
                    "ideal_peak_kv_blocks": ideal,
                    "peak_blocks_over_ideal": round(res[True]["peak_kv_blocks"] / ideal, 3),
                    "speedup": round(res[False]["wall_s"] / max(res[True]["wall_s"], 1e-4), 2),
                }
            ),
            flush=True,
        )
    if a.skip != "b":
        prompts = [tok(a.n_prompt_len) for _ in range(a.n_prompts)]
        sp = SamplingParams(n=a.n, max_tokens=a.output_len, temperature=1.0, seed=0, ignore_eos=True)
        res = {c: run(llms[c], prompts, sp) for c in (True, False)}
        print(
            json.dumps(
                {
                    "bench": "prefix_parallel_sampling",
                    "model": a.model,
                    "prompts": a.n_prompts,
                    "n": a.n,
                    "prompt_len": a.n_prompt_len,
                    "output_len": a.output_len,
                    "with_caching": res[True],
                    "without_caching": res[False],
                    "prompt_blocks_if_held_once": a.n_prompts * (a.n_prompt_len // bs),
                    "speedup": round(res[False]["wall_s"] / max(res[True]["wall_s"], 1e-4), 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
