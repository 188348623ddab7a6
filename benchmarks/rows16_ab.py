"""BENCHMARKS.md sections 39 and 44: few-row products of packed weights, the packed rows' kernel
against the row-interleaved copy's (quant/csrc/quant_rows16.h, float activations) and, where the
CPU has avx512_bf16, the copy's bf16 kernel (quant_rows16_bf16.h: bf16 activations, as a
bfloat16 model's), 1-11 activation rows, 30 layers of weights cycling (the head: one), the best
of 10 runs (`python benchmarks/rows16_ab.py`). Prints "packed -> interleaved [-> bf16] us"."""

import torch

from pagedserve.bench.timing import sample_times
from pagedserve.executor.quant import formats, kernels

torch.manual_seed(0)
CASES = [
    (formats.Q4_1, formats.quantize_q4_1, 1536, 576),  # the default model's gate_up
    (formats.Q4_1, formats.quantize_q4_1, 576, 1536),  # its down
    (formats.Q8_0, formats.quantize_q8_0, 49152, 576),  # its head
]
BF16 = kernels.native_bf16_in_use()
for qt, quantize, n, k in CASES:
    layers = 1 if n > 10000 else 30
    ws = [quantize(torch.randn(n, k) * 0.1) for _ in range(layers)]
    wis = [kernels.interleave_rows16(w.data, qt, k) for w in ws]
    cols = []
    for m in (1, 2, 4, 6, 8, 11):
        x, out = torch.randn(m, k), torch.zeros(m, n)
        xb = x.bfloat16()
        packed = min(sample_times(lambda: [kernels.gemm(x, w.data, qt, out) for w in ws], 10, warmup=2))  # noqa: B023
        inter = min(sample_times(lambda: [kernels.gemm(x, w.data, qt, out, interleaved=wi) for w, wi in zip(ws, wis)], 10, warmup=2))  # noqa: B023
        col = f"{m} rows {packed / layers * 1e6:.0f} -> {inter / layers * 1e6:.0f}"
        if BF16:
            bf = min(sample_times(lambda: [kernels.gemm_bf16(xb, w.data, qt, out, interleaved=wi) for w, wi in zip(ws, wis)], 10, warmup=2))  # noqa: B023
            col += f" -> {bf / layers * 1e6:.0f}"
        cols.append(col + " us")
    print(formats.NAMES[qt], n, "x", k, " | ".join(cols), flush=True)
