"""Fused elementwise ops of a decoder step, with PyTorch references.

The C++ kernels (csrc/fused_ops.cpp) are compiled once per machine by
executor/cpp_build.py, like the attention kernel (-march=native so the compiler
vectorizes for the ISA this CPU has); without a compiler or with
PAGEDSERVE_NO_CPP_KERNELS=1 each op runs its PyTorch reference, which is what the
model ran before (transformers' numerics). CUDA tensors get the Triton versions of the
layer ops (triton_ops.py, through layer_kernels_for); the other ops' references run there.
tests/executor/test_ops.py checks each kernel against its reference.

All ops take and return tensors of the model dtype (float32 or bfloat16 for the kernels).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch
import torch.nn.functional as F

from pagedserve import envs
from pagedserve.executor.cpp_build import load_extension

logger = logging.getLogger(__name__)

_SRC = os.path.join(os.path.dirname(__file__), "csrc", "fused_ops.cpp")
_HEADERS = (os.path.join(os.path.dirname(__file__), "csrc", "avx512_exp.h"),)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


_CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")


@functools.cache
def load():
    """The compiled module, or None (then the references run). Built once per machine by
    executor/cpp_build.py (-march=native: the key includes the CPU's flags)."""
    if envs.PAGEDSERVE_NO_CPP_KERNELS:
        return None
    try:
        return load_extension("fused_ops", [_SRC], headers=_HEADERS, cflags=_CFLAGS, ldflags=("-fopenmp",), expected_seconds=35)
    except Exception as e:  # noqa: BLE001 (any build failure means: use the references)
        logger.warning("pagedserve: fused C++ ops unavailable (%s); using PyTorch", e)
        return None


# PAGEDSERVE_NO_FUSED_OPS=1: these ops run their references (the C++ attention kernel stays;
# PAGEDSERVE_NO_CPP_KERNELS=1 turns off every C++ kernel). For A/B measurements.
enabled = not envs.PAGEDSERVE_NO_FUSED_OPS


def kernels_for(t: torch.Tensor):
    """The compiled module when it can run on `t` (a CPU tensor of a supported dtype), else None."""
    if not enabled or t.device.type != "cpu" or t.dtype not in _KERNEL_DTYPES:
        return None
    return load()


_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _triton_module(name: str):
    """ops/<name>.py (a Triton module), or None without Triton (the `gpu` extra)."""
    try:
        return importlib.import_module(f"pagedserve.executor.ops.{name}")
    except ImportError:
        return None


def writes_kv_cache(kern) -> bool:
    """Whether a `kern` module also writes K/V rows into the cache (rotary_cache_: the C++
    one); the Triton module does not, so the attention backend writes them."""
    return hasattr(kern, "rotary_cache_")


def layer_kernels_for(t: torch.Tensor):
    """The fused layer ops a model passes as `kern` for `t`: the C++ module on the CPU
    (kernels_for), the Triton one (triton_ops.py: the same functions, less rotary_cache_) on
    CUDA, or None (the references)."""
    if t.device.type == "cuda":
        return _triton_module("triton_ops") if enabled and t.dtype in _TRITON_DTYPES else None
    return kernels_for(t)


def moe_kernels_for(t: torch.Tensor):
    """The Triton MoE products (triton_moe.py: fixed shapes, so CUDA graphs capture them) for
    a CUDA tensor where Triton is installed, else None (models/moe.py's own path)."""
    return _triton_module("triton_moe") if t.device.type == "cuda" else None


# ---- references (transformers' order of operations) --------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_ref(x, residual, weight, eps):
    h = x + residual
    return rms_norm_ref(h, weight, eps), h


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, 1, D]: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_and_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- dispatchers ------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    k = kernels_for(x)
    if k is None or x.dim() != 2 or x.stride(1) != 1:
        return rms_norm_ref(x, weight, eps)
    return k.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(norm(x + residual) * weight, x + residual). The kernel works in place: x and residual
    are overwritten with the two results (callers pass tensors they own)."""
    k = kernels_for(x)
    if k is None or x.dim() != 2 or x.stride(1) != 1 or residual.stride(1) != 1:
        return add_rms_norm_ref(x, residual, weight, eps)
    k.add_rms_norm_(x, residual, weight, eps)
    return x, residual


def silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    k = kernels_for(gu)
    if k is None or gu.dim() != 2 or gu.stride(1) != 1:
        return silu_and_mul_ref(gu)
    return k.silu_and_mul(gu)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first maximum), [B, V] -> [B] int64."""
    k = kernels_for(logits)
    if k is None or logits.dim() != 2 or logits.stride(1) != 1:
        return logits.argmax(dim=-1)
    return k.argmax_rows(logits)


def sample_at_temperature(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """A token per row of float32 or bf16 logits [B, V] at temperature [B] (> 0), drawn by inverse
    CDF with the uniforms u [B] in (0, 1]: the sampler's rule (softmax, cumsum, searchsorted)
    in one pass per row with no [B, V] temporaries (64 rows x 49,152: a sampler step 14.2 ->
    2.8 ms). None where the kernel cannot run: the caller samples its own way."""
    k = kernels_for(logits)
    if k is None or logits.dtype not in (torch.float32, torch.bfloat16) or logits.dim() != 2 or logits.stride(1) != 1:
        return None
    return k.sample_rows(logits, temperature.float().contiguous(), u.float().contiguous())


def isa() -> str:
    k = load()
    return k.isa() if k is not None else "none"
