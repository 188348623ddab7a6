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
import re
from dataclasses import dataclass, field, fields

from pagedserve.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    ModelLoadConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1024**2}
_UNITS |= {"g": 1e9, "gb": 1e9, "gib": 1024**3, "t": 1e12, "tb": 1e12, "tib": 1024**4}


def parse_bytes(text: str | int) -> int:
    """'2GiB', '512MiB', '1e9' or a plain number of bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if m is None or m.group(2) is not None and m.group(2).lower() not in _UNITS:
        try:
            return int(float(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB)") from None
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def _arg(default, help: str, choices=None, type=None, alias: str | None = None):
    return field(default=default, metadata={"help": help, "choices": choices, "type": type, "alias": alias})


@dataclass
class EngineArgs:
    # -- model ------------------------------------------------------------------------
    model: str = _arg("default", "HF directory, GGUF file, or 'default' (the embedded SmolLM2-135M-Instruct)")
    tokenizer: str | None = _arg(None, "tokenizer directory or GGUF (default: the model's)")
    skip_tokenizer_init: bool = _arg(False, "no tokenizer: prompts are token ids, outputs carry no text")
    structured_outputs_backend: str = _arg(
        "xgrammar", "grammar engine of structured outputs", ["xgrammar", "llguidance"]
    )
    dtype: str = _arg("auto", "weights/activations dtype", ["auto", "float32", "bfloat16", "float16"])
    device: str = _arg("auto", "auto | cpu | cuda[:N]")
    seed: int = _arg(0, "random seed")
    load_format: str = _arg("auto", "auto: the checkpoint; dummy: random weights", ["auto", "dummy"])
    quantization: str | None = _arg(
        None,
        "None: the checkpoint's own (GGUF types run packed); gguf_q8: packed, activations quantized "
        "to int8 blocks for integer products (as llama.cpp; not float-exact; the fastest under load); "
        "int8 | int4 weight-only; none: dequantize",
    )
    enforce_eager: bool = _arg(False, "GPU: no CUDA graphs")
    # -- KV cache ---------------------------------------------------------------------
    block_size: int = _arg(16, "tokens per KV block", [8, 16, 32, 64, 128])
    num_kv_blocks: int | None = _arg(None, "KV blocks (overrides the memory-based sizing)")
    kv_cache_memory_bytes: int | None = _arg(
        None, "KV cache size, e.g. 2GiB (CPU default 2GiB, committed as it fills)", type=parse_bytes,
        alias="--kv-cache-memory",
    )
    gpu_memory_utilization: float = _arg(0.9, "GPU: fraction of device memory for weights + activations + KV")
    enable_prefix_caching: bool = _arg(True, "share KV blocks of identical prefixes")
    kv_cache_dtype: str = _arg(
        "auto",
        "K/V storage: auto (the model's dtype) | float16 | bfloat16 | fp8 (= fp8_e4m3) | fp8_e5m2 (CPU; fp8 is lossy)",
        list(KV_CACHE_DTYPES),
    )
    # -- scheduler --------------------------------------------------------------------
    max_model_len: int | None = _arg(None, "context length (default: the model's)")
    max_num_seqs: int = _arg(256, "most requests in one step")
    max_num_batched_tokens: int | None = _arg(None, "token budget of one step (default 2048)")
    enable_chunked_prefill: bool = _arg(True, "cut long prompts into chunks under the token budget")
    long_prefill_token_threshold: int = _arg(0, "cap on one request's prefill chunk per step (0: none)")
    scheduling_policy: str = _arg("fcfs", "waiting-queue order", ["fcfs", "priority"])
    scheduler_cls: str = _arg("pagedserve.core.scheduler.Scheduler", "dotted path of the scheduler class")
    # -- processes --------------------------------------------------------------------
    tensor_parallel_size: int = _arg(1, "tensor-parallel ranks: worker processes, one model shard each")
    data_parallel_size: int = _arg(1, "engine cores (replicas, each with its own KV cache) behind one front end")
    dp_routing: str = _arg(
        "prefix", "data parallel: replica per request (longest cached prefix, else least loaded)", ["prefix", "round_robin"]
    )
    engine_core_process: bool | None = _arg(
        None, "run the engine core in its own process (default: yes for serve, no offline)"
    )
    speculative_config: dict | None = _arg(
        None,
        'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'',
        type=json.loads,
    )
    # -- observability ----------------------------------------------------------------
    snapshot_interval_ms: int = _arg(
        0, "publish an engine-state snapshot for /dashboard at most every N ms (0: off; serve: 250)"
    )

    def __post_init__(self) -> None:
        if self.kv_cache_memory_bytes is not None:
            self.kv_cache_memory_bytes = parse_bytes(self.kv_cache_memory_bytes)

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
        for f in fields(cls):
            md, flag = f.metadata, "--" + f.name.replace("_", "-")
            if f.name == "model" and model_positional:
                parser.add_argument("model", nargs="?", default=f.default, help=md["help"])
                continue
            names = [flag] + ([md["alias"]] if md.get("alias") else [])
            kw = {"dest": f.name, "default": f.default, "help": md["help"]}
            if f.type in ("bool", "bool | None"):
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = md.get("type") or _scalar_type(f.type)
                if md.get("choices"):
                    kw["choices"] = md["choices"]
            g.add_argument(*names, **kw)
        # vLLM's old spellings, kept because users type them
        g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help=argparse.SUPPRESS)
        g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false", help=argparse.SUPPRESS)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})

    # -- the configs ------------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        """Validated configs (ValueError naming the setting)."""
        return EngineConfig(
            model=ModelLoadConfig(
                model=self.model,
                tokenizer=self.tokenizer,
                skip_tokenizer_init=self.skip_tokenizer_init,
                dtype=self.dtype,
                device=self.device,
                seed=self.seed,
                load_format=self.load_format,
                enforce_eager=self.enforce_eager,
                quantization=self.quantization,
                structured_outputs_backend=self.structured_outputs_backend,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
                scheduler_cls=self.scheduler_cls,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                data_parallel_size=self.data_parallel_size,
                dp_routing=self.dp_routing,
            ),
            speculative=SpeculativeConfig.from_dict(self.speculative_config),
            observability=ObservabilityConfig(snapshot_interval_ms=self.snapshot_interval_ms),
        )


def _scalar_type(annotation: str):
    base = annotation.replace(" | None", "")
    return {"int": int, "float": float, "str": str}[base]


def signature() -> inspect.Signature:
    """`LLM.__init__`'s signature: self, then every engine argument with its default."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for i, f in enumerate(fields(EngineArgs)):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if i == 0 else inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(f.name, kind, default=f.default, annotation=f.type))
    return inspect.Signature(params)


# vLLM engine arguments that pagedserve does not implement: named in the error message.
VLLM_ONLY_ARGS = frozenset(
    ["trust_remote_code", "revision", "code_revision", "tokenizer_revision", "tokenizer_mode", "download_dir", "pipeline_parallel_size", "distributed_executor_backend", "swap_space", "cpu_offload_gb", "num_gpu_blocks_override", "max_seq_len_to_capture", "disable_custom_all_reduce", "hf_overrides", "mm_processor_kwargs", "limit_mm_per_prompt", "speculative_config", "compilation_config", "max_logprobs", "disable_log_stats", "served_model_name", "allowed_local_media_path", "enable_lora", "max_loras", "max_lora_rank", "worker_cls", "override_generation_config", "model_impl"]
)
