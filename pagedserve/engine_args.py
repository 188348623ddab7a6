"""EngineArgs: the one registry of engine settings, with vLLM's names and defaults.

Both entry points are generated from it: the command line (`add_cli_args` makes a flag
per field: `max_num_seqs` -> `--max-num-seqs`, booleans as `--x/--no-x`) and the offline
`LLM(**kwargs)` (its signature is this dataclass's fields). A keyword that is a vLLM
engine argument pagedserve does not implement gets an error naming it, not a TypeError.
"""

from __future__ import annotations

import argparse
import inspect
import json
from dataclasses import dataclass, field, fields

from pagedserve.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelLoadConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    add_fields_to_parser,
    default_of,
    parse_bytes,
    setting,
)

# EngineConfig's sections, by attribute name: each EngineArgs field fills one of them
SECTIONS = {
    "model": ModelLoadConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "observability": ObservabilityConfig,
    "lora": LoRAConfig,
}


def _from(section: str, name: str | None = None):
    """An EngineArgs field that is config field `section.name` (default: the EngineArgs
    field's own name, given by the caller's annotation): the config's default, choices,
    type and help, read from there (the one source)."""
    return _Source(section, name)


class _Source:
    """A placeholder `_from` leaves in the class body; `_sourced` turns it into a field."""

    def __init__(self, section: str, name: str | None) -> None:
        self.section, self.name = section, name


def _sourced(cls):
    """Before @dataclass: each `_from` placeholder becomes a field with its config field's
    default and metadata (plus `source`: (section, config field name))."""
    for attr, value in list(vars(cls).items()):
        if isinstance(value, _Source):
            name = value.name or attr
            f = next(g for g in fields(SECTIONS[value.section]) if g.name == name)
            md = {**f.metadata, "source": (value.section, name)}
            setattr(cls, attr, field(default=default_of(f), metadata=md))
    return cls


@dataclass
@_sourced
class EngineArgs:
    # -- model ------------------------------------------------------------------------
    model: str = _from("model")
    tokenizer: str | None = _from("model")
    skip_tokenizer_init: bool = _from("model")
    structured_outputs_backend: str = _from("model")
    dtype: str = _from("model")
    device: str = _from("model")
    seed: int = _from("model")
    load_format: str = _from("model")
    quantization: str | None = _from("model")
    weight_copies: str = _from("model")
    enforce_eager: bool = _from("model")
    runner: str = _from("model")
    pooling_type: str | None = _from("model")
    pooling_normalize: bool | None = _from("model")
    # vLLM's older spelling of runner="pooling": task="embed" (defined here only)
    task: str | None = setting(None, "deprecated spelling: embed (= --runner pooling) | generate", choices=(None, "embed", "embedding", "generate"))
    # -- KV cache ---------------------------------------------------------------------
    block_size: int = _from("cache")
    num_kv_blocks: int | None = _from("cache")
    kv_cache_memory_bytes: int | None = _from("cache")
    kv_cache_prefault: bool | None = _from("cache")
    gpu_memory_utilization: float = _from("cache")
    enable_prefix_caching: bool = _from("cache")
    kv_cache_dtype: str = _from("cache")
    kv_offload_dir: str | None = _from("cache")
    kv_offload_bytes: int = _from("cache")
    # -- scheduler --------------------------------------------------------------------
    max_model_len: int | None = _from("scheduler")
    max_num_seqs: int = _from("scheduler")
    max_num_batched_tokens: int | None = _from("scheduler")
    enable_chunked_prefill: bool = _from("scheduler")
    long_prefill_token_threshold: int = _from("scheduler")
    scheduling_policy: str = _from("scheduler")
    short_request_tokens: int = _from("scheduler")
    short_budget_share: float = _from("scheduler")
    max_wait_s: float = _from("scheduler")
    long_lane_chunk_tokens: int = _from("scheduler")
    long_solo_chunk_tokens: int = _from("scheduler")
    long_lane_step_ms: float = _from("scheduler")
    long_lane_period: int = _from("scheduler")
    expected_output_tokens: int = _from("scheduler")
    scheduler_cls: str = _from("scheduler")
    # -- processes --------------------------------------------------------------------
    tensor_parallel_size: int = _from("parallel")
    data_parallel_size: int = _from("parallel")
    dp_routing: str = _from("parallel")
    # the front end's choice, not a setting of the core: defined here only
    engine_core_process: bool | None = setting(
        None, "run the engine core in its own process (default: yes for serve, no offline)"
    )
    speculative_config: dict | None = setting(
        None,
        'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
        "(keys: the fields of pagedserve.config.SpeculativeConfig)",
        type=json.loads,
    )
    # -- observability ----------------------------------------------------------------
    snapshot_interval_ms: int = _from("observability")
    step_log: str | None = _from("observability")
    # -- LoRA -------------------------------------------------------------------------
    enable_lora: bool = _from("lora")
    max_loras: int = _from("lora")
    max_lora_rank: int = _from("lora")
    max_cpu_loras: int | None = _from("lora")

    def __post_init__(self) -> None:
        if self.kv_cache_memory_bytes is not None:
            self.kv_cache_memory_bytes = parse_bytes(self.kv_cache_memory_bytes)
        if self.task is not None:
            self.runner = "generate" if self.task == "generate" else "pooling"

    # -- the two entry points ---------------------------------------------------------
    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        """`LLM(**kwargs)`: unknown names get a ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            vllm = [k for k in unknown if k in VLLM_ONLY_ARGS]
            other = [k for k in unknown if k not in VLLM_ONLY_ARGS]
            parts = []
            if vllm:
                parts.append(f"vLLM engine argument(s) not supported by pagedserve: {', '.join(vllm)}")
            if other:
                parts.append(f"unknown engine argument(s): {', '.join(other)}")
            raise ValueError("; ".join(parts) + f". Supported: {', '.join(sorted(known))}.")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
        """One flag per field, named after it; defaults and help from the field."""
        g = parser.add_argument_group("engine")
        if model_positional:  # positional arguments belong to the parser, not a group
            model = next(f for f in fields(cls) if f.name == "model")
            add_fields_to_parser(parser, [model], positional=("model",))
        add_fields_to_parser(g, [f for f in fields(cls) if not (model_positional and f.name == "model")])
        # vLLM's old spellings, kept because users type them
        g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help=argparse.SUPPRESS)
        g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false", help=argparse.SUPPRESS)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})

    # -- the configs ------------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        """Validated configs (ValueError naming the setting)."""
        kwargs: dict[str, dict] = {section: {} for section in SECTIONS}
        for f in fields(self):
            src = f.metadata.get("source")
            if src is not None:
                kwargs[src[0]][src[1]] = getattr(self, f.name)
        configs = {section: cls(**kwargs[section]) for section, cls in SECTIONS.items()}
        return EngineConfig(**configs, speculative=SpeculativeConfig.from_dict(self.speculative_config))


def signature() -> inspect.Signature:
    """`LLM.__init__`'s signature: self, then every engine argument with its default."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for i, f in enumerate(fields(EngineArgs)):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if i == 0 else inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(f.name, kind, default=f.default, annotation=f.type))
    return inspect.Signature(params)


# vLLM engine arguments that pagedserve does not implement: named in the error message.
VLLM_ONLY_ARGS = frozenset(
    ["trust_remote_code", "revision", "code_revision", "tokenizer_revision", "tokenizer_mode", "download_dir", "pipeline_parallel_size", "distributed_executor_backend", "swap_space", "cpu_offload_gb", "num_gpu_blocks_override", "max_seq_len_to_capture", "disable_custom_all_reduce", "hf_overrides", "mm_processor_kwargs", "limit_mm_per_prompt", "compilation_config", "max_logprobs", "disable_log_stats", "served_model_name", "allowed_local_media_path", "worker_cls", "override_generation_config", "model_impl"]
)
