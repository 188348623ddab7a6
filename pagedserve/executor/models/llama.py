"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over a flattened, paged batch.

Shapes: T = tokens of the step (all requests flattened), H = heads, K = KV heads, D =
head_dim, E = hidden size. Numerics follow transformers (RMSNorm in float32, rotary
cos/sin in float32 cast to the activation dtype) so that greedy outputs match it.
Q/K/V and gate/up projections are fused; `load_weights` maps checkpoint names.

Tensor parallelism (executor/distributed): with N ranks each holds its Megatron shard
(`TPLayout`: its q heads, its KV heads or a replica of one, its share of the MLP and of the
vocabulary); o_proj and down_proj outputs are summed by one all-reduce each, the embedding
by one more, and the LM head's logits are all-gathered. At N = 1 none of this runs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor import ops
from pagedserve.executor.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.executor.distributed import sharding
from pagedserve.executor.distributed.parallel_state import (
    get_tp_rank,
    get_tp_world_size,
    tp_all_gather,
    tp_all_reduce,
)
from pagedserve.executor.distributed.sharding import TPLayout
from pagedserve.executor.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kern=None) -> torch.Tensor:
        if kern is not None:
            return kern.rms_norm(x, self.weight, self.eps)
        return ops.rms_norm_ref(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor, kern=None):
        """(norm(x + residual), x + residual). With `kern` (the fused CPU ops) in one pass,
        in place: x and residual are overwritten with the two results."""
        if kern is not None:
            kern.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        return ops.add_rms_norm_ref(x, residual, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2], with llama3 / linear scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    kind = sc["rope_type"]
    if kind == "linear":
        return inv / sc["factor"]
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        lo_wavelen, hi_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
        return torch.where(medium, smoothed, out)
    raise NotImplementedError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3).")


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin of shape [T, 1, D], computed once per step for all layers."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


apply_rope = ops.rotate_ref  # x [T, heads, D], cos/sin [T, 1, D]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, tp: TPLayout) -> None:
        super().__init__()
        self.h, self.k, self.d = tp.num_heads, tp.num_kv_heads, cfg.head_dim  # this rank's heads
        self.tp_size = tp.size
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.k) * self.d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.d**-0.5
        self.backend = backend

    def forward(
        self, x, cos, sin, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, kern=None
    ):
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        if kern is not None and self.q_norm is None and qkv.stride(-1) == 1:
            # rotary in place on the q and k heads of each row, and (if the backend lets us)
            # the K/V rows written into their cache slots in the same pass
            q, k, v = qkv.split([self.h * self.d, self.k * self.d, self.k * self.d], dim=-1)
            q, k, v = q.view(t, self.h, self.d), k.view(t, self.k, self.d), v.view(t, self.k, self.d)
            if self.backend.supports_prewritten_kv:
                kern.rotary_cache_(qkv, cos, sin, self.h, self.k, self.d, *kv_cache, meta.slot_mapping)
                o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, kv_written=True)
                return self._out(o.reshape(t, self.h * self.d))
            kern.rotary_(qkv, cos, sin, self.h, self.k, self.d)
        else:
            q, k, v = qkv.split([self.h * self.d, self.k * self.d, self.k * self.d], dim=-1)
            q, k, v = q.view(t, self.h, self.d), k.view(t, self.k, self.d), v.view(t, self.k, self.d)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self._out(o.reshape(t, self.h * self.d))

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        """o_proj, row-parallel: each rank's heads' share, summed over the ranks."""
        out = self.o_proj.forward(o)
        return tp_all_reduce(out) if self.tp_size > 1 else out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPLayout) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * tp.intermediate, bias=False)  # column-parallel
        self.down_proj = nn.Linear(tp.intermediate, cfg.hidden_size, bias=False)  # row-parallel
        self.tp_size = tp.size

    def forward(self, x: torch.Tensor, kern=None) -> torch.Tensor:
        gu = self.gate_up_proj.forward(x)
        if kern is not None:
            out = self.down_proj.forward(kern.silu_and_mul(gu))
        else:
            gate, up = gu.chunk(2, dim=-1)
            out = self.down_proj.forward(F.silu(gate) * up)
        return tp_all_reduce(out) if self.tp_size > 1 else out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, tp: TPLayout) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, residual, cos, sin, kv_cache, meta, kern=None):
        """vLLM's layout: the residual stream travels beside the layer's output, and each norm
        adds the two (x = what the previous block produced; residual None at the first layer).
        Returns (this layer's MLP output, the residual stream before it)."""
        if residual is None:
            x, residual = self.input_layernorm(x, kern), x
        else:
            x, residual = self.input_layernorm.add_forward(x, residual, kern)
        x = self.self_attn.forward(x, cos, sin, kv_cache, meta, kern)
        x, residual = self.post_attention_layernorm.add_forward(x, residual, kern)
        return self.mlp.forward(x, kern), residual


class LlamaForCausalLM(nn.Module):
    """Also Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm): the differences are config flags.

    Inside the layer stack, submodules are called through `.forward` (no nn.Module hooks run
    there): `__call__`'s bookkeeping, ~9 calls a layer, is a measurable share of a batch-1
    decode step on a CPU."""

    # The fused C++ ops (executor/ops) on CPU tensors when they build; False: PyTorch only.
    use_fused_ops: bool = True
    # Decode-only and short-query-only CPU steps through `_decode_lean` (the same kernels, no
    # per-layer module calls); False: every step through the layers' forward (A/B, tests).
    use_lean_decode: bool = True

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        # this rank's share (everything at one rank); the process group must exist already
        self.tp = tp = TPLayout.make(cfg, get_tp_rank(), get_tp_world_size())
        self.embed_tokens = nn.Embedding(tp.vocab_per_rank, cfg.hidden_size)  # vocabulary-parallel
        self.rotary = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList([DecoderLayer(cfg, backend, tp) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_per_rank, bias=False)  # vocabulary-parallel
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # hidden states [T, E] after the final norm
        x = self._embed(input_ids)
        kern = ops.kernels_for(x) if self.use_fused_ops else None
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if kern is not None and self.use_lean_decode:
            plan = self._lean_plan()
            rows = plan[1](meta) if plan is not None else None
            if rows is not None:  # decode-only, or short queries only (speculative verification)
                return self._decode_lean(plan, rows, x, cos, sin, kv_caches, meta, kern)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer.forward(x, residual, cos, sin, kv, meta, kern)
        return self.norm.add_forward(x, residual, kern)[0]

    def _lean_plan(self):
        """Per layer (norm weights, the four projections' forward) and the backend's row and
        attention functions, or None where the lean decode loop does not apply (tensor
        parallelism, q/k norms, a backend without the C++ decode-from-QKV kernel). Built on
        the first CPU step, after loading: the projections are the installed modules'
        (QuantLinear, FloatLinear or nn.Linear), so a module swapped after that step needs
        `self._plan = None`."""
        plan = self.__dict__.get("_plan")
        if plan is not None:
            return plan or None
        attn0 = self.layers[0].self_attn
        attend = getattr(attn0.backend, "decode_from_qkv", None)
        rows = getattr(attn0.backend, "decode_rows", None)
        if (
            self.tp.size > 1
            or attn0.q_norm is not None
            or attend is None
            or rows is None
            or not attn0.backend.supports_prewritten_kv
        ):
            self._plan = ()
            return None
        layers = tuple(
            (
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                layer.self_attn.qkv_proj.forward,
                layer.self_attn.o_proj.forward,
                layer.mlp.gate_up_proj.forward,
                layer.mlp.down_proj.forward,
            )
            for layer in self.layers
        )
        self._plan = (layers, rows, attend, attn0.h, attn0.k, attn0.d, attn0.scale, self.config.rms_norm_eps)
        return self._plan

    def _decode_lean(self, plan, rows, x, cos, sin, kv_caches, meta, kern) -> torch.Tensor:
        """A decode-only CPU step, or one of short queries only (speculative verification):
        the layers' own kernels in the layers' order (so the result is the same to the bit),
        from one loop: no module calls, no split or views of QKV (attention reads the query
        heads in place, one row per query token: `rows` = its block-table rows and causal
        lengths). At batch 1 the Python around the kernels is a tenth of the step."""
        layers, _, attend, h, k, d, scale, eps = plan
        slots, (tables, lens) = meta.slot_mapping, rows
        residual = None
        for (w_in, w_post, qkv_proj, o_proj, gate_up_proj, down_proj), (kc, vc) in zip(layers, kv_caches):
            if residual is None:
                x, residual = kern.rms_norm(x, w_in, eps), x
            else:
                kern.add_rms_norm_(x, residual, w_in, eps)
            qkv = qkv_proj(x)
            kern.rotary_cache_(qkv, cos, sin, h, k, d, kc, vc, slots)
            x = o_proj(attend(qkv, h, kc, vc, tables, lens, scale))
            kern.add_rms_norm_(x, residual, w_post, eps)
            x = down_proj(kern.silu_and_mul(gate_up_proj(x)))
        kern.add_rms_norm_(x, residual, self.norm.weight, eps)
        return x

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank embeds the ids in its rows (zeros for the
        others) and one all-reduce sums the ranks' rows."""
        tp = self.tp
        if tp.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - tp.vocab_start
        outside = (local < 0) | (local >= tp.vocab_per_rank)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, E] -> float32 logits [N, V] (computed in the model dtype, like transformers).
        Tensor-parallel: each rank's vocabulary slice, all-gathered, padding cut off, so
        every rank holds the same full logits."""
        logits = self.lm_head(hidden)
        if self.tp.size > 1:
            logits = tp_all_gather(logits, dim=-1)[:, : self.tp.vocab_size]
        return logits.float()

    # -- weights ------------------------------------------------------------------
    _STACKED = {  # checkpoint name -> (fused parameter, shard index)
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    _SKIP = re.compile(r"rotary_emb\.inv_freq$")

    # how each parameter is split over tensor-parallel ranks (module name -> style);
    # anything else (norms, q/k norms) is replicated
    _PARALLEL_STYLE = {
        "qkv_proj": "qkv",
        "gate_up_proj": "column",
        "o_proj": "row",
        "down_proj": "row",
        "embed_tokens": "vocab",
        "lm_head": "vocab",
    }

    def _shard_sizes(self, fused: str) -> list[int]:
        """Rows of each part of a fused parameter on this rank."""
        c, tp = self.config, self.tp
        if fused == "qkv_proj":
            return [tp.num_heads * c.head_dim, tp.num_kv_heads * c.head_dim, tp.num_kv_heads * c.head_dim]
        return [tp.intermediate, tp.intermediate]

    def _shard(self, target: str, part: int | None, w):
        """This rank's slice of checkpoint tensor `w` bound for parameter `target` (part
        `part` of a fused one): vLLM's weight_loader, one rule per parallel style."""
        if self.tp.size == 1:
            return w
        module = target.split(".")[-2] if "." in target else ""
        style = self._PARALLEL_STYLE.get(module)
        if style == "qkv":
            return sharding.shard_qkv(w, part, self.tp, self.config.head_dim)
        if style == "column":
            return sharding.shard_column(w, self.tp)
        if style == "row":
            return sharding.shard_row(w, self.tp)
        if style == "vocab":
            return sharding.shard_vocab(w, self.tp)
        return w

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if self._SKIP.search(name):
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            parts = name.split(".")
            target, shard = name, None
            if len(parts) >= 2 and parts[-2] in self._STACKED:
                fused, shard = self._STACKED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
            tensor = self._shard(target, shard, tensor)  # this rank's slice (packed or not)
            if not isinstance(tensor, torch.Tensor) or self._packed(target):  # quantized, kept packed
                self._load_packed(target, shard, tensor)
                loaded.add(f"{target}#{shard}")
                continue
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} matches no parameter of {self.config.architecture}"
                )
            with torch.no_grad():
                if shard is None:
                    if param.shape != tensor.shape:
                        raise ValueError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
                else:
                    sizes = self._shard_sizes(target.split(".")[-2])
                    off = sum(sizes[:shard])
                    dst = param.narrow(0, off, sizes[shard])
                    if dst.shape != tensor.shape:
                        raise ValueError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}"
                        )
                    dst.copy_(tensor)
            loaded.add(f"{target}#{shard}")
        expected = set()
        for pname in params:
            if pname == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            fused = pname.split(".")[-2] if "." in pname else ""
            if fused in ("qkv_proj", "gate_up_proj"):
                expected.update(f"{pname}#{i}" for i in range(len(self._shard_sizes(fused))))
            else:
                expected.add(f"{pname}#None")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(
                f"checkpoint is missing weights: {', '.join(m.split('#')[0] for m in missing[:8])}"
            )
        from pagedserve.executor.quant.layers import finish_packed

        finish_packed(self)

    def _packed(self, target: str) -> bool:
        from pagedserve.executor.quant.layers import QuantLinear

        mod = self.get_submodule(target.rpartition(".")[0]) if "." in target else None
        return isinstance(mod, QuantLinear)

    def _load_packed(self, target: str, shard: int | None, w) -> None:
        from pagedserve.executor.quant.layers import load_packed

        sizes = self._shard_sizes(target.split(".")[-2]) if shard is not None else None
        load_packed(self, target, shard, sizes, w)
