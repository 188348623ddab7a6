"""BENCHMARKS.md sections 38-39: MoE experts' products per layer, ops/moe_gemm.py's two kernels
(every expert in one call: the AMX tile kernel on 16-column blocks where it runs, PyTorch's brgemm
on 64-column blocks) against one oneDNN product per expert, 8 experts of 2,048 x 1,024 (w13) and
1,024 x 2,048 (w2), 8-1,024 rows an expert; the best of 12 runs (`python benchmarks/moe_experts_mm.py`)."""

import torch

from pagedserve.bench.timing import sample_times
from pagedserve.executor import host_memory
from pagedserve.executor import onednn_linear as od
from pagedserve.executor.ops import moe_gemm

host_memory.keep_freed_memory()  # as a CPU engine runs
torch.manual_seed(0)
E = 8


def best(f, n=12):
    return min(sample_times(f, n, warmup=2))


def one(name: str, w: torch.Tensor, rows: int, kernels: dict) -> str:
    n, k = w.shape[1], w.shape[2]
    x = torch.randn(rows * E, k).bfloat16()
    off = torch.arange(0, rows * E + 1, rows, dtype=torch.long)
    fl = 2 * rows * E * n * k
    cols = []
    for label, packed in kernels.items():
        t = best(lambda: moe_gemm.experts_mm(x, off, packed))  # noqa: B023 (called at once)
        cols.append(f"{label} {t * 1e3:.2f} ms {fl / t / 1e12:.2f} TF")
    p = [od.pack_weight(w[e]) for e in range(E)]
    t = best(lambda: [od.packed_linear(x[e * rows : (e + 1) * rows], p[e], None) for e in range(E)])
    cols.append(f"oneDNN {t * 1e3:.2f} ms {fl / t / 1e12:.2f} TF")
    return f"{name} {rows} rows: " + " | ".join(cols)


for name, (n, k) in {"w13": (4096, 1024), "w2": (1024, 2048)}.items():
    w = (torch.randn(E, n, k) * 0.02).bfloat16()
    kernels = {"brgemm": moe_gemm.pack(w, moe_gemm.BLOCK_N)}
    if moe_gemm.amx():
        kernels = {"tiles": moe_gemm.pack(w, moe_gemm.AMX_BLOCK_N), **kernels}
    for rows in (8, 64, 256, 512, 1024):
        print(one(name, w, rows, kernels), flush=True)
