"""Attention backends: a metadata contract and implementations behind one interface."""

from pagedserve.executor.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.executor.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """ "auto": Triton on CUDA; on a CPU the PyTorch backend with the C++ decode kernel (if it
    builds). "torch": pure PyTorch (the reference). "triton": the Triton kernels."""
    if name == "triton" or (name == "auto" and device == "cuda"):
        try:
            from pagedserve.executor.attention.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend()
        except ImportError:
            if name == "triton":
                raise
            return TorchAttentionBackend()  # no triton: SDPA on the GPU is correct, only slower
    if name == "auto":
        return TorchAttentionBackend(use_cpp_decode=device == "cpu")
    if name == "torch":
        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: auto, torch, triton")


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]
