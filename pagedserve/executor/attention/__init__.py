"""Attention backends: a metadata contract and implementations behind one interface."""

from pagedserve.executor.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.executor.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """ "auto": on a CPU the PyTorch backend with the C++ decode kernel (if it builds);
    "torch": pure PyTorch (the reference)."""
    if name == "auto":
        return TorchAttentionBackend(use_cpp_decode=device == "cpu")
    if name == "torch":
        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: auto, torch")


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]
