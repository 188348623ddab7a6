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
from pagedserve.executor.models.rope import RotaryEmbedding, apply_rope, rope_inv_freq  # noqa: F401


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
        """(norm(x + residual), x + residual). With `kern` (the fused ops: C++ or Triton) in one pass,
        in place: x and residual are overwritten with the two results."""
        if kern is not None:
            kern.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        return ops.add_rms_norm_ref(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, tp: TPLayout, layer_idx: int = 0) -> None:
        super().__init__()
        self.h, self.k, self.d = tp.num_heads, tp.num_kv_heads, cfg.head_dim  # this rank's heads
        self.tp_size = tp.size
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.k) * self.d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.full_width_norm = cfg.qk_norm_full_width  # OLMoE: one norm over all heads of q (of k)
        qn, kn = (self.h * self.d, self.k * self.d) if self.full_width_norm else (self.d, self.d)
        self.q_norm = RMSNorm(qn, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(kn, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.clip = cfg.clip_qkv
        self.scale = cfg.attention_scale
        self.window = cfg.layer_window(layer_idx)  # None: full attention
        self.softcap = cfg.attn_logit_softcapping
        self.backend = backend

    def forward(
        self, x, cos, sin, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, kern=None
    ):
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        extra = {"window": self.window, "softcap": self.softcap}
        if kern is not None and self.q_norm is None and self.clip is None and qkv.stride(-1) == 1:
            # rotary in place on the q and k heads of each row, and (if the backend lets us)
            # the K/V rows written into their cache slots in the same pass
            q, k, v = qkv.split([self.h * self.d, self.k * self.d, self.k * self.d], dim=-1)
            q, k, v = q.view(t, self.h, self.d), k.view(t, self.k, self.d), v.view(t, self.k, self.d)
            if self.backend.supports_prewritten_kv and ops.writes_kv_cache(kern):
                kern.rotary_cache_(qkv, cos, sin, self.h, self.k, self.d, *kv_cache, meta.slot_mapping)
                o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, kv_written=True, **extra)
                return self._out(o.reshape(t, self.h * self.d))
            kern.rotary_(qkv, cos, sin, self.h, self.k, self.d)
        else:
            q, k, v = self._qkv_heads(qkv, t)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, **extra)
        return self._out(o.reshape(t, self.h * self.d))

    def _qkv_heads(self, qkv: torch.Tensor, t: int):
        """q, k, v [T, heads, D] from the fused projection, with the q/k norms (per head, or
        OLMoE's over the whole row) and OLMoE's clamp, in transformers' order."""
        q, k, v = qkv.split([self.h * self.d, self.k * self.d, self.k * self.d], dim=-1)
        if self.q_norm is not None and self.full_width_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (z.clamp(-self.clip, self.clip) for z in (q, k, v))
        q, k, v = q.reshape(t, self.h, self.d), k.reshape(t, self.k, self.d), v.reshape(t, self.k, self.d)
        if self.q_norm is not None and not self.full_width_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        """o_proj, row-parallel: each rank's heads' share, summed over the ranks."""
        out = self.o_proj.forward(o)
        return tp_all_reduce(out) if self.tp_size > 1 else out


class MLP(nn.Module):
    """gate/up (fused, column-parallel) -> act(gate) * up -> down (row-parallel). `intermediate`:
    this rank's share (default the model's); `reduce=False` leaves the all-reduce to the
    caller (a MoE block sums its parts first)."""

    def __init__(self, cfg: ModelConfig, tp: TPLayout, intermediate: int | None = None, reduce: bool = True) -> None:
        super().__init__()
        inter = tp.intermediate if intermediate is None else intermediate
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)  # column-parallel
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)  # row-parallel
        self.tp_size = tp.size if reduce else 1
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def mark_silu_halves(self) -> None:
        """Let the loaded gate_up layer keep its oneDNN weight as gate and up halves (the
        loader calls this before the layers' copies are made; not with LoRA, whose wrapper
        adds to the whole gate_up output): a SiLU MLP then runs them fused (`silu_mul`)."""
        if not self.gelu:
            self.gate_up_proj.act_halves = True  # read by QuantLinear / OneDNNLinear as they pack

    def forward(self, x: torch.Tensor, kern=None) -> torch.Tensor:
        fused = fused_silu_mul(self.gate_up_proj)
        h = fused(x) if fused is not None else None
        if h is None:
            h = act_and_mul(self.gate_up_proj.forward(x), kern, self.gelu)
        out = self.down_proj.forward(h)
        return tp_all_reduce(out) if self.tp_size > 1 else out


def fused_silu_mul(gate_up: nn.Module):
    """The gate_up layer's fused silu(gate) * up (`silu_mul`: QuantLinear / OneDNNLinear on
    oneDNN's halves; it answers None for an x its halves do not serve) where the layer kept
    halves (only SiLU MLPs are marked for them), else None."""
    return gate_up.silu_mul if getattr(gate_up, "silu_halves", None) is not None else None


def act_and_mul(gu: torch.Tensor, kern=None, gelu: bool = False) -> torch.Tensor:
    """[.., 2I] (gate, up) -> act(gate) * up: SiLU (fused where `kern` is given) or GELU tanh."""
    if gelu:
        gate, up = gu.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    if kern is not None and gu.dim() == 2 and gu.stride(1) == 1:
        return kern.silu_and_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, tp: TPLayout, mlp: nn.Module, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, tp, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

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

    def forward_rows(self, x, residual, cos, sin, kv_cache, meta, kern, keep: torch.Tensor):
        """`forward` as the last layer when only rows `keep` of its output are read: attention
        (so every row's K/V) over all rows, the rest over the kept rows only."""
        if residual is None:
            x, residual = self.input_layernorm(x, kern), x
        else:
            x, residual = self.input_layernorm.add_forward(x, residual, kern)
        x = self.self_attn.forward(x, cos, sin, kv_cache, meta, kern)
        x, residual = x.index_select(0, keep), residual.index_select(0, keep)
        if not len(keep):  # a step of chunks that end no prompt: the K/V were all it was for
            return x, residual
        x, residual = self.post_attention_layernorm.add_forward(x, residual, kern)
        return self.mlp.forward(x, kern), residual


class LlamaForCausalLM(nn.Module):
    """Also Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm): the differences are config
    flags. The base of the other families (models/moe.py, gemma.py, phi3.py), which change
    the layers they build (`_make_layer`) and the checkpoint's names (`_checkpoint_tensors`).

    Inside the layer stack, submodules are called through `.forward` (no nn.Module hooks run
    there): `__call__`'s bookkeeping, ~9 calls a layer, is a measurable share of a batch-1
    decode step on a CPU.

    KV cache groups (the hybrid KV cache manager): layer i reads and writes its K/V through
    the block tables of group `kv_group_of_layer[i]` (`meta.groups[g]`; one group, `meta`
    itself, unless the runner set up several)."""

    # The fused ops (executor/ops: C++ on CPU tensors when they build, Triton on CUDA ones);
    # False: PyTorch only.
    use_fused_ops: bool = True
    # Decode-only and short-query-only CPU steps through `_decode_lean` (the same kernels, no
    # per-layer module calls); False: every step through the layers' forward (A/B, tests).
    use_lean_decode: bool = True
    # Families whose layers the lean loop does not know (sandwich norms): False.
    lean_decode_layers: bool = True

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        check_backend(cfg, backend)
        # this rank's share (everything at one rank); the process group must exist already
        self.tp = tp = TPLayout.make(cfg, get_tp_rank(), get_tp_world_size())
        self.embed_tokens = nn.Embedding(tp.vocab_per_rank, cfg.hidden_size)  # vocabulary-parallel
        self.rotary = RotaryEmbedding(cfg, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3: sliding layers rotate with their own base, unscaled
        self.rotary_local = RotaryEmbedding(cfg, cfg.rope_local_theta) if cfg.rope_local_theta else None
        self.layer_rope = [int(self.rotary_local is not None and cfg.layer_window(i) is not None)
                           for i in range(cfg.num_hidden_layers)]
        self.layers = nn.ModuleList([self._make_layer(cfg, backend, tp, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_per_rank, bias=False)  # vocabulary-parallel
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.kv_group_of_layer = [0] * cfg.num_hidden_layers

    def _make_layer(self, cfg: ModelConfig, backend: AttentionBackend, tp: TPLayout, i: int) -> nn.Module:
        return DecoderLayer(cfg, backend, tp, self._make_mlp(cfg, tp, i), i)

    def _make_mlp(self, cfg: ModelConfig, tp: TPLayout, i: int) -> nn.Module:
        return MLP(cfg, tp)

    def reset_buffers(self, device) -> None:
        """Recompute the non-persistent buffers (rotary frequencies; float32 as in
        transformers) after the model was built on the meta device."""
        for rot in (self.rotary, self.rotary_local):
            if rot is not None:
                rot.reset_buffers(device)

    @property
    def cuda_graph_safe(self) -> bool:
        """False where a step reads data on the host (dynamic NTK rope: one frequency table
        per distinct request length), so CUDA graphs cannot capture it."""
        return not any(r is not None and r.kind == "dynamic" for r in (self.rotary, self.rotary_local))

    def _cos_sin(self, positions, dtype, meta: AttentionMetadata):
        seq_lens = None
        if self.rotary.needs_seq_lens:  # each token's request length (LongRoPE, dynamic NTK)
            q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
            # output_size: no device-to-host read of the total (CUDA graphs capture the step)
            seq_lens = torch.repeat_interleave(meta.seq_lens, q_lens, output_size=positions.shape[0])
        out = [self.rotary.cos_sin(positions, dtype, seq_lens)]
        if self.rotary_local is not None:
            out.append(self.rotary_local.cos_sin(positions, dtype))
        return out

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:  # hidden states [T, E] after the final norm
        """`keep` (int64 row indices, maybe empty): only those rows' hidden states are returned
        ([len(keep), E]); with the family's plain decoder layers the last layer's MLP then runs
        on those rows alone (a pooling step reads one row per finished prompt)."""
        x = self._embed(input_ids)
        kern = ops.layer_kernels_for(x) if self.use_fused_ops else None
        rope = self._cos_sin(positions, x.dtype, meta)
        metas = meta.groups or (meta,)
        if kern is not None and self.use_lean_decode and ops.writes_kv_cache(kern):  # the C++ module
            plan = self._lean_plan()
            rows = plan[1](meta) if plan is not None else None
            if rows is not None:  # decode-only, or short queries only (speculative verification)
                h = self._decode_lean(plan, metas, x, rope[0], kv_caches, kern)
                return h if keep is None else h.index_select(0, keep)
        residual, last = None, len(self.layers) - 1
        prune = keep is not None and type(self.layers[last]) is DecoderLayer
        for i, (layer, kv, g, r) in enumerate(zip(self.layers, kv_caches, self.kv_group_of_layer, self.layer_rope)):
            if prune and i == last:
                x, residual = layer.forward_rows(x, residual, *rope[r], kv, metas[g], kern, keep)
            else:
                x, residual = layer.forward(x, residual, *rope[r], kv, metas[g], kern)
        if keep is not None and not prune:
            x, residual = x.index_select(0, keep), residual.index_select(0, keep)
        if keep is not None and not len(keep):
            return x
        return self.norm.add_forward(x, residual, kern)[0]

    def _lean_plan(self):
        """Per layer (norm weights, the projections' forward or the MoE block's, window, KV
        group) and the backend's row and attention functions, or None where the lean decode
        loop does not apply (tensor parallelism, q/k norms, OLMoE's clamp, soft-capping,
        a family with other layers, a backend without the C++ decode-from-QKV kernel). Built
        on the first CPU step, after loading: the projections are the installed modules'
        (QuantLinear, FloatLinear or nn.Linear), so a module swapped after that step needs
        `self._plan = None`."""
        plan = self.__dict__.get("_plan")
        if plan is not None:
            return plan or None
        attn0 = self.layers[0].self_attn
        attend = getattr(attn0.backend, "decode_from_qkv", None)
        rows = getattr(attn0.backend, "decode_rows", None)
        cfg = self.config
        if (
            self.tp.size > 1
            or not self.lean_decode_layers
            or attn0.q_norm is not None
            or attn0.clip is not None
            or attn0.softcap is not None
            or self.rotary_local is not None
            or any(type(layer.mlp) is MLP and layer.mlp.gelu for layer in self.layers)
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
                *_lean_mlp(layer.mlp),
                layer.self_attn.window or 0,
                g,
            )
            for layer, g in zip(self.layers, self.kv_group_of_layer)
        )
        self._plan = (layers, rows, attend, attn0.h, attn0.k, attn0.d, attn0.scale, cfg.rms_norm_eps)
        return self._plan

    def _decode_lean(self, plan, metas, x, cos_sin, kv_caches, kern) -> torch.Tensor:
        """A decode-only CPU step, or one of short queries only (speculative verification):
        the layers' own kernels in the layers' order (so the result is the same to the bit),
        from one loop: no module calls, no split or views of QKV (attention reads the query
        heads in place, one row per query token: each KV group's block-table rows and causal
        lengths). At batch 1 the Python around the kernels is a tenth of the step. A MoE
        layer's block runs as one call (`gate_up_proj` None)."""
        layers, rows_of, attend, h, k, d, scale, eps = plan
        cos, sin = cos_sin
        group_rows = [(m.slot_mapping, *rows_of(m)) for m in metas]
        residual = None
        for (w_in, w_post, qkv_proj, o_proj, gate_up_proj, silu_mul, down_proj, window, g), (kc, vc) in zip(
            layers, kv_caches
        ):
            slots, tables, lens = group_rows[g]
            if residual is None:
                x, residual = kern.rms_norm(x, w_in, eps), x
            else:
                kern.add_rms_norm_(x, residual, w_in, eps)
            qkv = qkv_proj(x)
            kern.rotary_cache_(qkv, cos, sin, h, k, d, kc, vc, slots)
            x = o_proj(attend(qkv, h, kc, vc, tables, lens, scale, window))
            kern.add_rms_norm_(x, residual, w_post, eps)
            if gate_up_proj is None:  # a MoE block
                x = down_proj(x, kern)
            else:
                act = silu_mul(x) if silu_mul is not None else None
                x = down_proj(kern.silu_and_mul(gate_up_proj(x)) if act is None else act)
        kern.add_rms_norm_(x, residual, self.norm.weight, eps)
        return x

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank embeds the ids in its rows (zeros for the
        others) and one all-reduce sums the ranks' rows. Gemma scales by sqrt(hidden) (the
        factor rounded to the model dtype first, as transformers)."""
        tp = self.tp
        if tp.size == 1:
            x = self.embed_tokens(input_ids)
        else:
            local = input_ids - tp.vocab_start
            outside = (local < 0) | (local >= tp.vocab_per_rank)
            x = self.embed_tokens(local.masked_fill(outside, 0))
            x.masked_fill_(outside.unsqueeze(-1), 0.0)
            x = tp_all_reduce(x)
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """[N, E] -> float32 logits [N, V] (computed in the model dtype, like transformers;
        Gemma's final soft cap too); float32=False: the same values left in the model dtype
        (no [N, V] conversion pass, for a sampler that reads them as they are). Tensor-parallel:
        each rank's vocabulary slice, all-gathered, padding cut off, so every rank holds the
        same full logits."""
        logits = self.lm_head(hidden)
        if self.tp.size > 1:
            logits = tp_all_gather(logits, dim=-1)[:, : self.tp.vocab_size]
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if float32 else logits

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

    def _shard_sizes(self, fused: str, target: str = "") -> list[int]:
        """Rows of each part of a fused parameter on this rank."""
        c, tp = self.config, self.tp
        if fused == "qkv_proj":
            return [tp.num_heads * c.head_dim, tp.num_kv_heads * c.head_dim, tp.num_kv_heads * c.head_dim]
        if target:
            half = self.get_parameter(target).shape[0] // 2
            return [half, half]
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

    def _checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """(name without "model.", tensor) of the checkpoint tensors this model loads; the
        families rename, split or adjust them here."""
        for name, tensor in weights:
            if self._SKIP.search(name):
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in self._checkpoint_tensors(weights):
            self._load_tensor(name, tensor, params, loaded)
        missing = sorted(self._expected_keys(params) - loaded)
        if missing:
            raise ValueError(
                f"checkpoint is missing weights: {', '.join(m.split('#')[0] for m in missing[:8])}"
            )
        from pagedserve.executor.quant.layers import finish_packed

        finish_packed(self)

    def _load_tensor(self, name: str, tensor, params: dict, loaded: set[str]) -> None:
        parts = name.split(".")
        target, shard = name, None
        if len(parts) >= 2 and parts[-2] in self._STACKED:
            fused, shard = self._STACKED[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
        tensor = self._shard(target, shard, tensor)  # this rank's slice (packed or not)
        # quantized, kept packed (a float bias of a packed layer stays its parameter)
        if not isinstance(tensor, torch.Tensor) or (self._packed(target) and not target.endswith(".bias")):
            self._load_packed(target, shard, tensor)
            loaded.add(f"{target}#{shard}")
            return
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {self.config.architecture}")
        dst = param
        if shard is not None:
            sizes = self._shard_sizes(target.split(".")[-2], target)
            dst = param.narrow(0, sum(sizes[:shard]), sizes[shard])
        if dst.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)
        loaded.add(f"{target}#{shard}")

    def _expected_keys(self, params: dict) -> set[str]:
        expected = set()
        for pname in params:
            if pname == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            fused = pname.split(".")[-2] if "." in pname else ""
            if fused in ("qkv_proj", "gate_up_proj"):
                expected.update(f"{pname}#{i}" for i in range(3 if fused == "qkv_proj" else 2))
            else:
                expected.add(f"{pname}#None")
        return expected

    def _packed(self, target: str) -> bool:
        from pagedserve.executor.quant.layers import QuantLinear

        mod = self.get_submodule(target.rpartition(".")[0]) if "." in target else None
        return isinstance(mod, QuantLinear)

    def _load_packed(self, target: str, shard: int | None, w) -> None:
        from pagedserve.executor.quant.layers import load_packed

        sizes = None
        if shard is not None:
            mod = self.get_submodule(target.rpartition(".")[0])
            fused = target.split(".")[-2]
            if fused == "qkv_proj":
                sizes = self._shard_sizes(fused)
            else:  # gate/up halves of this layer (the model's MLP, a shared expert's)
                sizes = [mod.out_features // 2] * 2
        load_packed(self, target, shard, sizes, w)


def _lean_mlp(mlp: nn.Module):
    """(gate_up forward, its fused silu_mul or None, down forward) of a dense MLP; (None,
    None, the block's forward) else."""
    if type(mlp) is MLP:
        return mlp.gate_up_proj.forward, fused_silu_mul(mlp.gate_up_proj), mlp.down_proj.forward
    return None, None, mlp.forward


def check_backend(cfg: ModelConfig, backend: AttentionBackend) -> None:
    """A ValueError, naming the config field, for what the attention backend cannot do."""
    if cfg.has_sliding_layers and not backend.supports_sliding_window:
        raise ValueError(
            f"{cfg.architecture} has sliding-window layers (sliding_window={cfg.sliding_window}); the "
            f"{backend.name} attention backend has no sliding window: use attention_backend='torch'."
        )
    if cfg.attn_logit_softcapping and not backend.supports_softcap:
        raise ValueError(
            f"{cfg.architecture}: attn_logit_softcapping={cfg.attn_logit_softcapping} is not supported by the "
            f"{backend.name} attention backend: use attention_backend='torch'."
        )
