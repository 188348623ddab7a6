"""Optional C++ CPU kernels, compiled once per machine with torch's cpp_extension.

`load()` returns the module, or None when it cannot be built (no compiler, headers, or
PAGEDSERVE_NO_CPP_KERNELS=1): callers then use the pure-PyTorch path, which computes the
same thing (tests compare the two).
"""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)

_SRC = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode.cpp")


def _cpu_tag() -> str:
    """Built with -march=native: key the build cache by the CPU's flags, so a cache dir
    shared by different CPUs never loads code with instructions this one lacks."""
    import hashlib
    import platform

    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


@functools.cache
def load():
    if os.environ.get("PAGEDSERVE_NO_CPP_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load as build

        return build(
            name=f"pagedserve_cpu_kernels_{_cpu_tag()}",
            sources=[_SRC],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 (any build failure means: use the fallback)
        logger.warning("pagedserve: C++ CPU kernels unavailable (%s); using the PyTorch path", e)
        return None
