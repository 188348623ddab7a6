"""Gemma 2 and Gemma 3 (text): the Llama stack with Gemma's differences, all config flags
but the layer's norms:

  * RMSNorm scales by (1 + weight): the 1 is added to every norm weight at load (float32
    numerics are transformers' to the bit; in bfloat16 the sum is rounded once);
  * sandwich norms: the attention and MLP outputs are normed before the residual adds,
    and the MLP input has its own pre-feedforward norm;
  * GELU (tanh) gating, embeddings times sqrt(hidden) (rounded to the model dtype),
    attention scale query_pre_attn_scalar ** -0.5, tied LM head;
  * per-layer attention kinds: Gemma 2 alternates sliding (even layers) and global ones,
    Gemma 3 has 5 sliding for each global layer, with its own rope base (unscaled) for the
    sliding ones and q/k norms;
  * Gemma 2's soft caps: attention scores (attn_logit_softcapping) and final logits.
"""

from __future__ import annotations

import torch

from pagedserve.executor.attention.backend import AttentionBackend
from pagedserve.executor.distributed.sharding import TPLayout
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.models.llama import Attention, LlamaForCausalLM, RMSNorm


class GemmaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, tp: TPLayout, mlp: torch.nn.Module, layer_idx: int):
        super().__init__()
        e, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(e, eps)
        self.self_attn = Attention(cfg, backend, tp, layer_idx)
        self.post_attention_layernorm = RMSNorm(e, eps)
        self.pre_feedforward_layernorm = RMSNorm(e, eps)
        self.post_feedforward_layernorm = RMSNorm(e, eps)
        self.mlp = mlp

    def forward(self, x, residual, cos, sin, kv_cache, meta, kern=None):
        """(this layer's normed MLP output, the residual stream before it): the base layout,
        so the stack and its final norm are the base model's."""
        if residual is None:
            x, residual = self.input_layernorm(x, kern), x
        else:
            x, residual = self.input_layernorm.add_forward(x, residual, kern)
        x = self.self_attn.forward(x, cos, sin, kv_cache, meta, kern)
        x = self.post_attention_layernorm(x, kern)
        x, residual = self.pre_feedforward_layernorm.add_forward(x, residual, kern)
        x = self.mlp.forward(x, kern)
        return self.post_feedforward_layernorm(x, kern), residual


class GemmaForCausalLM(LlamaForCausalLM):
    lean_decode_layers = False

    def _make_layer(self, cfg: ModelConfig, backend: AttentionBackend, tp: TPLayout, i: int) -> torch.nn.Module:
        return GemmaDecoderLayer(cfg, backend, tp, self._make_mlp(cfg, tp, i), i)

    def _checkpoint_tensors(self, weights):
        for name, tensor in super()._checkpoint_tensors(weights):
            if name.endswith("norm.weight") and isinstance(tensor, torch.Tensor):
                tensor = tensor.float() + 1.0  # (1 + weight), in float32 as transformers
            yield name, tensor
