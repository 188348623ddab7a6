"""BENCHMARKS.md section 39: few-row products of packed weights, the packed rows' kernel against
the row-interleaved copy's (quant/csrc/quant_rows16.h), 1-11 activation rows, 30 layers of
weights cycling (the head: one), the best of 10 runs (`python benchmarks/rows16_ab.py`)."""

import torch

from pagedserve.bench.timing import sample_times
from pagedserve.executor.quant import formats, kernels

torch.manual_seed(0)
CASES = [
    (formats.Q4_1, formats.quantize_q4_1, 1536, 576),  # the default model's gate_up
    (formats.Q4_1, formats.quantize_q4_1, 576, 1536),  # its down
    (formats.Q8_0, formats.quantize_q8_0, 49152, 576),  # its head
]
for qt, quantize, n, k in CASES:
    layers = 1 if n > 10000 else 30
    ws = [quantize(torch.randn(n, k) * 0.1) for _ in range(layers)]
    wis = [kernels.interleave_rows16(w.data, qt, k) for w in ws]
    cols = []
    for m in (1, 2, 4, 6, 8, 11):
        x, out = torch.randn(m, k), torch.zeros(m, n)
        packed = min(sample_times(lambda: [kernels.gemm(x, w.data, qt, out) for w in ws], 10, warmup=2))  # noqa: B023
        inter = min(sample_times(lambda: [kernels.gemm(x, w.data, qt, out, interleaved=wi) for w, wi in zip(ws, wis)], 10, warmup=2))  # noqa: B023
        cols.append(f"{m} rows {packed / layers * 1e6:.0f} -> {inter / layers * 1e6:.0f} us")
    print(formats.NAMES[qt], n, "x", k, " | ".join(cols), flush=True)
