"""The executor's element types: the model's (`dtype`) and the KV cache's (`kv_cache_dtype`),
resolved from the config's names (config.py owns the names and checks them)."""

from __future__ import annotations

import torch

from pagedserve.executor.model_config import ModelConfig

MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV cache element types beyond the model dtypes (config.KV_CACHE_DTYPES' names)
KV_DTYPES = MODEL_DTYPES | {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def cpu_has_native_bf16() -> bool:
    """True where bfloat16 matmuls run in hardware (AVX512-BF16 or AMX); elsewhere (e.g. AVX2
    only) oneDNN emulates them at a fraction of float32 speed."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def resolve_dtype(dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """ "auto" follows the checkpoint; on a CPU it is bfloat16 only with native bf16 support,
    else float32. float16 on a CPU becomes bfloat16 (CPUs lack fast fp16)."""
    if dtype == "auto":
        dtype = cfg.checkpoint_dtype or "bfloat16"
        if device.type == "cpu":
            dtype = "bfloat16" if dtype != "float32" and cpu_has_native_bf16() else "float32"
    if device.type == "cpu" and dtype == "float16":
        dtype = "bfloat16"
    return MODEL_DTYPES[dtype]


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's element type: the model's ("auto"), or float16 / bfloat16 on the CPU
    (written rounded from the model's K/V, read back as the model's dtype by the attention
    paths: the C++ decode kernel converts in registers, the SDPA paths after gathering).
    float16 holds |K/V| up to 65504 (larger values become inf, as in llama.cpp's default
    float16 cache); bfloat16 keeps float32's range with 8 mantissa bits. The float8 types
    (vLLM's fp8 KV cache with its default scale of 1.0: values stored as they are) take a
    quarter of float32's bytes and lose precision: e4m3fn keeps 3 mantissa bits and saturates
    at +-448 (its smallest step is 2^-9), e5m2 keeps 2 bits and float16's range."""
    if kv_cache_dtype == "auto":
        return model_dtype
    kv = KV_DTYPES[kv_cache_dtype]
    if device.type != "cpu" and kv != model_dtype:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} differs from the model's {str(model_dtype).removeprefix('torch.')}: "
            "supported on the CPU only (use 'auto' on GPUs)."
        )
    return kv
