"""Rotary position embeddings and their scalings (transformers' formulas, float32).

Static scalings change the inverse frequencies once: linear, llama3, YaRN (with its
attention factor on cos/sin). Two depend on the sequence length, as transformers computes
them for the sequence being run: LongRoPE (Phi-3) takes its long factors once a sequence
is longer than original_max_position_embeddings, and dynamic NTK raises the base once it is
longer than max_position_embeddings. Here that length is each request's own (its context
after this step), so a request decodes as transformers' generate() runs it alone, and
requests of a batch do not change each other's numbers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.executor import ops
from pagedserve.executor.model_config import ModelConfig


def _base_inv_freq(theta: float, d: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def _llama3(inv: torch.Tensor, sc: dict) -> torch.Tensor:
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    lo_wavelen, hi_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > lo_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
    return torch.where(medium, smoothed, out)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, d: int, sc: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    old = sc.get("original_max_position_embeddings") or max_pos
    factor = sc.get("factor") or max_pos / old
    attn = sc.get("attention_factor")
    if attn is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        attn = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    fast, slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (d * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = corr_dim(fast), corr_dim(slow)
    if sc.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos = theta ** (torch.arange(0, d, 2).float() / d)
    extra = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra, float(attn)


def _longrope(theta: float, d: int, sc: dict, max_pos: int, long: bool) -> tuple[torch.Tensor, float]:
    old = sc["original_max_position_embeddings"]
    factor = sc.get("factor") or max_pos / old
    attn = sc.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    ext = torch.tensor(sc["long_factor" if long else "short_factor"], dtype=torch.float32)
    if ext.numel() != d // 2:
        raise ValueError(f"rope_scaling {'long' if long else 'short'}_factor has {ext.numel()} entries, need {d // 2}.")
    shape = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    return 1.0 / (ext * theta**shape), float(attn)


def _dynamic(theta: float, d: int, sc: dict, max_pos: int, seq_len: int) -> torch.Tensor:
    factor = sc["factor"]
    seq_len = max(seq_len, max_pos)
    base = theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (d / (d - 2))
    return _base_inv_freq(base, d)


def rope_parameters(
    cfg: ModelConfig, theta: float | None = None, scaling: dict | None = None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D/2], the factor on cos/sin) of a static scaling, or of the
    short / original frequencies of a length-dependent one."""
    d = cfg.head_dim
    theta = cfg.rope_theta if theta is None else theta
    inv = _base_inv_freq(theta, d)
    if scaling is None:
        return inv, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv, scaling), 1.0
    if kind == "yarn":
        return _yarn(theta, d, scaling, cfg.max_position_embeddings)
    if kind == "longrope":
        return _longrope(theta, d, scaling, cfg.max_position_embeddings, long=False)
    if kind == "dynamic":
        return inv, 1.0
    raise NotImplementedError(f"rope_scaling type {kind!r} is not supported.")


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] of the model's (global layers') rotary embedding."""
    return rope_parameters(cfg, cfg.rope_theta, cfg.rope_scaling)[0]


class RotaryEmbedding(nn.Module):
    """cos / sin for a step's positions, once per step for all layers of one kind.

    `needs_seq_lens`: the scaling depends on each request's length (LongRoPE, dynamic), so
    `cos_sin` wants every token's request length (`seq_lens` [T])."""

    def __init__(self, cfg: ModelConfig, theta: float | None = None, scaling: dict | None = None) -> None:
        super().__init__()
        self.cfg, self.theta, self.scaling = cfg, cfg.rope_theta if theta is None else theta, scaling
        kind = scaling["rope_type"] if scaling else None
        self.kind = kind
        self.needs_seq_lens = kind in ("longrope", "dynamic")
        inv, self.attention_factor = rope_parameters(cfg, self.theta, scaling)
        self.register_buffer("inv_freq", inv, persistent=False)
        self._long = None

    def reset_buffers(self, device) -> None:
        """Recompute the (non-persistent) frequencies: after a model built on the meta device."""
        self.inv_freq = rope_parameters(self.cfg, self.theta, self.scaling)[0].to(device)
        self._long = None

    def _per_token_inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """[T, D/2]: each token's frequencies from its request's length."""
        cfg, sc = self.cfg, self.scaling
        if self.kind == "longrope":
            if self._long is None:
                self._long = _longrope(self.theta, cfg.head_dim, sc, cfg.max_position_embeddings, long=True)[0]
                self._long = self._long.to(self.inv_freq.device)
            is_long = (seq_lens > sc["original_max_position_embeddings"])[:, None]
            return torch.where(is_long, self._long[None, :], self.inv_freq[None, :])
        out = self.inv_freq[None, :].expand(seq_lens.shape[0], -1).clone()
        for n in torch.unique(seq_lens[seq_lens > cfg.max_position_embeddings]).tolist():
            inv = _dynamic(self.theta, cfg.head_dim, sc, cfg.max_position_embeddings, int(n))
            out[seq_lens == n] = inv.to(out.device)
        return out

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin of shape [T, 1, D]."""
        if self.needs_seq_lens and seq_lens is not None:
            freqs = positions.float()[:, None] * self._per_token_inv_freq(seq_lens)
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


apply_rope = ops.rotate_ref  # x [T, heads, D], cos/sin [T, 1, D]
