"""gguf_q8's products of Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K on the row-interleaved copy (AVX512-VNNI:
csrc/quant_rows16_vnni.h) against the packed rows' int8 kernels (the few-row tiles below the
many-row threshold, the many-row kernel from it) and against the copy's float kernel (bf16
kernel for --dtype bfloat16: what the default mode runs), through the layers' one call
(qlinear), alternated round by round in one process. BENCHMARKS section 63.

    .venv/bin/python benchmarks/q8_copy_rows.py --type q4_1 --dtype bfloat16 --rows 1 2 4 8 12 16

Shapes (random blocks): [2048, 5632] x 8 layers (a 1 B model's down projection), the default
model's gate_up [3072, 576] and down [576, 1536] x 30 layers each (streamed from memory as in a
decode step); Q4_K / Q5_K (--type q4_k, q5_k): [2048, 5632] x 8 and the 1 B model's gate_up
[11264, 2048] x 4, int8 activations at every row count for "packed" and "copy". Prints one JSON line per shape and row count: median us a layer for "packed" (int8
on the packed rows), "copy" (int8 on the copy, whatever the row count) and "float_copy".
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
    ap.add_argument("--type", choices=["q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k"], default="q4_1")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    mod, qt = kernels.load(), int(getattr(Q, args.type.upper()))
    if not mod.rows16_q8_type(qt):
        sys.exit(f"no int8 kernel on the copy of {args.type} on the {kernels.current_isa()} path")
    kquant = args.type in ("q4_k", "q5_k", "q6_k")
    if kquant:  # int8 activations at every row count (by default its rule may keep few rows float)
        kernels.set_int8_rows(qt, 1)
    shapes = ((2048, 5632, 8), (11264, 2048, 4)) if kquant else ((2048, 5632, 8), (3072, 576, 30), (576, 1536, 30))
    if args.type == "q6_k":  # the 1 B model's down projection and its 49,152-token LM head
        shapes = ((2048, 5632, 8), (49152, 2048, 1))
    for n, k, layers in shapes:
        ws = [torch.from_numpy(random_packed(qt, n, k, seed=i)) for i in range(layers)]
        wis = [kernels.interleave_rows16(w, qt, k) for w in ws]
        empty = torch.empty(0, dtype=torch.uint8)
        runs = {  # name: (act_q8, copies)
            "packed": (True, [empty] * layers),
            "copy": (True, wis),
            "float_copy": (False, wis),
        }
        for rows in args.rows:
            x = torch.randn(rows, k).to(getattr(torch, args.dtype))
            times: dict[str, list[float]] = {name: [] for name in runs}
            old = mod.set_rows16_q8_rows(qt, 10**9)
            try:
                for _ in range(args.rounds):
                    for name, (q8, copies) in runs.items():
                        t0 = time.perf_counter()
                        for w, wi in zip(ws, copies):
                            mod.qlinear(x, [w], [qt], [0], n, None, q8, [wi])
                        times[name].append((time.perf_counter() - t0) / layers * 1e6)
            finally:
                mod.set_rows16_q8_rows(qt, old)
            med = {name: round(statistics.median(v), 1) for name, v in times.items()}
            line = {"isa": kernels.current_isa(), "type": args.type, "dtype": args.dtype, "shape": [n, k],
                    "rows": rows, "us_a_layer": med}
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
