"""Attention backends: a metadata contract and implementations behind one interface."""

from pagedserve.executor.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.executor.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """Pick a backend by name; "auto" is the PyTorch one on CPU."""
    if name in ("auto", "torch"):
        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: torch")


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]
