"""BENCHMARKS.md section 38: the bf16 fused ops against a copy / a sum of the same bytes
(`python benchmarks/fused_ops_bandwidth.py`): whether an op is bound by memory or by its
instructions. Times are means of 50 calls after 3 warm-ups, the machine's threads."""

import statistics

import torch

from pagedserve.bench.timing import sample_times
from pagedserve.executor import ops


def bench(f, n=50):
    return statistics.mean(sample_times(f, n, warmup=3))


def rows(m: int) -> None:
    a = torch.randn(m, 3072).bfloat16()
    b = torch.empty(m, 3072, dtype=torch.bfloat16)
    x, r, w = torch.randn(m, 576).bfloat16(), torch.randn(m, 576).bfloat16(), torch.ones(576).bfloat16()
    cases = {
        "copy": (lambda: b.copy_(a), 2 * a.numel() * 2),
        "sum": (lambda: a.sum(), a.numel() * 2),
        "silu_mul": (lambda: ops.silu_and_mul(a), 1.5 * a.numel() * 2),
        "add_rms": (lambda: ops.add_rms_norm(x, r, w, 1e-5), 4 * x.numel() * 2),
    }
    for name, (f, nbytes) in cases.items():
        t = bench(f)
        print(m, name, f"{t * 1e3:.3f} ms {nbytes / t / 1e9:.1f} GB/s")


if __name__ == "__main__":
    for m in (2048, 512):
        rows(m)
