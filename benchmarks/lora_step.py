"""The adapter work of one step alone (executor/lora.py), on SmolLM2-135M's shapes: 30 layers of
qkv (576 -> 576 | 192 | 192), o (576 -> 576), gate_up (576 -> 1536 | 1536), down (1536 -> 576),
every target of a rank-16 adapter in `--adapters` bf16 slots, `--tokens` rows spread round-robin
over them. Times the three paths of LoRABatch.apply on the same weights: the PyTorch path (bmm +
index_add), the FMA kernel (plain layouts) and the packed vdpbf16ps kernel (avx512_bf16).

    python benchmarks/lora_step.py [--tokens 64] [--adapters 8] [--reps 10]

Prints one JSON line: milliseconds a step (the best of two rounds) per path.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from pagedserve.executor import lora
from pagedserve.executor.lora import LoRABatch, pack

H, INTER, Q, KV, LAYERS, RANK = 576, 1536, 576, 192, 30, 16
SHAPES = {"qkv": (H, [Q, KV, KV]), "o": (Q, [H]), "gate_up": (H, [INTER, INTER]), "down": (INTER, [H])}


def weights(slots: int, dtype=torch.bfloat16) -> list[dict]:
    out = []
    for _ in range(LAYERS):
        layer = {}
        for name, (n_in, outs) in SHAPES.items():
            cols = [int(c) for c in np.cumsum([0, *outs])]
            a = torch.randn(slots, n_in, RANK * len(outs), dtype=dtype) * 0.02
            b = torch.zeros(slots, RANK * len(outs), cols[-1], dtype=dtype)
            for p in range(len(outs)):
                b[:, p * RANK : (p + 1) * RANK, cols[p] : cols[p + 1]] = torch.randn(slots, RANK, outs[p]) * 0.01
            packed = [pack(a[s], b[s], cols, RANK) for s in range(slots)]
            a2 = torch.stack([p[0] for p in packed]).contiguous()
            b2 = torch.stack([p[1] for p in packed]).contiguous()
            layer[name] = (a, b, a2, b2, torch.tensor(cols, dtype=torch.int64))
        out.append(layer)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    w = weights(args.adapters)
    token_slots = np.arange(args.tokens) % args.adapters
    xs = {n: torch.randn(args.tokens, i, dtype=torch.bfloat16) for n, (i, _) in SHAPES.items()}
    ys = {n: torch.randn(args.tokens, sum(o), dtype=torch.bfloat16) for n, (_, o) in SHAPES.items()}
    k = lora.load_kernels()
    paths = ["pytorch"] + (["fma"] if k is not None else []) + (["packed"] if k is not None and k.get_isa() == 3 else [])

    def step(path: str) -> None:
        batch = LoRABatch(token_slots, torch.device("cpu"))
        for layer in w:
            for n, (a, b, a2, b2, cols) in layer.items():
                if path == "packed":
                    batch.apply(xs[n], ys[n], a2, b2, cols, RANK, True)
                else:
                    batch.apply(xs[n], ys[n], a, b, cols, RANK)

    best: dict[str, float] = {}
    for _ in range(2):
        for path in paths:
            lora.use_kernel = path != "pytorch"
            step(path)
            t = time.perf_counter()
            for _ in range(args.reps):
                step(path)
            ms = (time.perf_counter() - t) / args.reps * 1e3
            best[path] = round(min(best.get(path, ms), ms), 2)
    lora.use_kernel = True
    print(json.dumps({"tokens": args.tokens, "adapters": args.adapters, "threads": torch.get_num_threads(),
                      "ms_per_step": best}))


if __name__ == "__main__":
    main()
