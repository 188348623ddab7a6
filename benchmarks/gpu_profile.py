"""Where a GPU decode step's time goes, in one call on a lent GPU: gpu_bench.py's random
Llama-3-8B-shaped bf16 model with CUDA graphs, for batch 1, 32 and 256 at 512 tokens of context:

  step_ms   engine.step() wall: scheduling, inputs, graph replay, LM head, sampling, outputs
  graph_ms  the captured decode graph's replay alone (CUDA events): the 32 layers
  attn_ms   the Triton decode attention of one layer, times the layers: with the graph's
            fixed grid (max_model_len) and with the batch's real longest context; and by the
            decode kernel's key tile (32 / 64 / 128 tokens)
  kernels   the profiler's top device kernels over 5 steps (ms per step)
  host      cProfile of 5 steps: the top functions by own time

    python3 benchmarks/gpu_profile.py --out prof.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_bench import LLAMA3_8B, model_dir  # noqa: E402


def cuda_ms(fn, n=20) -> float:
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def attention_ms(backend, kv, bufs, q, max_seq_len) -> float:
    """One layer's decode attention over the graph buffers' current (real) batch."""
    n = q.shape[0]
    scale = q.shape[-1] ** -0.5
    return cuda_ms(
        lambda: backend.decode(q, kv[0], kv[1], bufs.block_tables[:n], bufs.seq_lens[:n], max_seq_len, scale)
    )


def start_decodes(eng, batch, ctx, steps):
    from pagedserve import SamplingParams

    vocab = eng.model_config.vocab_size
    for i in range(batch):
        eng.add_request(
            f"d{batch}-{i}",
            {"prompt_token_ids": [(i * 7919 + j) % (vocab - 10) + 5 for j in range(ctx)]},
            SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0),
        )
    sched = eng.engine_core.scheduler
    while sched.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        eng.step()
    for _ in range(3):
        eng.step()


def kernel_table(eng, steps=5) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append({"kernel": e.key[:90], "ms_per_step": round(t / 1e3 / steps, 3), "calls_per_step": e.count / steps})
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows[:14]


def host_profile(eng, steps=5) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    a = ap.parse_args()
    from pagedserve import LLM
    from pagedserve.executor.cuda_graphs import padded_size

    llm = LLM(
        model_dir(LLAMA3_8B), dtype="bfloat16", device="cuda", load_format="dummy", max_model_len=4160,
        max_num_seqs=max(a.batches), max_num_batched_tokens=4096, enable_prefix_caching=False,
    )
    eng = llm.engine
    runner = eng.engine_core.executor.runner
    gr = runner.graph_runner
    c = eng.model_config
    backend = runner.backend
    res = []
    for b in a.batches:
        start_decodes(eng, b, a.ctx, 200)
        row = {"batch": b, "ctx": a.ctx}
        row["step_ms"] = round(cuda_ms(eng.step, 20), 3)
        size = padded_size(b, gr.sizes)
        row["graph_size"] = size
        row["graph_ms"] = round(cuda_ms(gr.graphs[size].replay, 20), 3)
        if backend.name == "triton":
            q = torch.randn(size, c.num_attention_heads, c.head_dim, device="cuda", dtype=torch.bfloat16)
            for label, msl in (("attn_ms_graph_grid", gr.max_model_len), ("attn_ms_real_ctx", a.ctx + 64)):
                row[label] = round(attention_ms(backend, runner.kv_caches[0], gr.bufs, q, msl) * c.num_hidden_layers, 3)
            real = a.ctx + 64
            row["attn_ms_by_decode_tile"] = {  # the decode kernel's key tile, real context
                bn: round(attention_ms(type(backend)(decode_block_n=bn), runner.kv_caches[0], gr.bufs, q, real)
                          * c.num_hidden_layers, 3)
                for bn in (32, 64, 128)
            }
        row["kernels"] = kernel_table(eng)
        row["host"] = host_profile(eng)
        eng.abort_request([f"d{b}-{i}" for i in range(b)])
        res.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("kernels", "host")}), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for row in res:
        print(f"\n== batch {row['batch']}: step {row['step_ms']} ms, graph {row['graph_ms']} ms ==")
        for k in row["kernels"]:
            print(f"{k['ms_per_step']:8.3f} ms {k['calls_per_step']:7.1f}x  {k['kernel']}")
        print("\n".join(row["host"].splitlines()[:30]))


if __name__ == "__main__":
    main()
