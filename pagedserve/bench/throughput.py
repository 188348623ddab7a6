"""Offline throughput: pagedserve beside transformers' static batching, same workload, same run.

    pagedserve bench throughput [--model default] [--num-requests 128] [--seed 0]
        [--input-len 16 512] [--output-len 16 256] [--dataset FILE.json]
        [--baseline hf-static] [--hf-batch-sizes 1 8 16 32] [--baseline-requests N]
        [--output-json FILE] [--plot FILE.png]

Prompts are random token ids, outputs have exact lengths (ignore_eos, greedy), so both
systems do the same work. A dataset file is a JSON list of {"prompt" or
"prompt_token_ids", "output_len"}. The hf-static baseline runs transformers' generate()
in static batches of B in arrival order (left padding; each batch runs until its longest
output; only each request's own tokens count). --baseline-requests measures the
baseline on the first N requests only (it is slow); throughputs are rates, so the ratio
stays meaningful.
"""

from __future__ import annotations

import argparse
import json
import time

from pagedserve.bench.workload import add_workload_args, make_workload


def run_pagedserve(llm, work) -> dict:
    from pagedserve import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in work]
    sps = [SamplingParams(max_tokens=o, min_tokens=o, ignore_eos=True, temperature=0) for _, o in work]
    s0 = llm.get_stats()
    t = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    wall = time.perf_counter() - t
    got = [len(o.outputs[0].token_ids) for o in outs]
    assert got == [o for _, o in work], "unexpected output lengths"
    s = llm.get_stats()
    return _rates(work, wall) | {
        "steps": s.num_steps - s0.num_steps,
        "preemptions": s.num_preemptions - s0.num_preemptions,
    }


def run_hf_static(model_dir: str, dtype: str, work, batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    gc = m.generation_config
    gc.eos_token_id = None
    gc.do_sample = False
    for k in ("temperature", "top_p", "top_k"):
        if hasattr(gc, k):
            setattr(gc, k, None)
    pad = 0
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work), batch):
            chunk = work[i : i + batch]
            L = max(len(p) for p, _ in chunk)
            ids = torch.full((len(chunk), L), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), L), dtype=torch.long)
            for r, (p, _) in enumerate(chunk):
                ids[r, L - len(p) :] = torch.tensor(p)
                mask[r, L - len(p) :] = 1
            n = max(o for _, o in chunk)
            m.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=pad,
                generation_config=gc,
            )
    return _rates(work, time.perf_counter() - t) | {"batch_size": batch}


def _rates(work, wall: float) -> dict:
    n_in = sum(len(p) for p, _ in work)
    n_out = sum(o for _, o in work)
    return {
        "requests": len(work),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(work) / wall, 3),
        "output_tok_s": round(n_out / wall, 1),
        "total_tok_s": round((n_in + n_out) / wall, 1),
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["pagedserve"] + [f"HF static B={b['batch_size']}" for b in result.get("baseline", [])]
    vals = [result["pagedserve"]["output_tok_s"]] + [b["output_tok_s"] for b in result.get("baseline", [])]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(labels, vals, color=["tab:blue"] + ["tab:gray"] * (len(vals) - 1))
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tokens / s")
    ratio = result.get("ratio_vs_best_baseline")
    ax.set_title(
        f"Offline throughput ({result['model']}, {result['dtype']})"
        + (f": {ratio:.1f}x the best static batch" if ratio else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    add_workload_args(ap)
    ap.add_argument("--baseline", choices=["none", "hf-static"], default="none")
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--baseline-requests", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)

    from pagedserve import LLM

    t = time.perf_counter()
    llm = LLM(
        a.model,
        dtype=a.dtype,
        block_size=a.block_size,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        enable_prefix_caching=not a.no_prefix_caching,
    )
    load_s = time.perf_counter() - t
    eng = llm.engine
    dtype = eng.core.info.dtype
    work = make_workload(a, eng.model_config.vocab_size, eng.tokenizer)
    # warm-up (first-touch of memory, lazy init), not timed
    llm.generate([{"prompt_token_ids": work[0][0][:16]}], use_tqdm=False)
    result = {
        "bench": "throughput",
        "model": a.model,
        "dtype": dtype,
        "num_requests": len(work),
        "input_tokens": sum(len(p) for p, _ in work),
        "output_tokens": sum(o for _, o in work),
        "load_s": round(load_s, 2),
        "pagedserve": run_pagedserve(llm, work),
    }
    if a.baseline == "hf-static":
        sub = work[: a.baseline_requests] if a.baseline_requests else work
        result["baseline"] = [run_hf_static(eng.model_path, dtype, sub, b) for b in a.hf_batch_sizes]
        best = max(result["baseline"], key=lambda r: r["output_tok_s"])
        result["best_baseline_batch_size"] = best["batch_size"]
        result["ratio_vs_best_baseline"] = round(
            result["pagedserve"]["output_tok_s"] / best["output_tok_s"], 2
        )
    line = json.dumps(result)
    print(line, flush=True)
    if a.output_json:
        with open(a.output_json, "w") as f:
            f.write(line + "\n")
    if a.plot:
        plot(result, a.plot)


if __name__ == "__main__":
    main()
