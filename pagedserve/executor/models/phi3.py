"""Phi-3 (mini / small-context and 128k LongRoPE variants): the Llama stack with Q/K/V and
gate/up already fused in the checkpoint (`qkv_proj`, `gate_up_proj`). They are split into
their parts as they load, so tensor-parallel sharding and quantization see the same parts
as for Llama. LongRoPE (models/rope.py) picks the short or long factors by each request's
length; Phi-3's sliding_window (2047 in the mini configs) is a sliding window like Mistral's.
"""

from __future__ import annotations

from pagedserve.executor.models.llama import LlamaForCausalLM
from pagedserve.executor.quant.formats import PackedWeight


def split_rows(w, sizes: list[int]) -> list:
    """Row blocks of a tensor or of a packed (GGUF) weight."""
    out, start = [], 0
    for n in sizes:
        out.append(w.narrow_rows(start, n) if isinstance(w, PackedWeight) else w.narrow(0, start, n))
        start += n
    return out


class Phi3ForCausalLM(LlamaForCausalLM):
    def _checkpoint_tensors(self, weights):
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        for name, tensor in super()._checkpoint_tensors(weights):
            prefix, _, leaf = name.rpartition(".")
            if prefix.endswith("self_attn.qkv_proj"):
                base = prefix.removesuffix("qkv_proj")
                for part, t in zip(("q_proj", "k_proj", "v_proj"), split_rows(tensor, [q, kv, kv])):
                    yield f"{base}{part}.{leaf}", t
            elif prefix.endswith("mlp.gate_up_proj"):
                base = prefix.removesuffix("gate_up_proj")
                half = tensor.shape[0] // 2
                gate, up = split_rows(tensor, [half, half])
                yield f"{base}gate_proj.{leaf}", gate
                yield f"{base}up_proj.{leaf}", up
            else:
                yield name, tensor
