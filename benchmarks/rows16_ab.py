"""BENCHMARKS.md sections 39, 44 and 56: few-row products of packed weights, the packed rows' kernel
against the row-interleaved copy's (float activations: quant/csrc/quant_rows16.h on AVX-512,
quant_rows16_avx2.h with PAGEDSERVE_CPU_ISA=avx2) and, where the CPU has avx512_bf16, the copy's
bf16 kernel (quant_rows16_bf16.h: bf16 activations, as a bfloat16 model's), 1-11 activation rows,
30 layers of weights cycling (the head: one; --kquants: 12 random [2048, 2048] layers of Q4_K,
Q5_K, Q6_K, Q4_0, Q5_0, Q5_1, from memory), the best of 10 runs.

    [PAGEDSERVE_CPU_ISA=avx2] python benchmarks/rows16_ab.py [--kquants] [--act-q8]

Prints "packed -> interleaved [-> bf16] us" a layer; --act-q8 (section 58) adds gguf_q8's integer
products on the packed rows ("q8 X us") for the types it covers, and 64 and 256 rows (the
many-row kernels; the copy column is then the float many-row kernel too). On the AVX2 path Q6_K's copy is the byte
layout (as on a CPU without AVX512-VBMI)."""

import argparse

import numpy as np
import torch

from pagedserve.bench.timing import sample_times
from pagedserve.executor.quant import formats, kernels

CASES = [
    (formats.Q4_1, formats.quantize_q4_1, 1536, 576),  # the default model's gate_up
    (formats.Q4_1, formats.quantize_q4_1, 576, 1536),  # its down
    (formats.Q8_0, formats.quantize_q8_0, 49152, 576),  # its head
]
# GGUF type -> (elements, bytes) of a block and the byte offsets of its float16 scales
RANDOM_BLOCKS = {
    formats.Q4_K: (256, 144, [0, 2]),
    formats.Q5_K: (256, 176, [0, 2]),
    formats.Q6_K: (256, 210, [208]),
    formats.Q4_0: (32, 18, [0]),
    formats.Q5_0: (32, 22, [0]),
    formats.Q5_1: (32, 24, [0, 2]),
}


def random_packed(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    """Random blocks with finite, moderate float16 scales (the kernel tests' weights)."""
    be, bb, scales = RANDOM_BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // be, bb), dtype=np.uint8)
    for off in scales:
        raw[..., off : off + 2] = rng.uniform(-0.05, 0.05, size=(n, k // be, 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def row(qt: int, ws: list, k: int, n: int, rows: tuple, bf16: bool, act_q8: bool = False) -> str:
    wis = [kernels.interleave_rows16(w, qt, k) for w in ws]
    cols = []
    for m in rows:
        x, out = torch.randn(m, k), torch.zeros(m, n)
        xb = x.bfloat16()
        packed = min(sample_times(lambda: [kernels.gemm(x, w, qt, out) for w in ws], 10, warmup=2))  # noqa: B023
        inter = min(sample_times(lambda: [kernels.gemm(x, w, qt, out, interleaved=wi) for w, wi in zip(ws, wis)], 10, warmup=2))  # noqa: B023
        col = f"{m} rows {packed / len(ws) * 1e6:.0f} -> {inter / len(ws) * 1e6:.0f}"
        if bf16:
            bf = min(sample_times(lambda: [kernels.gemm_bf16(xb, w, qt, out, interleaved=wi) for w, wi in zip(ws, wis)], 10, warmup=2))  # noqa: B023
            col += f" -> {bf / len(ws) * 1e6:.0f}"
        if act_q8 and kernels.act_q8_type(qt):
            q8 = min(sample_times(lambda: [kernels.gemm(x, w, qt, out, act_q8=True) for w in ws], 10, warmup=2))  # noqa: B023
            col += f", q8 {q8 / len(ws) * 1e6:.0f}"
        cols.append(col + " us")
    return " | ".join(cols)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kquants", action="store_true")
    ap.add_argument("--act-q8", action="store_true", help="gguf_q8's integer products too, and 64 / 256 rows")
    a = ap.parse_args()
    torch.manual_seed(0)
    bf16 = kernels.native_bf16_in_use()
    print("isa", kernels.current_isa(), flush=True)
    if a.kquants:
        for qt in RANDOM_BLOCKS:
            ws = [random_packed(qt, 2048, 2048, seed) for seed in range(12)]
            rows = (1, 2, 4, 8, 64, 256) if a.act_q8 else (1, 2, 4, 8)
            print(formats.NAMES[qt], "2048 x 2048", row(qt, ws, 2048, 2048, rows, bf16, a.act_q8), flush=True)
        return
    for qt, quantize, n, k in CASES:
        ws = [quantize(torch.randn(n, k) * 0.1).data for _ in range(1 if n > 10000 else 30)]
        rows = (1, 2, 3, 4, 6, 8, 11, 64, 256) if a.act_q8 else (1, 2, 3, 4, 6, 8, 11)
        print(formats.NAMES[qt], n, "x", k, row(qt, ws, k, n, rows, bf16, a.act_q8), flush=True)


if __name__ == "__main__":
    main()
