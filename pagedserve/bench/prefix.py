"""Shared KV pages: prefix caching and n > 1 sampling, with and without caching, same run.

    python -m pagedserve.bench.prefix [--model default] [--requests 64] [--system-len 1024]
        [--question-len 64] [--output-len 32] [--n 8] [--n-prompts 16]
    python -m pagedserve.bench.prefix --restart [--docs 40] [--asks 4] [--doc-min 1500]
        [--doc-max 3000] [--pool-docs 8]

(a) --requests requests share a --system-len token system prompt, each with its own
    --question-len token question and --output-len output tokens (greedy, ignore_eos).
(b) n-way parallel sampling of --n-prompts prompts.
Reports peak KV blocks, prompt tokens computed and wall time; JSON lines with ratios.
(--restart) the disk KV tier: --docs documents of --doc-min..--doc-max tokens, each asked
    --asks times (its own short question after it) in random order, one request at a time,
    with a KV pool of --pool-docs mean documents: prompt tokens computed and mean TTFT,
    LRU-only prefix cache vs the tier (--kv-offload-dir, a fresh temporary directory),
    same run; then the tier's engine is shut down and started again: TTFT of a repeated
    --doc-max token document vs a cold one of the same length.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
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


def _ask(llm, prompt, params) -> float:
    """Run one request alone; seconds to its first token."""
    eng = llm.engine
    t0 = time.perf_counter()
    eng.add_request(f"r{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
    ttft = None
    while eng.has_unfinished_requests():
        outs = eng.step()
        if ttft is None and any(o.outputs and o.outputs[0].token_ids for o in outs):
            ttft = time.perf_counter() - t0
    return ttft if ttft is not None else time.perf_counter() - t0


def _ask_all(llm, prompts, params) -> dict:
    s0 = llm.get_stats()
    ttfts = [_ask(llm, p, params) for p in prompts]
    s = llm.get_stats()
    out = {
        "requests": len(prompts),
        "prompt_tokens": s.prompt_tokens - s0.prompt_tokens,
        "prompt_tokens_computed": (s.prompt_tokens - s0.prompt_tokens) - (s.prefix_cache_hits - s0.prefix_cache_hits),
        "mean_ttft_s": round(sum(ttfts) / len(ttfts), 4),
        "p50_ttft_s": round(sorted(ttfts)[len(ttfts) // 2], 4),
    }
    if s.kv_offload_enabled:
        out["tier_hit_blocks"] = s.kv_offload_hit_blocks - s0.kv_offload_hit_blocks
        out["tier_written_blocks"] = s.kv_offload_saved_blocks - s0.kv_offload_saved_blocks
        out["tier_read_s"] = round(s.kv_offload_read_seconds - s0.kv_offload_read_seconds, 3)
    return out


def restart_bench(a) -> dict:
    """The disk KV tier against the LRU-only prefix cache, then across a restart."""
    import tempfile

    from pagedserve import LLM, SamplingParams

    rng = random.Random(0)
    sp = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
    common = dict(dtype=a.dtype, block_size=a.block_size, max_model_len=a.doc_max + a.question_len + a.output_len + 16)
    from pagedserve.core.engine_core import resolve_config
    from pagedserve.engine_args import EngineArgs

    vocab = resolve_config(EngineArgs(model=a.model).create_engine_config()).model_config.vocab_size
    tok = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    docs = [tok(rng.randint(a.doc_min, a.doc_max)) for _ in range(a.docs)]
    asks = [(d, tok(a.question_len)) for d in range(a.docs) for _ in range(a.asks)]
    rng.shuffle(asks)
    prompts = [docs[d] + q for d, q in asks]
    mean_doc = sum(map(len, docs)) / len(docs)
    blocks = int(a.pool_docs * (mean_doc + a.question_len + a.output_len) / a.block_size) + 1
    res = {"bench": "prefix_restart", "model": a.model, "docs": a.docs, "asks_per_doc": a.asks,
           "doc_tokens": [a.doc_min, a.doc_max], "kv_blocks": blocks, "pool_docs": a.pool_docs}
    lru = LLM(a.model, **common, num_kv_blocks=blocks)
    res["lru_only"] = _ask_all(lru, prompts, sp)
    lru.shutdown()
    del lru
    root = a.kv_offload_dir or tempfile.mkdtemp(prefix="pagedserve-kv-")
    tier = LLM(a.model, **common, num_kv_blocks=blocks, kv_offload_dir=root, kv_offload_bytes=a.kv_offload_bytes)
    res["with_tier"] = _ask_all(tier, prompts, sp)
    lr, tr = res["lru_only"], res["with_tier"]
    res["computed_ratio"] = round(tr["prompt_tokens_computed"] / max(lr["prompt_tokens_computed"], 1), 3)
    res["ttft_speedup"] = round(lr["mean_ttft_s"] / max(tr["mean_ttft_s"], 1e-6), 2)
    # restart: the same model and settings over the same directory
    long_doc = tok(a.doc_max)
    _ask(tier, long_doc + tok(a.question_len), sp)  # its blocks are in the tier after the shutdown
    t0 = time.perf_counter()
    tier.shutdown()
    del tier
    again = LLM(a.model, **common, num_kv_blocks=blocks, kv_offload_dir=root, kv_offload_bytes=a.kv_offload_bytes)
    res["restart_s"] = round(time.perf_counter() - t0, 2)
    res["restart_indexed_blocks"] = again.get_stats().kv_offload_stored_blocks
    cold = _ask(again, tok(a.doc_max) + tok(a.question_len), sp)
    warm = _ask(again, long_doc + tok(a.question_len), sp)
    res["after_restart"] = {"doc_tokens": a.doc_max, "cold_ttft_s": round(cold, 4), "repeated_ttft_s": round(warm, 4),
                            "speedup": round(cold / max(warm, 1e-6), 2),
                            "hit_blocks": again.get_stats().kv_offload_hit_blocks}
    again.shutdown()
    if not a.kv_offload_dir:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return res


def decode_overhead_bench(a) -> dict:
    """Steady-state throughput with the tier on vs off under a load without prefix reuse:
    --decode-requests random prompts, at most 16 running, a pool that holds the running
    ones and little more, so finished requests' cached blocks are evicted (and written)
    while others decode. Runs alternate off / on, twice; best of each."""
    import tempfile

    from pagedserve import LLM, SamplingParams

    rng = random.Random(1)
    (plen, olen), n, seqs = a.decode_lens, a.decode_requests, 16
    blocks = seqs * -(-(plen + olen) // a.block_size) + 8
    common = dict(dtype=a.dtype, block_size=a.block_size, max_num_seqs=seqs, num_kv_blocks=blocks, max_model_len=plen + olen + 8)
    root = tempfile.mkdtemp(prefix="pagedserve-kv-decode-")
    llms = {False: LLM(a.model, **common), True: LLM(a.model, **common, kv_offload_dir=root)}
    vocab = llms[False].engine.model_config.vocab_size
    sp = SamplingParams(max_tokens=olen, temperature=0, ignore_eos=True)
    best = {False: 0.0, True: 0.0}
    written = 0
    for _ in range(2):
        for tier in (False, True):
            prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(plen)]} for _ in range(n)]
            t = time.perf_counter()
            llms[tier].generate(prompts, sp, use_tqdm=False)
            best[tier] = max(best[tier], n * olen / (time.perf_counter() - t))
    written = llms[True].get_stats().kv_offload_saved_blocks
    for llm in llms.values():
        llm.shutdown()
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    return {"bench": "prefix_tier_decode_overhead", "requests": n, "prompt_len": plen, "output_len": olen,
            "output_tok_s_off": round(best[False], 1), "output_tok_s_on": round(best[True], 1),
            "ratio": round(best[True] / best[False], 3), "tier_written_blocks": written}


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
    ap.add_argument("--restart", action="store_true", help="the disk KV tier benchmark (see above)")
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--asks", type=int, default=4)
    ap.add_argument("--doc-min", type=int, default=1500)
    ap.add_argument("--doc-max", type=int, default=3000)
    ap.add_argument("--pool-docs", type=float, default=8)
    ap.add_argument("--kv-offload-dir", default=None, help="--restart: the tier's directory (default: a temporary one)")
    ap.add_argument("--kv-offload-bytes", default="16GiB")
    ap.add_argument("--decode-check", action="store_true", help="the tier's steady-state overhead (with or without --restart)")
    ap.add_argument("--decode-requests", type=int, default=48)
    ap.add_argument("--decode-lens", type=int, nargs=2, default=[256, 64], metavar=("PROMPT", "OUTPUT"))
    a = ap.parse_args(argv)
    if a.restart or a.decode_check:
        given = sys.argv[1:] if argv is None else argv
        if "--question-len" not in given:
            a.question_len = 16
        if "--output-len" not in given:
            a.output_len = 8
        if a.restart:
            print(json.dumps(restart_bench(a)), flush=True)
        if a.decode_check:
            print(json.dumps(decode_overhead_bench(a)), flush=True)
        return
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
