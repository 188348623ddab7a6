"""GPU benchmark: a random-weight Llama-3-8B-shaped model in bf16 (nothing downloaded), decode at
batch 1/32/256 with and without CUDA graphs, and prefill, each against the device's roofline
(measured copy bandwidth, measured bf16 matmul rate). Writes one JSON file.

    python3 benchmarks/gpu_bench.py --out results.json          # on the GPU
    python3 benchmarks/gpu_bench.py --smoke --out /tmp/x.json   # tiny shapes, any device (CI)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=2,
    torch_dtype="bfloat16",
)
TINY = dict(
    LLAMA3_8B,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=1000,
    max_position_embeddings=2048,
)


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def measure_bandwidth(dev, nbytes) -> float:
    x = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(dev)
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(dev)
    return 2 * nbytes * 10 / (time.perf_counter() - t)  # bytes read + written per second


def measure_matmul(dev, n) -> float:
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dt, device=dev)
    b = torch.randn(n, n, dtype=dt, device=dev)
    for _ in range(3):
        a @ b
    sync(dev)
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(dev)
    return 2 * n**3 * 10 / (time.perf_counter() - t)


def model_dir(cfg: dict) -> str:
    from tests.checkpoints import build_tokenizer

    d = tempfile.mkdtemp(prefix="pagedserve-gpubench-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    build_tokenizer(d)  # ids are sent directly; the tokenizer only has to exist
    return d


def decode_bench(llm, batch: int, ctx: int, steps: int, dev) -> float:
    from pagedserve import SamplingParams

    eng = llm.engine
    vocab = eng.model_config.vocab_size
    for i in range(batch):
        eng.add_request(
            f"d{batch}-{i}",
            {"prompt_token_ids": [(i * 7919 + j) % (vocab - 10) + 5 for j in range(ctx)]},
            SamplingParams(max_tokens=steps + 16, ignore_eos=True, temperature=0),
        )
    sched = eng.engine_core.scheduler
    while sched.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        eng.step()
    for _ in range(3):
        eng.step()
    sync(dev)
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(dev)
    dt = (time.perf_counter() - t) / steps
    eng.abort_request([f"d{batch}-{i}" for i in range(batch)])
    return dt


def prefill_bench(llm, n: int, dev) -> float:
    from pagedserve import SamplingParams

    eng = llm.engine
    times = []
    for r in range(3):
        eng.add_request(
            f"p{r}",
            {"prompt_token_ids": [(r * 31 + j) % 900 + 50 for j in range(n)]},
            SamplingParams(max_tokens=1, ignore_eos=True),
        )
        sync(dev)
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        sync(dev)
        times.append(time.perf_counter() - t)
    return min(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    from pagedserve import LLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = TINY if a.smoke or dev == "cpu" else LLAMA3_8B
    batches = [1, 4] if a.smoke else [1, 32, 256]
    prefill_len = 256 if a.smoke else 4096
    res = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": "tiny" if cfg is TINY else "llama3-8b-shaped (random bf16)",
        "ctx": a.ctx,
        "runs": [],
    }
    res["copy_bandwidth_Bps"] = measure_bandwidth(dev, (8 << 30) if dev == "cuda" else (64 << 20))
    res["matmul_flops"] = measure_matmul(dev, 8192 if dev == "cuda" else 512)
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}), flush=True)
    d = model_dir(cfg)
    n_params = None
    dtype = "bfloat16" if dev == "cuda" else "float32"
    elem = 2 if dtype == "bfloat16" else 4
    for eager in (True, False) if dev == "cuda" else (True,):
        llm = LLM(
            d,
            dtype=dtype,
            device=dev,
            load_format="dummy",
            max_model_len=max(prefill_len, a.ctx + 64) + 64,
            max_num_seqs=max(batches),
            max_num_batched_tokens=prefill_len,
            enforce_eager=eager,
            enable_prefix_caching=False,
            num_kv_blocks=None if dev == "cuda" else 400,
        )
        model = llm.engine.engine_core.executor.runner.model
        n_params = sum(p.numel() for p in model.parameters())
        c = llm.engine.model_config
        kv_per_tok = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * elem
        for b in batches:
            dt = decode_bench(llm, b, a.ctx, a.steps, dev)
            bytes_step = n_params * elem + b * (a.ctx + a.steps) * kv_per_tok
            t_min = bytes_step / res["copy_bandwidth_Bps"]
            row = {
                "what": "decode",
                "batch": b,
                "cuda_graphs": not eager,
                "step_ms": round(dt * 1e3, 3),
                "tok_s": round(b / dt, 1),
                "bandwidth_roofline_frac": round(t_min / dt, 3),
            }
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
        if eager:
            dt = prefill_bench(llm, prefill_len, dev)
            flops = (
                2 * n_params * prefill_len
                + 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * prefill_len**2
            )
            row = {
                "what": "prefill",
                "tokens": prefill_len,
                "s": round(dt, 4),
                "tok_s": round(prefill_len / dt, 1),
                "matmul_roofline_frac": round(flops / dt / res["matmul_flops"], 3),
            }
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
        del llm, model
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    res["params"] = n_params
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
