"""pagedserve: an LLM inference and serving engine (PagedAttention + continuous batching)."""

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.frontend.llm import LLM
from pagedserve.lora import LoRARequest
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import (
    BeamSearchParams,
    PoolingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "LLMEngine",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
