"""BENCHMARKS.md section 38: MoE experts' products per layer, the brgemm path (ops/moe_gemm.py:
every expert in one call) against one oneDNN product per expert, 8 experts of 2,048 x 1,024
(w13), 8-1,024 rows an expert; the best of 12 runs (`python benchmarks/moe_experts_mm.py`)."""

import torch

from pagedserve.bench.timing import sample_times
from pagedserve.executor import host_memory
from pagedserve.executor import onednn_linear as od
from pagedserve.executor.ops import moe_gemm

host_memory.keep_freed_memory()  # as a CPU engine runs
torch.manual_seed(0)


def best(f, n=12):
    return min(sample_times(f, n, warmup=2))


E, H, I = 8, 1024, 2048
w13 = (torch.randn(E, 2 * I, H) * 0.02).bfloat16()
b13 = moe_gemm.pack(w13)
p13 = [od.pack_weight(w13[e]) for e in range(E)]


def one(rows: int) -> str:
    x = torch.randn(rows * E, H).bfloat16()
    off = torch.arange(0, rows * E + 1, rows, dtype=torch.long)
    t1 = best(lambda: moe_gemm.experts_mm(x, off, b13))
    t2 = best(lambda: [od.packed_linear(x[e * rows : (e + 1) * rows], p13[e], None) for e in range(E)])
    fl = 2 * rows * E * 2 * I * H
    return f"{rows} brgemm {t1 * 1e3:.2f} ms {fl / t1 / 1e12:.2f} TF | oneDNN {t2 * 1e3:.2f} ms {fl / t2 / 1e12:.2f} TF"


for n in (8, 64, 256, 512, 1024):
    print(one(n), flush=True)
