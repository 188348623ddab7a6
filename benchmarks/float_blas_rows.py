"""Where a float32 engine on an AVX-512 level should stop multiplying packed weights with the AVX2
many-row kernel and go to dequantized tiles + BLAS (BENCHMARKS section 62): a layer's product
through the layers' one call (qlinear, float32 activations, no copy) with set_float_blas_rows at
10**9 (the kernel at every row count) and at 0 (the BLAS from the prefill threshold), alternated
round by round in one process, on the ISA level now set (default: the CPU's best; a float32
engine on an AVX512-BF16 CPU, or the AVX-512F Xeons that pick float32).

    .venv/bin/python benchmarks/float_blas_rows.py [--types Q4_0 Q4_K Q5_K Q6_K Q8_0] [--rows 12 16 32 64 128 256]

Shape: [2048, 5632] x 4 layers (random blocks). Prints one JSON line per type and row count:
median us a layer, kernel and BLAS.
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
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0"])
    ap.add_argument("--rows", type=int, nargs="+", default=[12, 16, 32, 64, 128, 256])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    mod, (n, k, layers) = kernels.load(), (2048, 5632, 4)
    for name in args.types:
        qt = int(getattr(Q, name))
        ws = [torch.from_numpy(random_packed(qt, n, k, seed=i)) for i in range(layers)]
        for rows in args.rows:
            x = torch.randn(rows, k)
            times: dict[str, list[float]] = {"kernel": [], "blas": []}
            for _ in range(args.rounds):
                for how, blas_from in (("kernel", 10**9), ("blas", 0)):
                    old = kernels.set_float_blas_rows(blas_from)
                    try:
                        t0 = time.perf_counter()
                        for w in ws:
                            mod.qlinear(x, [w], [qt], [0], n, None, False, [])
                        times[how].append((time.perf_counter() - t0) / layers * 1e6)
                    finally:
                        kernels.set_float_blas_rows(old)
            med = {how: round(statistics.median(v)) for how, v in times.items()}
            print(
                json.dumps({"isa": kernels.current_isa(), "type": name, "rows": rows, "us_a_layer": med}),
                flush=True,
            )


if __name__ == "__main__":
    main()
