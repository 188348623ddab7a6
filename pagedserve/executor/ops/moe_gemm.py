"""MoE expert products on the matrix units (csrc/moe_kernels.cpp): every expert of a layer
in one call per product, weights packed once into VNNI blocks of output columns: on AMX
(the CPU has it, Linux granted the tiles, PAGEDSERVE_CPU_ISA did not choose a path below)
16-column blocks for the module's own tile kernel, elsewhere 64-column blocks for PyTorch's
brgemm micro-kernel (AVX512-BF16).

brgemm was chosen over one oneDNN product per expert (BENCHMARKS section 34, AMX Xeon, 8
experts of 2048 x 1024, per layer): 1.2x at 4-20 rows an expert (decode at 8-64 streams),
1.9x at one token, equal at ~250 rows (prefill); it reads each weight block once a step at
26-30 GB/s where the per-expert calls reached ~21, and makes two calls a layer instead of
sixteen. The tile kernel then beat brgemm on the same machine (section 39): 1.3-1.4x at
64-1,024 rows an expert, equal at 8 (bandwidth-bound), the same bits.

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
_HEADERS = tuple(os.path.join(os.path.dirname(__file__), "csrc", h) for h in ("work_queue.h", "amx_tiles.h"))
BLOCK_N = 64  # brgemm: output columns per packed block (32 measured the same; 128 is refused)
AMX_BLOCK_N = 16  # the tile kernel: one B tile's columns, so that each tile is contiguous
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


def amx() -> bool:
    """Whether packing picks the tile kernel's blocks: built with it, the tiles granted, and
    the kernels on an AMX path (quant.kernels.amx_in_use, which PAGEDSERVE_CPU_ISA sets)."""
    from pagedserve.executor.quant import kernels as quant_kernels

    mod = load()
    return mod is not None and bool(mod.amx()) and quant_kernels.amx_in_use()


def block_n(w: torch.Tensor) -> int | None:
    """The column block stacked expert weights [E, N, K] are packed in: AMX_BLOCK_N for the
    tile kernel (N and K multiples of 32), else BLOCK_N for brgemm; None: this path cannot
    take them (callers keep their own)."""
    if (
        envs.PAGEDSERVE_NO_ONEDNN_PACK or w.device.type != "cpu" or w.dtype != torch.bfloat16 or w.dim() != 3
        or not available()
    ):
        return None
    n, k = w.shape[1], w.shape[2]
    if n % 32 == 0 and k % 32 == 0 and amx():
        return AMX_BLOCK_N
    return BLOCK_N if n % BLOCK_N == 0 and k % 2 == 0 else None


def can_pack(w: torch.Tensor) -> bool:
    """Whether stacked expert weights [E, N, K] take this path."""
    return block_n(w) is not None


def pack(w: torch.Tensor, bn: int | None = None) -> torch.Tensor:
    """[E, N, K] bf16 (F.linear's layout per expert) -> blocks of bn (default: block_n(w))
    columns; experts_mm runs the tile kernel on 16-column blocks where it is built."""
    return load().pack_experts(w.detach().contiguous(), bn or block_n(w))


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
