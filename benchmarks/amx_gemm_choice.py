"""Which product runs a bf16 engine's packed-weight layers on an AMX CPU (BENCHMARKS.md section 33):
one Q4_1 layer, M bf16 rows, hot cache, median ms per call of the AMX level's former route (weights
dequantized per call into bf16 hi + lo, at::mm), the avx512_bf16 kernel over exact quants, the
oneDNN-packed bf16 copy (QuantLinear.attach_bf16_copy) and F.linear on the same bf16 weight.

    python benchmarks/amx_gemm_choice.py
"""

import torch

from pagedserve.bench.forward import _median_time
from pagedserve.executor import onednn_linear as od
from pagedserve.executor.quant import kernels
from pagedserve.executor.quant.formats import quantize_q4_1
from pagedserve.executor.quant.layers import QuantLinear


def ms(fn, n=20):
    return round(_median_time(fn, n) * 1e3, 3)


def row(layer, packed, wd, x) -> dict:
    kernels.set_bf16_onednn_rows(32, amx=True)
    split = ms(lambda: layer(x))
    kernels.set_bf16_onednn_rows(1 << 30, amx=True)
    vdp = ms(lambda: layer(x))
    kernels.set_bf16_onednn_rows(32, amx=True)
    copy = ms(lambda: od.packed_linear(x, packed, None))
    plain = ms(lambda: torch.nn.functional.linear(x, wd))
    return {"split": split, "vdpbf16": vdp, "onednn_copy": copy, "f_linear": plain}


def main():
    print("isa", kernels.current_isa(), "threads", torch.get_num_threads())
    torch.manual_seed(0)
    for n, k in [(1536, 576), (576, 1536), (49152, 576)]:
        pw = quantize_q4_1(torch.randn(n, k) * 0.05)
        layer = QuantLinear.from_packed(pw)
        wd = pw.dequantize().to(torch.bfloat16)
        packed = od.pack_weight(wd)
        for m in [1, 4, 16, 64, 256, 512]:
            x = torch.randn(m, k).to(torch.bfloat16)
            print(n, k, m, row(layer, packed, wd, x), flush=True)


if __name__ == "__main__":
    main()
