"""Engine configuration, split by the layer that owns each setting."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerConfig:
    """Continuous-batching limits.

    max_num_batched_tokens: token budget of one step (decodes + prefill chunks).
    max_num_seqs: most requests in one step.
    long_prefill_token_threshold: cap on one request's prefill chunk per step (0: none).
    policy: "fcfs" or "priority" (lower `priority` first, then arrival).
    scheduler_cls: dotted path of the Scheduler class (the benchmarks' static-batching
    baseline is `pagedserve.bench.static_scheduler.StaticScheduler`).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 2048, or max_model_len without chunking
    max_model_len: int | None = None  # None: the model's limit (resolved by the engine)
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    scheduler_cls: str = "pagedserve.core.scheduler.Scheduler"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}.")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}."
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}.")

    def resolved(self, model_max_len: int | None = None) -> SchedulerConfig:
        """A copy with max_model_len and max_num_batched_tokens filled in and checked."""
        from dataclasses import replace

        max_len = self.max_model_len or model_max_len
        if max_len is None:
            raise ValueError("max_model_len is not set.")
        if model_max_len is not None and max_len > model_max_len:
            raise ValueError(f"max_model_len={max_len} exceeds the model's limit of {model_max_len} tokens.")
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, max_len)
        if not self.enable_chunked_prefill and budget < max_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({budget}) must be >= max_model_len "
                f"({max_len}), or long prompts could never be scheduled."
            )
        return replace(self, max_model_len=max_len, max_num_batched_tokens=budget)


# vLLM's names; "fp8" is "fp8_e4m3" (float8 e4m3fn), as in vLLM
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass
class CacheConfig:
    """Paged KV cache: `num_kv_blocks` if given, else sized from `kv_cache_memory_bytes`."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9  # GPU: fraction of device memory for weights + activations + KV
    # "auto": the model's dtype; "float16" / "bfloat16" (CPU): K/V stored in 16 bits, half the
    # bytes a float32 model's attention reads (llama.cpp's default is float16); "fp8" /
    # "fp8_e4m3" / "fp8_e5m2" (CPU): 8 bits, unscaled (vLLM's default k/v scale of 1.0), lossy
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}."
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}.")


@dataclass
class ModelLoadConfig:
    """Where the model comes from and how it runs."""

    model: str = "default"
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False  # token-id prompts only; outputs carry no text
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    load_format: str = "auto"  # auto (the checkpoint) | dummy (random weights, for benchmarks)
    enforce_eager: bool = False  # GPU: no CUDA graphs
    # None: the checkpoint's own (GGUF types run packed; safetensors dequantized/float);
    # "int8" / "int4": weight-only quantization at load; "none": dequantize everything.
    quantization: str | None = None
    structured_outputs_backend: str = "xgrammar"  # xgrammar | llguidance


@dataclass
class ParallelConfig:
    """data_parallel_size: engine cores (replicas, each with its own KV cache) behind one
    front end; dp_routing: how the front end picks a replica per request ("prefix": the
    one holding the longest cached prefix, else the least loaded; "round_robin")."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    dp_routing: str = "prefix"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}.")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}.")
        if self.dp_routing not in ("prefix", "round_robin"):
            raise ValueError(f"dp_routing must be 'prefix' or 'round_robin', got {self.dp_routing!r}.")


@dataclass
class ObservabilityConfig:
    """The live view (`/dashboard`): the engine core publishes a snapshot of its state
    (KV page map, queues, recent steps) at most every `snapshot_interval_ms` (0: never)."""

    snapshot_interval_ms: int = 0

    def __post_init__(self) -> None:
        if self.snapshot_interval_ms < 0:
            raise ValueError(f"snapshot_interval_ms must be >= 0, got {self.snapshot_interval_ms}.")


@dataclass
class SpeculativeConfig:
    """Speculative decoding, vLLM's names. method "ngram": prompt lookup of
    `num_speculative_tokens` guesses by matching the last `prompt_lookup_min..max` tokens.
    method "draft_model": `model` (a local directory, GGUF file or "default"), a smaller
    model with the target's vocabulary, guesses greedily. Drafts are verified in one forward
    pass; greedy outputs are unchanged, sampled ones keep their distribution.
    `max_batch_size`: no speculation in steps with more running requests (verification
    costs real compute on a full batch)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    max_batch_size: int = 4
    model: str | None = None  # the draft model (method "draft_model")
    quantization: str | None = None  # the draft's weights: as for the target ("int8", "int4", ...)

    METHODS = ("ngram", "draft_model")

    def __post_init__(self) -> None:
        if self.method not in self.METHODS:
            raise ValueError(f"speculative_config method must be one of {self.METHODS}, got {self.method!r}.")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config: 'model' (the draft model's path) is required with method "
                "'draft_model' and only there."
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}."
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max.")
        if self.max_batch_size < 1:
            raise ValueError(f"speculative max_batch_size must be >= 1, got {self.max_batch_size}.")

    @classmethod
    def from_dict(cls, d: dict | None) -> SpeculativeConfig | None:
        if d is None:
            return None
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "max_batch_size", "model", "quantization"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {sorted(unknown)}; supported: {sorted(known)}.")
        if "model" in d and "method" not in d:  # vLLM infers the method from a draft model
            d = {**d, "method": "draft_model"}
        return cls(**d)


@dataclass
class EngineConfig:
    """Every setting of one engine. `pagedserve.engine_args.EngineArgs` builds it; after
    the engine core started, `scheduler.max_model_len` and `max_num_batched_tokens` are
    resolved (never None)."""

    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    def __post_init__(self) -> None:
        s = self.speculative
        if s is not None and s.method == "draft_model" and self.parallel.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config: method 'draft_model' runs with tensor_parallel_size=1 only "
                "in this version ('ngram' works with any)."
            )
