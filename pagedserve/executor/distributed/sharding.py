"""Which slice of each weight a tensor-parallel rank holds (Megatron layout, as vLLM).

- column-parallel (qkv_proj, gate_up_proj, lm_head): output rows split by rank; each rank
  computes its own heads / its share of the intermediate / of the vocabulary;
- row-parallel (o_proj, down_proj): input columns split by rank; the partial outputs are
  summed by one all-reduce;
- vocabulary-parallel embedding and LM head: rows [r * Vl, (r + 1) * Vl) with
  Vl = ceil(V / N); the last rank's rows past V are padding (zeros; their logits are cut).

Q heads are split evenly (H % N == 0). KV heads too when there are at least N of them
(K % N == 0); with fewer, each rank holds one KV head, replicated over N / K ranks (the
rank's q heads are exactly those that read that KV head).

Weights may be torch tensors or packed GGUF blocks (`PackedWeight`): rows of a packed
matrix split freely; its K (columns, row-parallel layers) only at block boundaries (32
elements, 256 for K-quants), else a ValueError names the layer's problem.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.quant.formats import BLOCKS, NAMES, PackedWeight


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TPLayout:
    """One rank's share of a model's dimensions."""

    rank: int
    size: int
    num_heads: int  # q heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    kv_head_start: int  # index of this rank's first KV head in the checkpoint
    intermediate: int  # MLP intermediate size on this rank
    vocab_per_rank: int  # rows of the embedding / LM head on this rank (padded)
    vocab_size: int  # the real vocabulary

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @classmethod
    def make(cls, cfg: ModelConfig, rank: int = 0, size: int = 1) -> TPLayout:
        check_divisible(cfg, size)
        h, k = cfg.num_attention_heads, cfg.num_key_value_heads
        if k >= size:
            kv_local, kv_start = k // size, rank * (k // size)
        else:  # fewer KV heads than ranks: one each, shared by size // k consecutive ranks
            kv_local, kv_start = 1, rank // (size // k)
        return cls(
            rank=rank,
            size=size,
            num_heads=h // size,
            num_kv_heads=kv_local,
            kv_head_start=kv_start,
            intermediate=cfg.intermediate_size // size,
            vocab_per_rank=cdiv(cfg.vocab_size, size),
            vocab_size=cfg.vocab_size,
        )


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """ValueError naming the dimension that does not split over `size` ranks."""
    if size == 1:
        return
    h, k = cfg.num_attention_heads, cfg.num_key_value_heads
    problems = []
    if h % size:
        problems.append(f"num_attention_heads={h}")
    if k >= size and k % size or k < size and size % k:
        problems.append(f"num_key_value_heads={k} (must divide by, or divide, the size)")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    if cfg.is_moe and cfg.moe_intermediate_size % size:
        problems.append(f"moe_intermediate_size={cfg.moe_intermediate_size}")
    if cfg.shared_expert_intermediate_size % size:
        problems.append(f"shared_expert_intermediate_size={cfg.shared_expert_intermediate_size}")
    if cfg.qk_norm_full_width:
        problems.append("q/k norms over all heads (OLMoE) do not split over ranks")
    if problems:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model: {', '.join(problems)}.")


Weight = torch.Tensor | PackedWeight


def _rows(w: Weight, start: int, n: int) -> Weight:
    if isinstance(w, PackedWeight):
        return w.narrow_rows(start, n)
    return w.narrow(0, start, n)


def _cols(w: Weight, start: int, n: int) -> Weight:
    if not isinstance(w, PackedWeight):
        return w.narrow(1, start, n)
    be, bb = BLOCKS[w.qtype]
    if start % be or n % be:
        raise ValueError(
            f"a {NAMES[w.qtype]} weight's K={w.shape[1]} does not split at its {be}-element blocks "
            f"into {n}-column shards; use fewer ranks or quantization='none'"
        )
    data = w.data.narrow(1, start // be * bb, n // be * bb)
    return PackedWeight(w.qtype, data, (w.shape[0], n))


def shard_qkv(w: Weight, part: int, lay: TPLayout, head_dim: int) -> Weight:
    """q (part 0), k (1) or v (2) projection rows (or bias) of this rank's heads."""
    if lay.size == 1:
        return w
    if part == 0:
        n = lay.num_heads * head_dim
        return _rows(w, lay.rank * n, n)
    return _rows(w, lay.kv_head_start * head_dim, lay.num_kv_heads * head_dim)


def shard_column(w: Weight, lay: TPLayout) -> Weight:
    """Rows [rank * n, (rank + 1) * n) with n = rows / size (gate, up)."""
    if lay.size == 1:
        return w
    n = w.shape[0] // lay.size
    return _rows(w, lay.rank * n, n)


def shard_row(w: Weight, lay: TPLayout) -> Weight:
    """Input columns [rank * n, (rank + 1) * n) with n = columns / size (o_proj, down_proj)."""
    if lay.size == 1:
        return w
    n = w.shape[1] // lay.size
    return _cols(w, lay.rank * n, n)


def shard_vocab(w: Weight, lay: TPLayout) -> Weight:
    """This rank's vocabulary rows, zero-padded to vocab_per_rank (embedding, LM head).
    Zero bytes are zeros in every packed block type (zero scales), so padding is bytes."""
    if lay.size == 1:
        return w
    start, n = lay.vocab_start, lay.vocab_per_rank
    have = max(0, min(start + n, w.shape[0]) - start)
    if isinstance(w, PackedWeight):
        data = w.data[start : start + have]
        if have < n:
            data = torch.cat([data, torch.zeros((n - have, data.shape[1]), dtype=torch.uint8)])
        return PackedWeight(w.qtype, data.contiguous(), (n, w.shape[1]))
    rows = w[start : start + have]
    if have == n:
        return rows
    pad = torch.zeros((n - have, *w.shape[1:]), dtype=w.dtype, device=w.device)
    return torch.cat([rows, pad])
