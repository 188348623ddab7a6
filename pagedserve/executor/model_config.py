"""The architecture hyper-parameters the executor needs, read from a HF config.json dict.

Both the transformers 4 (`rope_theta` / `rope_scaling`) and transformers 5
(`rope_parameters`, per layer kind for Gemma 3) spellings are understood.

Families: the Llama family (Llama, Mistral, Qwen2, Qwen3), mixture-of-experts (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE), Gemma 2 and 3 (text), Phi-3. Per layer, an attention kind:
"full_attention" or "sliding_attention" (the last `sliding_window` tokens, the current one
included, as transformers' mask). A config field that changes the model in a way not
implemented here is refused with a ValueError naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_FAMILY = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
GEMMA_FAMILY = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SUPPORTED_ARCHITECTURES = LLAMA_FAMILY + MOE_FAMILY + GEMMA_FAMILY + ("Phi3ForCausalLM",)

FULL, SLIDING = "full_attention", "sliding_attention"
ROPE_TYPES = ("linear", "llama3", "yarn", "longrope", "dynamic")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh"}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    o_proj_bias: bool = False  # bias on o_proj (OLMoE / Qwen3-MoE with attention_bias)
    qk_norm: bool = False  # RMSNorm on q and k (Qwen3, Gemma 3: per head; OLMoE: the whole row)
    qk_norm_full_width: bool = False  # OLMoE: the norm spans all heads of q (of k)
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip, clip]
    hidden_act: str = "silu"  # "silu" or "gelu_tanh" (Gemma)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    checkpoint_dtype: str | None = None
    # attention kind per layer (FULL / SLIDING); None: every layer full
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # -- mixture of experts (num_experts 0: a dense MLP everywhere) --
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k probabilities (Mixtral: always)
    router_weights_fp32: bool = False  # Mixtral multiplies by float32 routing weights
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert under a sigmoid gate
    moe_layers: list[int] | None = None  # layers with experts (None: all of them)
    # -- Gemma --
    norm_plus_one: bool = False  # RMSNorm scales by (1 + weight)
    sandwich_norm: bool = False  # post-attention, pre- and post-feedforward norms (Gemma)
    embed_scale: float | None = None  # embeddings times sqrt(hidden) (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma)
    attn_logit_softcapping: float | None = None  # scores = cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None  # Gemma 3: sliding layers' rope base (no scaling)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else FULL

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i (None: full attention)."""
        return self.sliding_window if self.layer_type(i) == SLIDING else None

    @property
    def has_sliding_layers(self) -> bool:
        return bool(self.sliding_window) and any(self.layer_window(i) for i in range(self.num_hidden_layers))

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe and (self.moe_layers is None or i in self.moe_layers)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"Unsupported model architecture {archs!r}; pagedserve supports {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        eos = d.get("eos_token_id")
        eos_ids = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
        # Gemma's MLP reads hidden_activation (default GELU tanh), the others hidden_act
        act = (d.get("hidden_activation") or "gelu_pytorch_tanh") if arch in GEMMA_FAMILY else d.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"Unsupported hidden_act {act!r}; implemented: {', '.join(ACTIVATIONS)}.")
        cfg = cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d.get("intermediate_size") or 0,
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", arch in GEMMA_FAMILY)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", d.get("qkv_bias", _QKV_BIAS(arch)))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM", "Gemma3ForCausalLM"),
            hidden_act=ACTIVATIONS[act],
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=d.get("dtype") or d.get("torch_dtype"),
        )
        _read_rope(cfg, d)
        _read_attention_kinds(cfg, d)
        if arch in MOE_FAMILY:
            _read_moe(cfg, d)
        if arch in GEMMA_FAMILY:
            _read_gemma(cfg, d)
        if arch == "OlmoeForCausalLM":
            cfg.qk_norm_full_width = True
            cfg.o_proj_bias = cfg.attention_bias
            cfg.clip_qkv = d.get("clip_qkv")
        if arch == "Qwen3MoeForCausalLM":
            cfg.o_proj_bias = cfg.attention_bias
        partial = d.get("partial_rotary_factor") or _rope_params(d, FULL).get("partial_rotary_factor") or 1.0
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0).")
        return cfg


def _rope_params(d: dict[str, Any], kind: str | None = None) -> dict[str, Any]:
    """The rope parameters of layer kind `kind` (Gemma 3 keys them by kind in transformers 5)."""
    params = dict(d.get("rope_parameters") or {})
    if kind is not None and isinstance(params.get(kind), dict):
        return dict(params[kind])
    if any(isinstance(v, dict) for v in params.values()):
        return dict(params.get(FULL) or {})
    return params


def _read_rope(cfg: ModelConfig, d: dict[str, Any]) -> None:
    params = _rope_params(d, FULL)
    default = 1e6 if cfg.architecture == "Gemma3ForCausalLM" else 10000.0
    cfg.rope_theta = float(d.get("rope_theta") or params.get("rope_theta") or default)
    scaling = d.get("rope_scaling") or params or None
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "su":  # Phi-3's first name for LongRoPE
            rope_type = "longrope"
        scaling["rope_type"] = rope_type
        if rope_type == "default":
            scaling = None
        elif rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)}).")
        else:
            scaling.setdefault("original_max_position_embeddings", d.get("original_max_position_embeddings"))
            if rope_type == "longrope" and not scaling.get("original_max_position_embeddings"):
                raise ValueError("rope_scaling longrope needs original_max_position_embeddings.")
    cfg.rope_scaling = scaling


def _QKV_BIAS(arch: str) -> bool:  # noqa: N802 (a table)
    return arch == "Qwen2MoeForCausalLM"  # Qwen2-MoE's qkv_bias defaults to True


_QWEN = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def _read_attention_kinds(cfg: ModelConfig, d: dict[str, Any]) -> None:
    """layer_types and the window: transformers 5 writes `layer_types`; older configs say it
    with use_sliding_window / max_window_layers (Qwen2), sliding_window_pattern (Gemma 3) or
    nothing (Mistral, Phi-3, Gemma 2: every layer / every other layer)."""
    window = d.get("sliding_window") or None
    n = cfg.num_hidden_layers
    types = d.get("layer_types")
    arch = cfg.architecture
    if types is None:
        if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
            types = [SLIDING] * n
        elif arch == "Gemma2ForCausalLM":
            types = [SLIDING if i % 2 == 0 else FULL for i in range(n)]
        elif arch == "Gemma3ForCausalLM":
            pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
            types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
        elif d.get("use_sliding_window") and arch == "Qwen2MoeForCausalLM":  # transformers 5's rule
            last = d.get("max_window_layers", 28)
            types = [SLIDING if (i + 1) % 2 and i < last else FULL for i in range(n)]
        elif d.get("use_sliding_window"):  # Qwen2 family: layers from max_window_layers on
            first = d.get("max_window_layers", n)
            types = [SLIDING if i >= first else FULL for i in range(n)]
        else:
            types = [FULL] * n
    elif arch in _QWEN and not d.get("use_sliding_window", False):
        types = [FULL] * n
    types = list(types)
    if len(types) != n or any(t not in (FULL, SLIDING) for t in types):
        raise ValueError(f"layer_types={types!r}: one of {FULL!r} / {SLIDING!r} per layer ({n}).")
    if window is None or window >= cfg.max_position_embeddings:
        types = [FULL] * n  # a window as long as any context is full attention
    cfg.sliding_window = window if SLIDING in types else None
    cfg.layer_types = types


# Config fields of routers and expert layouts that the MoE layer does not implement: the
# value each must have (None: absent / null). Anything else is refused at load.
_MOE_REFUSED = {
    "scoring_func": ("softmax", None),
    "topk_method": ("greedy", None),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (None, 1.0),
    "n_shared_experts": (None, 0),
    "num_shared_experts": (None, 0),
    "moe_layer_freq": (None, 1),
    "first_k_dense_replace": (None, 0),
    "router_bias": (None, False),
    "moe_router_bias": (None, False),
    "e_score_correction_bias": (None,),
}


def _read_moe(cfg: ModelConfig, d: dict[str, Any]) -> None:
    for key, allowed in _MOE_REFUSED.items():
        if d.get(key) not in allowed:
            raise ValueError(
                f"{cfg.architecture}: config field {key}={d[key]!r} is not supported by pagedserve's MoE layer "
                f"(softmax top-k routing only; supported values: {[a for a in allowed if a is not None] or 'unset'})."
            )
    arch = cfg.architecture
    cfg.num_experts = int(d.get("num_local_experts") or d.get("num_experts") or 0)
    cfg.num_experts_per_tok = int(d.get("num_experts_per_tok") or 0)
    if cfg.num_experts < 1 or not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        raise ValueError(
            f"{arch}: num_experts={cfg.num_experts}, num_experts_per_tok={cfg.num_experts_per_tok}: "
            "need 1 <= num_experts_per_tok <= num_experts."
        )
    if arch == "MixtralForCausalLM":
        cfg.moe_intermediate_size = cfg.intermediate_size
        cfg.norm_topk_prob = True
        cfg.router_weights_fp32 = True
        return
    cfg.moe_intermediate_size = int(d.get("moe_intermediate_size") or cfg.intermediate_size)
    cfg.norm_topk_prob = bool(d.get("norm_topk_prob", False))
    if arch == "Qwen2MoeForCausalLM":
        cfg.shared_expert_intermediate_size = int(d.get("shared_expert_intermediate_size") or 0)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        step = int(d.get("decoder_sparse_step") or 1)
        dense = set(d.get("mlp_only_layers") or [])
        cfg.moe_layers = [i for i in range(cfg.num_hidden_layers) if i not in dense and (i + 1) % step == 0]


def _read_gemma(cfg: ModelConfig, d: dict[str, Any]) -> None:
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"{cfg.architecture}: use_bidirectional_attention=True (an encoder) is not supported.")
    cfg.norm_plus_one = True
    cfg.sandwich_norm = True
    cfg.embed_scale = math.sqrt(cfg.hidden_size)
    cfg.query_pre_attn_scalar = d.get("query_pre_attn_scalar") or cfg.head_dim
    cfg.attn_logit_softcapping = d.get("attn_logit_softcapping") or None
    cfg.final_logit_softcapping = d.get("final_logit_softcapping") or None
    if cfg.architecture == "Gemma3ForCausalLM":
        local = _rope_params(d, SLIDING)
        cfg.rope_local_theta = float(d.get("rope_local_base_freq") or local.get("rope_theta") or 10000.0)
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters[{SLIDING!r}] type {local['rope_type']!r}: only 'default' is supported.")
