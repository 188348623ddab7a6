"""Packed weight formats: GGUF's block types (ids as in ggml) and the PackedWeight carrier."""

from __future__ import annotations

from dataclasses import dataclass

import torch

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30

# type -> (elements per block, bytes per block)
BLOCKS = {
    F32: (1, 4),
    F16: (1, 2),
    BF16: (1, 2),
    Q4_0: (32, 18),
    Q4_1: (32, 20),
    Q5_0: (32, 22),
    Q5_1: (32, 24),
    Q8_0: (32, 34),
    Q4_K: (256, 144),
    Q5_K: (256, 176),
    Q6_K: (256, 210),
}
NAMES = {
    F32: "F32",
    F16: "F16",
    BF16: "BF16",
    Q4_0: "Q4_0",
    Q4_1: "Q4_1",
    Q5_0: "Q5_0",
    Q5_1: "Q5_1",
    Q8_0: "Q8_0",
    Q4_K: "Q4_K",
    Q5_K: "Q5_K",
    Q6_K: "Q6_K",
}
# block-quantized types the kernels run packed (float types are loaded as float tensors)
PACKED_TYPES = frozenset({Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K})


def row_bytes(qtype: int, k: int) -> int:
    be, bb = BLOCKS[qtype]
    if k % be:
        raise ValueError(f"{NAMES[qtype]}: K={k} is not a multiple of its block size {be}")
    return k // be * bb


@dataclass
class PackedWeight:
    """A [N, K] weight kept in a packed block format: `data` is uint8 [N, row_bytes]."""

    qtype: int
    data: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        n, k = self.shape
        if tuple(self.data.shape) != (n, row_bytes(self.qtype, k)) or self.data.dtype != torch.uint8:
            raise ValueError(
                f"packed {NAMES.get(self.qtype, self.qtype)} data {tuple(self.data.shape)} does not hold {self.shape}"
            )

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        from pagedserve.executor.quant import kernels

        return kernels.dequant(self.data, self.qtype, self.shape[1])

    def narrow_rows(self, start: int, length: int) -> PackedWeight:
        return PackedWeight(self.qtype, self.data.narrow(0, start, length), (length, self.shape[1]))


# -- quantizers for float checkpoints (weight-only, scales computed at load) ------------------------


def quantize_q8_0(w: torch.Tensor) -> PackedWeight:
    """Symmetric int8, one float16 scale per group of 32 along K (ggml's Q8_0 layout)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // 32, 32)
    d = (g.abs().amax(-1, keepdim=True) / 127.0).half()
    df = d.float()
    inv = torch.where(df == 0, torch.zeros_like(df), 1.0 / df)
    q = torch.round(g * inv).clamp_(-127, 127).to(torch.int8)
    blocks = torch.cat([d.view(torch.uint8).reshape(n, k // 32, 2), q.view(torch.uint8)], dim=-1)
    return PackedWeight(Q8_0, blocks.reshape(n, -1).contiguous(), (n, k))


def quantize_q4_1(w: torch.Tensor) -> PackedWeight:
    """Asymmetric 4-bit, a float16 scale and minimum per group of 32 along K (ggml's Q4_1)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // 32, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d = ((hi - lo) / 15.0).half()
    m = lo.half()
    df, mf = d.float(), m.float()
    inv = torch.where(df == 0, torch.zeros_like(df), 1.0 / df)
    q = torch.round((g - mf) * inv).clamp_(0, 15).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    blocks = torch.cat(
        [d.view(torch.uint8).reshape(n, k // 32, 2), m.view(torch.uint8).reshape(n, k // 32, 2), qs], dim=-1
    )
    return PackedWeight(Q4_1, blocks.reshape(n, -1).contiguous(), (n, k))


QUANTIZERS = {"int8": quantize_q8_0, "int4": quantize_q4_1}
