"""The contract between the model runner and an attention backend.

The runner flattens a step's requests into T tokens, decodes first: requests
0 .. num_decodes-1 contribute exactly one token each (tokens 0 .. num_decodes-1), the
others (prefill chunks, possibly over an already cached prefix) follow. Per request r:
  * its query tokens are `query_start_loc[r] : query_start_loc[r + 1]`;
  * `seq_lens[r]` = tokens cached before this step + its query tokens (the context the
    last query token attends to); causal inside the chunk;
  * `block_tables[r, j]` = physical block holding its tokens [j*bs, (j+1)*bs), padded
    with the null block 0;
  * `slot_mapping[t]` = block * block_size + offset where token t's K/V go.
KV cache per layer: K and V each of shape [num_blocks, block_size, num_kv_heads, head_dim].

Per layer, `forward` may be given a sliding `window` (a query at position p attends to
positions p - window + 1 .. p: transformers' mask) and a logit `softcap` (scores become
softcap * tanh(scores / softcap) before the softmax: Gemma 2). A backend that cannot do
either says so (`supports_sliding_window`, `supports_softcap`) and the model refuses to
build on it. With a window, blocks wholly before it are never read: their block-table
entries may already have been given back to the pool (the hybrid KV cache manager).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_decodes: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor  # [num_reqs] int64
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64
    slot_mapping: torch.Tensor  # [T] int64
    max_query_len: int
    max_seq_len: int
    max_decode_seq_len: int
    # The same numbers as Python lists, for backends that loop on the host.
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    # Filled by a backend on the step's first layer, reused by the others (backend-private).
    backend_cache: dict = field(default_factory=dict)
    # KV cache groups (hybrid KV cache manager): per group, the same step with that group's
    # block tables and slot mapping (groups[0] is this object); None: one group.
    groups: list[AttentionMetadata] | None = None

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_list[-1]


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the paged cache and attends over it."""

    name: str = "abstract"
    # True: forward(..., kv_written=True) skips the K/V write, which the caller has already
    # done (the model's fused rotary + cache-write op on the CPU).
    supports_prewritten_kv: bool = False
    # True: the KV cache may be narrower than the model's dtype (kv_cache_dtype float16 /
    # bfloat16): K/V are rounded as written and converted back as read.
    supports_narrow_kv_cache: bool = False
    # forward(..., window=W) and forward(..., softcap=c)
    supports_sliding_window: bool = False
    supports_softcap: bool = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...
