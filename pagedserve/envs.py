"""Every environment variable pagedserve reads, in one place, with its meaning (vLLM's
`envs.py` idea). A neutral module: any layer may import it.

Values are read when accessed (`envs.PAGEDSERVE_CPU_ISA`), not at import, so a test
that sets a variable sees it. Settings that a user chooses per engine are engine
arguments (`pagedserve.config`), not variables; these are for operators, A/B
measurements and tests. Variables of other projects (torchrun's RANK, WORLD_SIZE,
MASTER_ADDR ...; HF_HUB_OFFLINE) are read where they are used, under their own names.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _flag(name: str) -> Callable[[], bool]:
    """Set to anything but "" or "0": on."""
    return lambda: os.environ.get(name, "") not in ("", "0")


def _str(name: str, default: str | None = None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or default


def _int(name: str) -> Callable[[], int | None]:
    return lambda: int(os.environ[name]) if os.environ.get(name) else None


def _cache_dir() -> str:
    return os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve")


@dataclass(frozen=True)
class EnvVar:
    read: Callable[[], Any]
    doc: str


VARIABLES: dict[str, EnvVar] = {
    "PAGEDSERVE_CACHE_DIR": EnvVar(
        _cache_dir, "where converted GGUF models and built C++ kernels are kept (default ~/.cache/pagedserve)"
    ),
    "PAGEDSERVE_NO_CPP_KERNELS": EnvVar(
        _flag("PAGEDSERVE_NO_CPP_KERNELS"),
        "1: build and use no C++ kernel (PyTorch paths everywhere; GGUF weights dequantized)",
    ),
    "PAGEDSERVE_NO_FUSED_OPS": EnvVar(
        _flag("PAGEDSERVE_NO_FUSED_OPS"),
        "1: the fused elementwise ops run their PyTorch references (other C++ kernels stay); for A/B runs",
    ),
    "PAGEDSERVE_NO_ONEDNN_PACK": EnvVar(
        _flag("PAGEDSERVE_NO_ONEDNN_PACK"),
        "1: float linears and MoE experts call F.linear on plain weights, not oneDNN's pre-packed ones; for A/B runs",
    ),
    "PAGEDSERVE_NO_MALLOC_TUNING": EnvVar(
        _flag("PAGEDSERVE_NO_MALLOC_TUNING"),
        "1: a CPU engine leaves glibc malloc's mmap / trim thresholds and M_MMAP_MAX alone (executor/host_memory.py); for A/B runs",
    ),
    "PAGEDSERVE_CPU_ISA": EnvVar(
        _str("PAGEDSERVE_CPU_ISA", "auto"),
        "packed-weight kernels: force one path (scalar | avx2 | avx_vnni | avx512 | avx512_vnni | avx512_bf16 | amx_bf16 | amx_int8; auto: the best this CPU has)",
    ),
    "PAGEDSERVE_NUM_THREADS": EnvVar(
        _int("PAGEDSERVE_NUM_THREADS"),
        "torch threads of each data-parallel replica (default: the cores this process may use / replicas)",
    ),
    "PAGEDSERVE_TP_BACKEND": EnvVar(
        _str("PAGEDSERVE_TP_BACKEND"), "tensor parallelism's torch.distributed backend (default gloo on CPU, nccl on GPU)"
    ),
    "PAGEDSERVE_LOCAL_TP_RANKS": EnvVar(
        _int("PAGEDSERVE_LOCAL_TP_RANKS"),
        "tensor parallelism: ranks started on this machine (the others join with torchrun's variables)",
    ),
    "PAGEDSERVE_TP_CHECK_TOKENS": EnvVar(
        _flag("PAGEDSERVE_TP_CHECK_TOKENS"), "1: tensor-parallel ranks check every step that they sampled the same tokens"
    ),
    "PAGEDSERVE_TEST_SLOW_ENGINE": EnvVar(
        _str("PAGEDSERVE_TEST_SLOW_ENGINE", ""),
        'tests only: "<replica>:<seconds>" makes that data-parallel replica sleep after each step',
    ),
}


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted(VARIABLES)
