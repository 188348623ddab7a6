"""KV-cache memory: paged utilization against contiguous reservation, and a block-size sweep.

    pagedserve bench kv [--model default] [--num-requests 128] [--input-len 16 512]
        [--output-len 16 256] [--block-sizes 8 16 32 64] [--kv-tokens 65536]
        [--output-json FILE] [--plot FILE.png]

For each block size the workload (random prompts, exact output lengths) runs through the
real engine with a cache of --kv-tokens token slots. Every step records
stored tokens / allocated slots (paged utilization) and, for the same running set, what
a contiguous allocator that reserves max_model_len slots per request would use. Also:
how many requests ran at once (paged) against how many max_model_len reservations fit in
the same memory, throughput, and scheduler CPU time per step.
"""

from __future__ import annotations

import argparse
import json
import time

from pagedserve.bench.workload import add_workload_args, make_workload


def run_block_size(a, bs: int, work) -> dict:
    from pagedserve import LLM, SamplingParams

    num_blocks = a.kv_tokens // bs + 1
    llm = LLM(
        a.model,
        dtype=a.dtype,
        block_size=bs,
        num_kv_blocks=num_blocks,
        max_model_len=a.max_model_len,
        enable_prefix_caching=False,
    )
    eng = llm.engine
    sched = eng.engine_core.scheduler
    max_len = eng.config.scheduler.max_model_len
    for i, (p, o) in enumerate(work):
        eng.add_request(
            f"k{i}",
            {"prompt_token_ids": p},
            SamplingParams(max_tokens=o, min_tokens=o, ignore_eos=True, temperature=0),
        )
    trace, sched_s = [], 0.0
    t0 = time.perf_counter()
    orig_schedule, orig_update = sched.schedule, sched.update_from_output

    def timed(fn):
        def wrapper(*args):
            nonlocal sched_s
            t = time.perf_counter()
            r = fn(*args)
            sched_s += time.perf_counter() - t
            return r

        return wrapper

    sched.schedule, sched.update_from_output = timed(orig_schedule), timed(orig_update)
    max_running = 0
    while eng.has_unfinished_requests():
        eng.step()
        used = sched.kv.num_used_blocks
        stored = sched.kv_stored_tokens()
        running = sched.num_running
        max_running = max(max_running, running)
        if not used:
            continue  # nothing allocated (the last step): no utilization to speak of
        trace.append(
            {
                "t": round(time.perf_counter() - t0, 3),
                "used_blocks": used,
                "stored": stored,
                "running": running,
                "paged_util": stored / (used * bs),
                "contig_util": stored / (running * max_len),
                "fill": used / sched.kv.num_total_blocks,
            }
        )
    wall = time.perf_counter() - t0
    busy = [x for x in trace if x["fill"] > 0.5] or trace
    n_out = sum(o for _, o in work)
    return {
        "block_size": bs,
        "kv_token_slots": (num_blocks - 1) * bs,
        "paged_util_min": round(min(x["paged_util"] for x in trace), 4),
        "paged_util_mean": round(sum(x["paged_util"] for x in trace) / len(trace), 4),
        "paged_util_mean_when_over_half_full": round(sum(x["paged_util"] for x in busy) / len(busy), 4),
        "contiguous_util_mean": round(sum(x["contig_util"] for x in trace) / len(trace), 4),
        "max_fill": round(max(x["fill"] for x in trace), 3),  # the "over half full" mean needs > 0.5
        "max_concurrent_paged": max_running,
        "max_concurrent_contiguous": (num_blocks - 1) * bs // max_len,
        "preemptions": sched.num_preemptions,
        "output_tok_s": round(n_out / wall, 1),
        "scheduler_us_per_step": round(sched_s / len(trace) * 1e6, 1),
        "steps": len(trace),
        "trace": trace,
    }


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    ref = next((r for r in results if r["block_size"] == 16), results[0])
    tr = ref["trace"]
    ax1.plot(
        [x["t"] for x in tr], [100 * x["paged_util"] for x in tr], label=f"paged (block {ref['block_size']})"
    )
    ax1.plot(
        [x["t"] for x in tr], [100 * x["contig_util"] for x in tr], label="contiguous (max_model_len each)"
    )
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("KV utilization: stored / allocated (%)")
    ax1.set_ylim(0, 105)
    ax1.legend()
    ax1.set_title("KV memory utilization over the run")
    bss = [str(r["block_size"]) for r in results]
    ax2.bar(bss, [100 * r["paged_util_mean"] for r in results], color="tab:blue", label="utilization %")
    ax2.set_xlabel("block size")
    ax2.set_ylabel("mean utilization (%)")
    ax2.set_ylim(0, 105)
    ax3 = ax2.twinx()
    ax3.plot(bss, [r["output_tok_s"] for r in results], "o-", color="tab:red", label="output tok/s")
    ax3.set_ylabel("output tokens / s")
    ax2.set_title("Block-size sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    add_workload_args(ap)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--kv-tokens", type=int, default=65536, help="KV cache size in token slots")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    from pagedserve.executor.loader import load_hf_config_dict, resolve_model_path

    work = make_workload(a, load_hf_config_dict(resolve_model_path(a.model))["vocab_size"])
    results = [run_block_size(a, bs, work) for bs in a.block_sizes]
    summary = {
        "bench": "kv",
        "model": a.model,
        "num_requests": len(work),
        "max_model_len": a.max_model_len,
        "results": [{k: v for k, v in r.items() if k != "trace"} for r in results],
    }
    print(json.dumps(summary), flush=True)
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(summary | {"traces": {r["block_size"]: r["trace"] for r in results}}, f)
    if a.plot:
        plot(results, a.plot)


if __name__ == "__main__":
    main()
