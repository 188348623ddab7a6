"""Where gguf_q8 should run a K-quant on int8 activations (Q6_K: BENCHMARKS section 60; Q5_K: 61;
Q4_K: 62): a layer's product through the layers' one call
(qlinear, act_q8 on, the interleaved copy given) with the type's int8 threshold at 1 row (int8 at
every row count: the few-row tile below the many-row threshold, then the many-row kernel) and
never (float activations: the copy's float or bf16 kernel at few rows, the many-row float or bf16
paths beyond), alternated round by round in one process.

    .venv/bin/python benchmarks/kquant_int8_threshold.py --type q6_k --dtype bfloat16 --rows 1 2 4 8 12 16 64 256
        (PAGEDSERVE_CPU_ISA=avx2 forces the AVX2 path)

Shapes (random blocks): [2048, 5632] x 8 layers (a 1 B model's down projection) and the
[49152, 2048] LM head; [5632, 2048] x 8 too with --gate-up. Prints one JSON line per shape and row
count: median us a layer, float and int8.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))


def main() -> None:
    from gguf import GGMLQuantizationType as Q

    from pagedserve.executor.quant import kernels
    from tests.executor.test_quant_kernels import random_packed

    ap = argparse.ArgumentParser()
    ap.add_argument("--type", choices=["q4_k", "q5_k", "q6_k"], default="q6_k")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 64, 256])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gate-up", action="store_true")
    args = ap.parse_args()
    mod, qt = kernels.load(), int(getattr(Q, args.type.upper()))
    shapes = [(2048, 5632, 8), (49152, 2048, 1)] + ([(5632, 2048, 8)] if args.gate_up else [])
    for n, k, layers in shapes:
        ws = [torch.from_numpy(random_packed(qt, n, k, seed=i)) for i in range(layers)]
        wis = [kernels.interleave_rows16(w, qt, k) for w in ws]
        for rows in args.rows:
            x = torch.randn(rows, k).to(getattr(torch, args.dtype))
            times: dict[str, list[float]] = {"float": [], "int8": []}
            for _ in range(args.rounds):
                for name, from_rows in (("float", 10**9), ("int8", 1)):
                    old = kernels.set_int8_rows(qt, from_rows)
                    try:
                        t0 = time.perf_counter()
                        for w, wi in zip(ws, wis):
                            mod.qlinear(x, [w], [qt], [0], n, None, True, [wi])
                        times[name].append((time.perf_counter() - t0) / layers * 1e6)
                    finally:
                        kernels.set_int8_rows(qt, old)
            med = {name: round(statistics.median(v)) for name, v in times.items()}
            line = {
                "isa": kernels.current_isa(),
                "type": args.type,
                "dtype": args.dtype,
                "shape": [n, k],
                "rows": rows,
                "us_a_layer": med,
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
