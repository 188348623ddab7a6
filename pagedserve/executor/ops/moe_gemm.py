"""MoE expert products on PyTorch's brgemm micro-kernel (csrc/moe_kernels.cpp): every expert
of a layer in one call per product, weights packed once into the micro-kernel's blocks.

Chosen over one oneDNN product per expert (BENCHMARKS section 34, AMX Xeon, 8 experts of
2048 x 1024, per layer): 1.2x at 4-20 rows an expert (decode at 8-64 streams), 1.9x at one
token, equal at ~250 rows (prefill); it reads each weight block once a step at 26-30 GB/s
where the per-expert calls reached ~21, and makes two calls a layer instead of sixteen.

Invariants: bf16 in and out, float32 sums rounded once (F.linear's numerics up to the order
of the sums); a row's result does not depend on the other rows; `available()` is False (and
callers keep their own path) without the C++ kernels or where PyTorch's brgemm cannot pack
bf16 (no AVX512-BF16 / AMX) or with PAGEDSERVE_NO_ONEDNN_PACK=1 (plain weights: the A/B
baseline).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from pagedserve import envs
from pagedserve.executor.cpp_build import load_extension

logger = logging.getLogger(__name__)

_SRC = os.path.join(os.path.dirname(__file__), "csrc", "moe_kernels.cpp")
_HEADERS = (os.path.join(os.path.dirname(__file__), "csrc", "work_queue.h"),)
BLOCK_N = 64  # output columns per packed block (32 measured the same; 128 is refused)
_CFLAGS = ("-O3", "-march=native", "-fopenmp")  # the bf16 rounding on AVX512-BF16 where the CPU has it


@functools.cache
def load():
    """The compiled module, or None (no compiler, PAGEDSERVE_NO_CPP_KERNELS=1)."""
    if envs.PAGEDSERVE_NO_CPP_KERNELS:
        return None
    try:
        return load_extension("moe", [_SRC], headers=_HEADERS, cflags=_CFLAGS, ldflags=("-fopenmp",), expected_seconds=30)
    except Exception as e:  # noqa: BLE001 (any build failure: the per-expert products run)
        logger.warning("pagedserve: MoE brgemm kernels unavailable (%s)", e)
        return None


def available() -> bool:
    mod = load()
    return mod is not None and bool(mod.available())


def can_pack(w: torch.Tensor) -> bool:
    """Whether stacked expert weights [E, N, K] take this path."""
    return (
        not envs.PAGEDSERVE_NO_ONEDNN_PACK
        and w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.dim() == 3
        and w.shape[1] % BLOCK_N == 0 and w.shape[2] % 2 == 0 and available()
    )


def pack(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] bf16 (F.linear's layout per expert) -> the micro-kernel's blocks."""
    return load().pack_experts(w.detach().contiguous(), BLOCK_N)


def experts_mm(x: torch.Tensor, offsets: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [R, K] bf16, rows grouped by expert (expert e's rows: offsets[e] .. offsets[e + 1],
    int64 [E + 1]) -> [R, N] bf16: each group times its expert's weight, transposed."""
    return load().experts_mm(x.contiguous(), offsets, packed)


def combine(ys: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """ys [T * k, H] bf16 (rows in expert order), inv int64 [T * k] (the row of each (token,
    choice) pair), weights [T, k] float32 or bf16 -> [T, H] bf16: each token's k outputs
    weighted, each product rounded to bf16, summed in float32 and rounded once (the unfused
    gather, weighting and sum's numerics)."""
    return load().combine(ys, inv, weights)
