"""Per-step communication cost of tensor parallelism (BENCHMARKS.md, "Tensor parallelism").

    python benchmarks/tp_comm.py --model default --tp 1 3            # SmolLM2-135M (9 heads: TP 3)
    python benchmarks/tp_comm.py --random-llama --tp 1 2             # a random 8-head Llama

For each tensor-parallel size: float32 weights, one engine; a prefill of --prefill-len
tokens, then decode steps at each batch size with --context tokens cached per sequence.
Per step: the engine core's step time (schedule + execute + update), rank 0's time inside
execute_model ("busy") and inside collectives ("comm": the all-reduces, the logits
all-gather and any wait for the slower rank), so comm / step is the communication share
and step - busy the dispatch cost (ring broadcast, answer over the pipe). One JSON line each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def random_llama(out_dir: str) -> str:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def measure(model: str, tp: int, batches, context: int, prefill_len: int, steps: int, device: str = "cpu") -> list[dict]:
    from pagedserve import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="float32",
        device=device,
        quantization="none",
        tensor_parallel_size=tp,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        max_num_batched_tokens=max(2048, prefill_len),
        max_model_len=2048,
    )
    core = llm.engine.core.engine_core
    ex = core.executor
    vocab = llm.engine.model_config.vocab_size
    rows = []

    def run(label: str, n_steps: int, batch: int, prep) -> None:
        times, comm, busy = [], [], []
        for _ in range(n_steps):
            prep()
            if tp > 1:
                ex.comm_stats(reset=True)
            t = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t)
            if tp > 1:
                c = ex.comm_stats()[0]
                comm.append(c["seconds"])
                busy.append(c["busy_seconds"])
        step = statistics.median(times)
        row = {"tp": tp, "phase": label, "batch": batch, "step_ms": round(step * 1e3, 2)}
        if tp > 1:
            c, b = statistics.median(comm), statistics.median(busy)
            row |= {
                "comm_ms": round(c * 1e3, 2),
                "busy_ms": round(b * 1e3, 2),
                "comm_share": round(c / step, 3),
                "dispatch_ms": round((step - b) * 1e3, 2),
            }
        rows.append(row)
        print(json.dumps(row), flush=True)

    n = [0]

    def add_prompt():
        n[0] += 1
        ids = [(n[0] * 7919 + j * 31) % (vocab - 100) + 100 for j in range(prefill_len)]
        core.add_request(_req(f"p{n[0]}", ids, SamplingParams(max_tokens=1, ignore_eos=True)))

    if tp > 1:  # the collective alone, ranks lined up: [tokens, hidden] activations
        hidden = llm.engine.model_config.hidden_size
        sizes = sorted({hidden * t for t in (1, *batches, prefill_len)})
        lat = ex._call("bench_all_reduce", sizes, all_ranks=True)[0]  # noqa: SLF001
        for numel, sec in lat.items():
            row = {"tp": tp, "phase": "all_reduce_alone", "tokens": numel // hidden, "us": round(sec * 1e6, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    run("prefill", max(3, steps // 4), 1, add_prompt)
    while core.has_unfinished_requests():
        core.step()
    for b in batches:
        for i in range(b):
            ids = [(i * 131 + j * 17) % (vocab - 100) + 100 for j in range(context)]
            core.add_request(_req(f"d{b}-{i}", ids, SamplingParams(max_tokens=1024, ignore_eos=True, temperature=0)))
        sched = core.scheduler
        while sched.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
            core.step()  # prefill (not timed): from here on every step is b decodes
        run("decode", steps, b, lambda: None)
        core.abort_requests([f"d{b}-{i}" for i in range(b)])
    llm.shutdown()
    return rows


def _req(rid, ids, params):
    from pagedserve.messages import EngineCoreRequest

    return EngineCoreRequest(rid, ids, params, max_tokens=params.max_tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--random-llama", action="store_true", help="a random 8-layer, 8-head Llama (hidden 512)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    model = args.model
    if args.random_llama:
        model = random_llama(tempfile.mkdtemp(prefix="tp-bench-"))
    for tp in args.tp:
        measure(model, tp, args.batches, args.context, args.prefill_len, args.steps, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
