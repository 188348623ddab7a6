"""Decode throughput of a random-weight MoE (~0.9B total, ~0.28B active parameters a
token) beside dense models of the same total and of the same active size, same run.

    python benchmarks/moe_decode.py [--batches 1 32] [--context 256] [--steps 12] [--dtype float32]

Shapes: 16 layers, hidden 1024, 16 q heads / 4 KV heads (head_dim 64), vocabulary 32000
(untied). MoE: 8 experts of intermediate 2048, top-2 (Mixtral's router). Dense "total":
intermediate 16384 (the MoE's parameters); dense "active": intermediate 4096 (the MoE's
per-token MLP work). Weights are random (load_format="dummy"); each engine step is one full
step (schedule, forward, sample, update) with --context tokens cached per sequence, median
of --steps taken in turns with the other models (the machine's noise hits all alike).
One JSON line per (model, batch) and the MoE's ratios to both dense models.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

COMMON = dict(
    vocab_size=32000,
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
MODELS = {
    "moe_8x2048_top2": dict(architectures=["MixtralForCausalLM"], intermediate_size=2048, num_local_experts=8,
                            num_experts_per_tok=2),
    "dense_total_16384": dict(architectures=["LlamaForCausalLM"], intermediate_size=16384),
    "dense_active_4096": dict(architectures=["LlamaForCausalLM"], intermediate_size=4096),
}


def params(cfg: dict) -> tuple[float, float]:
    """(total, active per token) parameters, in billions."""
    h, n, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    attn = 2 * h * h + 2 * h * cfg["num_key_value_heads"] * cfg["head_dim"]
    mlp = 3 * h * cfg["intermediate_size"]
    e, k = cfg.get("num_local_experts", 1), cfg.get("num_experts_per_tok", 1)
    return (n * (attn + e * mlp) + 2 * v * h) / 1e9, (n * (attn + k * mlp) + v * h) / 1e9


def make_engine(path: str, dtype: str, batches, context: int, steps: int):
    from pagedserve import LLM

    blocks = max(batches) * (-(-(context + steps + 16) // 16)) + 2
    return LLM(path, dtype=dtype, load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=False,
               max_num_seqs=max(batches), num_kv_blocks=blocks)


def prefill(llm, b: int, context: int, steps: int) -> None:
    """b requests of `context` tokens, prefilled and one decode step in (not timed)."""
    from pagedserve import SamplingParams

    eng = llm.engine
    for i in range(b):
        ids = [(i * 131 + j * 17) % 31000 + 100 for j in range(context)]
        eng.add_request(f"d{b}-{i}", {"prompt_token_ids": ids},
                        SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0))
    sched = eng.engine_core.scheduler
    while sched.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        eng.step()
    eng.step()


def interleaved(llms: dict, b: int, steps: int) -> dict:
    """Median decode tokens/s of each engine, their steps taken in turns (a noisy, shared
    machine slows all of them alike)."""
    times = {name: [] for name in llms}
    for _ in range(steps):
        for name, llm in llms.items():
            t = time.perf_counter()
            llm.engine.step()
            times[name].append(time.perf_counter() - t)
    for llm in llms.values():
        for i in range(b):
            llm.engine.abort_request(f"d{b}-{i}")
    return {name: b / statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    res: dict[str, dict[int, float]] = {name: {} for name in MODELS}
    with tempfile.TemporaryDirectory() as tmp:
        llms, sizes = {}, {}
        for name, extra in MODELS.items():
            cfg = {**COMMON, **extra}
            d = os.path.join(tmp, name)
            os.makedirs(d)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cfg, f)
            sizes[name] = params(cfg)
            llms[name] = make_engine(d, args.dtype, args.batches, args.context, args.steps)
        for b in args.batches:
            for llm in llms.values():
                prefill(llm, b, args.context, args.steps)
            for name, tps in interleaved(llms, b, args.steps).items():
                res[name][b] = tps
                total, active = sizes[name]
                print(json.dumps({"model": name, "params_b": round(total, 3), "active_b": round(active, 3),
                                  "dtype": args.dtype, "batch": b, "context": args.context,
                                  "decode_tok_s": round(tps, 2)}), flush=True)
    moe = res["moe_8x2048_top2"]
    for b in args.batches:
        print(json.dumps({"batch": b, "moe_vs_dense_total": round(moe[b] / res["dense_total_16384"][b], 2),
                          "moe_vs_dense_active": round(moe[b] / res["dense_active_4096"][b], 2)}))


if __name__ == "__main__":
    main()
