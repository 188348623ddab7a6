"""The exact few-row AMX kernel against the paths beneath it (BENCHMARKS section 66): SmolLM2's
four layer shapes (qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536), 30 random
Q4_1 layers of each cycling (weights from memory, as in a step), M bf16 rows through qlinear, ms
for all 120 products, best of two medians, alternating. `exact`: set_amx_exact_rows(16) (the
default: csrc/quant_rows16_amx_exact.h); `below`: set_amx_exact_rows(0) (the float kernel on the
copy for 1-8 rows, the bf16-rounded tiles from 9). Needs an AMX path. One JSON line per M.

    .venv/bin/python benchmarks/amx_exact_ab.py [--rows 1 2 4 5 8 12 16]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from pagedserve.bench.timing import sample_times
from pagedserve.executor.quant import formats, kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 12, 16])
    a = ap.parse_args()
    if not kernels.amx_in_use():
        raise SystemExit("needs an AMX path (this CPU or PAGEDSERVE_CPU_ISA has none)")
    mod, q4_1 = kernels.load(), int(formats.Q4_1)
    layers = []
    for n, k in SHAPES:
        for _ in range(LAYERS):
            w = formats.quantize_q4_1(torch.randn(n, k) * 0.05).data
            layers.append((w, kernels.interleave_rows16(w, q4_1, k), n, k))

    def products(xs):
        for w, wi, n, k in layers:
            mod.qlinear(xs[k], [w], [q4_1], [0], n, None, False, [wi])

    prev = kernels.set_amx_exact_rows(16)
    try:
        for m in a.rows:
            xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
            ms = {"below": [], "exact": []}
            for _ in range(2):
                for name, rows in (("below", 0), ("exact", 16)):
                    kernels.set_amx_exact_rows(rows)
                    ms[name].append(statistics.median(sample_times(lambda xs=xs: products(xs), 7)) * 1e3)
            below, exact = min(ms["below"]), min(ms["exact"])
            print(json.dumps({"rows": m, "below_ms": round(below, 3), "exact_ms": round(exact, 3),
                              "speedup": round(below / exact, 2)}), flush=True)
    finally:
        kernels.set_amx_exact_rows(prev)


if __name__ == "__main__":
    main()
