"""Model loading: HF safetensors directories and GGUF files, and the embedded default model."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch import nn

from pagedserve.executor.attention.backend import AttentionBackend
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.quant.copy_budget import CopyPolicy
from pagedserve.model_files import default_model_path, is_gguf


def resolve_model_path(model: str) -> str:
    """A local HF directory for `model`: a directory as is; a GGUF file (or "default")
    through its cached conversion. Nothing is ever downloaded."""
    path = default_model_path() if model in ("default", "", None) else model
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model {model!r} is neither a local directory nor a GGUF file (no hub downloads), nor 'default'"
        )
    if is_gguf(path):
        from pagedserve.executor.loader.gguf_loader import converted_dir

        return converted_dir(path)
    return path


def load_hf_config_dict(path: str) -> dict:
    from pagedserve.executor.loader.safetensors_loader import read_hf_config

    return read_hf_config(path)


def iterate_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Float weights of a model directory: its safetensors, or for a converted GGUF the file's
    tensors dequantized one at a time."""
    from pagedserve.executor.loader.gguf_loader import gguf_source, iterate_float_model
    from pagedserve.executor.loader.safetensors_loader import iterate_safetensors

    return iterate_float_model(path) if gguf_source(path) is not None else iterate_safetensors(path)


def build_model(
    path: str,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    load_format: str = "auto",
    quantization: str | None = None,
    weight_copies: CopyPolicy | None = None,
    silu_halves: bool = True,
):
    """Construct the model without initialising weights, then load the checkpoint into it.
    load_format="dummy": random weights made on the device (benchmarks of large shapes).
    A packed model on a CPU keeps the weight copies `weight_copies` allows (None: the
    default policy, "auto" with the CPU's default KV cache: executor/quant/copy_budget.py).
    `silu_halves`: dense SiLU MLPs' oneDNN gate_up weights may be split for the fused
    product (MLP.mark_silu_halves; False with LoRA)."""
    from pagedserve.executor.models import get_model_class
    from pagedserve.executor.quant import resolve_quantization

    quant = resolve_quantization(quantization, path, device, load_format)
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}.")
    cls = get_model_class(cfg.architecture)
    with torch.device("meta"):
        model = cls(cfg, backend)
    model = model.to(dtype=dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty() may have untied them
        model.lm_head.weight = model.embed_tokens.weight
    # buffers are not in the checkpoint; rotary frequencies stay float32 as in transformers
    model.reset_buffers(device)
    if load_format == "dummy":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
    elif quant in ("gguf", "gguf_q8"):
        from pagedserve.executor.loader.gguf_loader import iterate_packed_model

        model.load_weights(iterate_packed_model(path))
        from pagedserve.executor.quant.layers import QuantLinear

        if quant == "gguf_q8":
            for mod in model.modules():
                if isinstance(mod, QuantLinear):
                    mod.act_q8 = True
    else:
        model.load_weights(iterate_weights(path))
    if silu_halves and device.type == "cpu":
        for mod in model.modules():
            if hasattr(mod, "mark_silu_halves"):
                mod.mark_silu_halves()
    if quant in ("int8", "int4"):
        from pagedserve.executor.models.moe import FusedExperts
        from pagedserve.executor.quant.formats import QUANTIZERS
        from pagedserve.executor.quant.layers import quantize_linears

        quantize_linears(model, quant)
        for mod in model.modules():  # MoE experts (stacked tensors, not nn.Linear)
            if isinstance(mod, FusedExperts):
                mod.quantize(QUANTIZERS[quant])
    elif quant == "none" and device.type == "cpu":
        _cpu_float_linears(model, dtype, weight_copies)
    if quant in ("gguf", "gguf_q8", "int8", "int4") and device.type == "cpu":
        from pagedserve.executor.quant.layers import bf16_copies, rows16_copies

        budget = (weight_copies or CopyPolicy()).budget()
        # first: a layer with them gets its bf16 copy from more rows (gguf_q8: the float segments' only)
        rows16_copies(model, budget, drop_packed=quant == "gguf_q8")  # (gguf_q8: the packed rows they replace go)
        if quant == "gguf":
            bf16_copies(model, dtype, budget)
        budget.log()
    return model.eval()


def _cpu_float_linears(model: nn.Module, dtype: torch.dtype, weight_copies: CopyPolicy | None) -> None:
    """float32 on AVX2: the blocked kernel's 12-128-row products (FloatLinear); the other
    float layers on oneDNN's pre-packed weights, bf16 ones on AMX with tile copies as far as
    the copy budget allows; MoE experts on the brgemm micro-kernel in bf16 where PyTorch has
    it (ops/moe_gemm.py), else on oneDNN's pre-packed weights."""
    from pagedserve.executor.models.moe import FusedExperts
    from pagedserve.executor.onednn_linear import pack_linears
    from pagedserve.executor.quant.layers import use_float_kernels

    if dtype == torch.float32:
        use_float_kernels(model)
    budget = (weight_copies or CopyPolicy()).budget() if dtype == torch.bfloat16 else None
    pack_linears(model, budget)
    if budget is not None:
        budget.log()
    for mod in model.modules():
        if isinstance(mod, FusedExperts) and not mod.pack_brgemm():  # brgemm where it packs bf16
            mod.pack_onednn()
