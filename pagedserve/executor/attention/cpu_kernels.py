"""Optional C++ CPU attention kernels, compiled once per machine (executor/cpp_build.py).

`load()` returns the module, or None when it cannot be built (no compiler, headers, or
PAGEDSERVE_NO_CPP_KERNELS=1): callers then use the pure-PyTorch path, which computes the
same thing (tests compare the two).
"""

from __future__ import annotations

import functools
import logging
import os

from pagedserve import envs
from pagedserve.executor.cpp_build import load_extension

logger = logging.getLogger(__name__)

_SRC = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode.cpp")
_HEADERS = (
    *(os.path.join(os.path.dirname(__file__), "csrc", h) for h in ("chunk_args.h", "prefill_paged.h", "prefill_bf16.h", "prefill_amx.h", "decode_bf16.h")),
    *(os.path.join(os.path.dirname(__file__), os.pardir, "ops", "csrc", h) for h in ("avx512_exp.h", "work_queue.h", "avx512_transpose.h", "amx_tiles.h")),
)
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")


@functools.cache
def load():
    if envs.PAGEDSERVE_NO_CPP_KERNELS:
        return None
    try:
        mod = load_extension("attention", [_SRC], headers=_HEADERS, cflags=_CFLAGS, ldflags=("-fopenmp",), expected_seconds=35)
    except Exception as e:  # noqa: BLE001 (any build failure means: use the fallback)
        logger.warning("pagedserve: C++ CPU kernels unavailable (%s); using the PyTorch path", e)
        return None
    from pagedserve.executor.quant import kernels as quant_kernels

    sync_isa(mod)
    quant_kernels.on_isa_change(lambda: sync_isa(mod))
    return mod


def sync_isa(mod) -> None:
    """Let bf16 decode rows take the vdpbf16ps kernel (csrc/decode_bf16.h; the module has
    `set_decode_bf16` where it was built with it) only while the kernels run on a path with
    native bf16 (quant.kernels.native_bf16_in_use: PAGEDSERVE_CPU_ISA or set_isa below it turns
    it off). Runs at load and after every set_isa; `mod.set_decode_bf16` switches the kernel
    alone (A/B runs)."""
    from pagedserve.executor.quant import kernels as quant_kernels

    if hasattr(mod, "set_decode_bf16"):
        mod.set_decode_bf16(quant_kernels.native_bf16_in_use())


def amx_prefill_usable(mod) -> bool:
    """Whether prefill chunks may go to the AMX tile kernel (csrc/prefill_amx.h): the module
    was built with it (the compiler targets AMX-BF16) and the kernels run on an AMX path
    (quant.kernels.amx_in_use: the CPU has the tiles, Linux granted them, PAGEDSERVE_CPU_ISA
    did not choose a path below). 1.3-2.5x torch's SDPA per layer (BENCHMARKS section 37)."""
    from pagedserve.executor.quant import kernels as quant_kernels

    return hasattr(mod, "prefill_amx") and quant_kernels.amx_in_use()


def bf16_prefill_usable(mod) -> bool:
    """Whether prefill chunks may go to the vdpbf16ps kernel (csrc/prefill_bf16.h): the module
    was built with it (the compiler targets AVX512-BF16) and the kernels run on a path with
    native bf16 (quant.kernels.native_bf16_in_use: PAGEDSERVE_CPU_ISA did not choose one below).
    1.8-2.9x the float32-arithmetic kernel per layer in bf16 on a Zen 4 (BENCHMARKS section 43)."""
    from pagedserve.executor.quant import kernels as quant_kernels

    return hasattr(mod, "prefill_bf16") and quant_kernels.native_bf16_in_use()


def bf16_prefill_fits(q, k_cache) -> bool:
    """The bf16 prefill kernels' preconditions (the tiles' and vdpbf16ps'): bf16 queries and
    contiguous bf16 cache (K/V as stored equal the model's), head_dim a multiple of 32 up to
    256, rows of contiguous heads."""
    import torch

    d = q.shape[-1]
    return (
        q.dtype == torch.bfloat16
        and k_cache.dtype == torch.bfloat16
        and k_cache.is_contiguous()
        and d % 32 == 0
        and d <= 256
        and q.stride(-1) == 1
        and q.stride(-2) == d
    )
