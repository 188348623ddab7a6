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
_HEADERS = (os.path.join(os.path.dirname(__file__), "csrc", "prefill_causal.h"),)
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")


@functools.cache
def load():
    if envs.PAGEDSERVE_NO_CPP_KERNELS:
        return None
    try:
        return load_extension("attention", [_SRC], headers=_HEADERS, cflags=_CFLAGS, ldflags=("-fopenmp",), expected_seconds=35)
    except Exception as e:  # noqa: BLE001 (any build failure means: use the fallback)
        logger.warning("pagedserve: C++ CPU kernels unavailable (%s); using the PyTorch path", e)
        return None


def sdpa_fresh_prefill(dtype) -> bool:
    """Whether a step's fresh bfloat16 prompts go to torch's SDPA instead of the C++ causal
    kernel: where the kernels run on an AMX path (quant.kernels.amx_in_use; PyTorch's flash
    attention runs its products on the tiles, 2-3.5x the float32 C++ kernel: BENCHMARKS
    section 33); float32 keeps the C++ kernel."""
    import torch

    from pagedserve.executor.quant import kernels as quant_kernels

    return dtype == torch.bfloat16 and quant_kernels.amx_in_use()
