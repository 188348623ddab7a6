"""The architecture hyper-parameters the executor needs, read from a HF config.json dict.

Both the transformers 4 (`rope_theta` / `rope_scaling`) and transformers 5
(`rope_parameters`) spellings are understood.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


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
    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    checkpoint_dtype: str | None = None
    # Sliding-window attention is not implemented: full attention is exact while the
    # context stays within the window, so the engine caps max_model_len at it.
    sliding_window: int | None = None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

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
        rope_params = dict(d.get("rope_parameters") or {})
        rope_theta = d.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        scaling = d.get("rope_scaling") or rope_params or None
        if scaling is not None:
            scaling = dict(scaling)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            scaling["rope_type"] = rope_type
            if rope_type == "default":
                scaling = None
        window = d.get("sliding_window")
        if arch != "MistralForCausalLM" and not d.get("use_sliding_window", False):
            window = None
        eos = d.get("eos_token_id")
        eos_ids = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"Unsupported hidden_act {act!r}; only silu is implemented.")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            hidden_act="silu",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=d.get("dtype") or d.get("torch_dtype"),
            sliding_window=window,
        )
