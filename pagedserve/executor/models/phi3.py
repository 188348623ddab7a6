"""Phi-3 (mini / small-context and 128k LongRoPE variants): the Llama stack with Q/K/V and
gate/up already fused in the checkpoint (`qkv_proj`, `gate_up_proj`). They are split into
their parts as they load, so tensor-parallel sharding and quantization see the same parts
as for Llama. LongRoPE (models/rope.py) picks the short or long factors by each request's
length; Phi-3's sliding_window (2047 in the mini configs) is a sliding window like Mistral's.
"""

from __future__ import annotations

import torch

from pagedserve.executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def _checkpoint_tensors(self, weights):
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        for name, tensor in super()._checkpoint_tensors(weights):
            prefix, _, leaf = name.rpartition(".")
            if prefix.endswith("self_attn.qkv_proj") and isinstance(tensor, torch.Tensor):
                base = prefix.removesuffix("qkv_proj")
                for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv], dim=0)):
                    yield f"{base}{part}.{leaf}", t
            elif prefix.endswith("mlp.gate_up_proj") and isinstance(tensor, torch.Tensor):
                base = prefix.removesuffix("gate_up_proj")
                gate, up = tensor.chunk(2, dim=0)
                yield f"{base}gate_proj.{leaf}", gate
                yield f"{base}up_proj.{leaf}", up
            else:
                yield name, tensor
