"""Model registry: HF `architectures` name -> module class."""

from __future__ import annotations

from pagedserve.executor.models.gemma import GemmaForCausalLM
from pagedserve.executor.models.llama import LlamaForCausalLM
from pagedserve.executor.models.moe import MoeForCausalLM
from pagedserve.executor.models.phi3 import Phi3ForCausalLM

_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "OlmoeForCausalLM": MoeForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def get_model_class(architecture: str):
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {sorted(_REGISTRY)}"
        ) from None
