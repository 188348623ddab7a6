"""Engine configuration, split by the layer that owns each setting.

Every setting is written once, here: its default, its choices, its check and its help
text (`setting(...)`). `pagedserve.engine_args.EngineArgs` derives the command line and
`LLM(**kwargs)` from these fields; `check_choices` refuses a value outside a field's
choices with a ValueError naming it.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace


def setting(default, help: str, *, choices=None, type=None, alias: str | None = None, factory=None, nargs=None):
    """A config field with its user-facing description. `choices`: the accepted values
    (checked by `check_choices`); `type`: how the command line parses it (default: the
    annotation); `alias`: a second flag spelling; `nargs`: argparse's (a list flag)."""
    md = {"help": help, "choices": tuple(choices) if choices is not None else None, "type": type, "alias": alias}
    if nargs is not None:
        md["nargs"] = nargs
    if factory is not None:
        return field(default_factory=factory, metadata=md)
    return field(default=default, metadata=md)


def check_choices(cfg) -> None:
    """ValueError for any field of the dataclass `cfg` whose value is not among its choices."""
    for f in fields(cfg):
        choices = f.metadata.get("choices")
        value = getattr(cfg, f.name)
        if choices is not None and value not in choices:
            shown = ", ".join("None" if c is None else str(c) for c in choices)
            raise ValueError(f"{f.name} must be one of {shown}, got {value!r}.")


def default_of(f):
    """A dataclass field's default value (its factory's product for mutable defaults)."""
    return f.default_factory() if f.default is MISSING else f.default


def add_fields_to_parser(group, fields_, positional: tuple[str, ...] = ()) -> None:
    """One command-line flag per `setting` field, named after it (`max_num_seqs` ->
    `--max-num-seqs`; booleans as `--x/--no-x`; a `positional` name as an optional
    positional argument); default, choices, type and help from the field."""
    import argparse

    for f in fields_:
        md = f.metadata
        if f.name in positional:
            group.add_argument(f.name, nargs="?", default=default_of(f), help=md["help"])
            continue
        names = ["--" + f.name.replace("_", "-")] + ([md["alias"]] if md.get("alias") else [])
        kw = {"dest": f.name, "default": default_of(f), "help": md["help"]}
        if f.type in ("bool", "bool | None"):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            if md.get("nargs"):
                kw["nargs"] = md["nargs"]
            kw["type"] = md.get("type") or {"int": int, "float": float, "str": str}[f.type.replace(" | None", "")]
            if md.get("choices"):
                kw["choices"] = [c for c in md["choices"] if c is not None]
        group.add_argument(*names, **kw)


SCHEDULING_POLICIES = ("fcfs", "priority", "length_aware")


@dataclass
class SchedulerConfig:
    """Continuous-batching limits.

    max_num_batched_tokens: token budget of one step (decodes + prefill chunks).
    max_num_seqs: most requests in one step.
    long_prefill_token_threshold: cap on one request's prefill chunk per step (0: none).
    scheduling_policy: "fcfs" or "priority" (lower `priority` first, then arrival).
    scheduler_cls: dotted path of the Scheduler class (the benchmarks' static-batching
    baseline is `pagedserve.bench.static_scheduler.StaticScheduler`).
    """

    max_num_seqs: int = setting(256, "most requests in one step")
    max_num_batched_tokens: int | None = setting(
        None, "token budget of one step (default 2048, or max_model_len without chunked prefill)"
    )
    max_model_len: int | None = setting(None, "context length (default: the model's)")
    enable_chunked_prefill: bool = setting(True, "cut long prompts into chunks under the token budget")
    long_prefill_token_threshold: int = setting(0, "cap on one request's prefill chunk per step (0: none)")
    scheduling_policy: str = setting(
        "fcfs",
        "waiting-queue order: fcfs | priority (lower first) | length_aware (least expected work first, "
        "time-to-first-token deadlines first, a lane for short requests, aging)",
        choices=SCHEDULING_POLICIES,
    )
    short_request_tokens: int = setting(
        512, "length_aware: requests expected to need fewer tokens (prompt + output) than this are short"
    )
    short_budget_share: float = setting(
        0.5,
        "length_aware: share of a step's token budget (and of the running seats) kept for short requests "
        "while any runs or waits; long prefills are chunked around it",
    )
    long_lane_chunk_tokens: int = setting(
        384,
        "length_aware: while short work runs or waits, long requests compute at most this many prompt "
        "tokens per step, all together (it bounds the step a short request waits behind; 0: the budget "
        "share alone)",
    )
    long_solo_chunk_tokens: int = setting(
        512,
        "length_aware: with no short work waiting or running, long requests compute at most this many "
        "prompt tokens per step, all together, so a short request arriving then waits behind one such "
        "step, not a whole budget's; beside short work the cap is never above it either (0: the whole "
        "budget; no effect with short_budget_share 0)",
    )
    long_lane_step_ms: float = setting(
        500.0,
        "length_aware: a step that carries long prompt chunks is kept to about this long: the long lane's "
        "tokens per step come from a step-time model fitted online on this engine's own steps, so one "
        "setting holds on a fast CPU and a slow one (never above the token allowances, at least 64 tokens "
        "a step; 0: the token allowances alone)",
    )
    long_lane_period: int = setting(
        20,
        "length_aware: while short work runs or waits, long prefill chunks run in at most one step of this "
        "many (the others decode without them), and not in a step that admits a short request unless twice "
        "this many have passed (0: every step)",
    )
    max_wait_s: float = setting(
        20.0,
        "length_aware: a request waiting this long is admitted before every request that came after it, "
        "and its prompt's chunks no longer sit out steps for short work",
    )
    expected_output_tokens: int = setting(
        128,
        "length_aware: output length assumed for a request without max_tokens until finished requests "
        "of similar prompt length have been seen (then it is learned)",
    )
    scheduler_cls: str = setting("pagedserve.core.scheduler.Scheduler", "dotted path of the scheduler class")

    def __post_init__(self) -> None:
        check_choices(self)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}.")
        if self.short_request_tokens < 1 or self.expected_output_tokens < 1:
            raise ValueError("short_request_tokens and expected_output_tokens must be >= 1.")
        if not 0.0 <= self.short_budget_share < 1.0:
            raise ValueError(f"short_budget_share must be in [0, 1), got {self.short_budget_share}.")
        if self.long_lane_period < 0:
            raise ValueError(f"long_lane_period must be >= 0, got {self.long_lane_period}.")
        if self.long_lane_chunk_tokens < 0 or self.long_solo_chunk_tokens < 0:
            raise ValueError(
                "long_lane_chunk_tokens and long_solo_chunk_tokens must be >= 0, "
                f"got {self.long_lane_chunk_tokens} and {self.long_solo_chunk_tokens}."
            )
        if self.long_lane_step_ms < 0:
            raise ValueError(f"long_lane_step_ms must be >= 0, got {self.long_lane_step_ms}.")
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {self.max_wait_s}.")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}."
            )

    def resolved(self, model_max_len: int | None = None) -> SchedulerConfig:
        """A copy with max_model_len and max_num_batched_tokens filled in and checked."""
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
BLOCK_SIZES = (8, 16, 32, 64, 128)


def parse_bytes(text) -> int:
    """'2GiB', '512MiB', '1e9' or a plain number of bytes (ValueError otherwise)."""
    import re

    if isinstance(text, int):
        return text
    units = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1024**2}
    units |= {"g": 1e9, "gb": 1e9, "gib": 1024**3, "t": 1e12, "tb": 1e12, "tib": 1024**4}
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", str(text), re.I)
    if m is not None and (m.group(2) or "").lower() in units:
        return int(float(m.group(1)) * units[(m.group(2) or "").lower()])
    try:
        return int(float(text))
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 2GiB, 512MiB)") from None


@dataclass
class CacheConfig:
    """Paged KV cache: `num_kv_blocks` if given, else sized from `kv_cache_memory_bytes`."""

    block_size: int = setting(16, "tokens per KV block", choices=BLOCK_SIZES)
    num_kv_blocks: int | None = setting(None, "KV blocks (overrides the memory-based sizing)")
    kv_cache_memory_bytes: int | None = setting(
        None, "KV cache size, e.g. 2GiB (CPU default 2GiB: committed at start by serve, as blocks fill offline)", type=parse_bytes,
        alias="--kv-cache-memory",
    )
    # CPU: the KV tensors are anonymous memory; prefault commits them at start, as vLLM's and
    # llama.cpp's CPU backends do, else page by page as blocks first fill (a small RSS for a
    # small load) (kv_cache.lazy_zeros). None: committed for a server (`serve`, AsyncLLM.from_engine_args: an
    # embedding server's first pass through a lazy 2 GiB cache ran ~20% slower, BENCHMARKS
    # section 38), lazy offline (`LLM`, where start-up and RSS for a small job matter more)
    kv_cache_prefault: bool | None = setting(
        None,
        "CPU: commit the KV cache's memory at start instead of page by page as blocks first fill "
        "(start-up time and the whole cache's RSS at once; no page faults in the first pass through the cache); "
        "default: yes for serve, no offline",
    )
    enable_prefix_caching: bool = setting(True, "share KV blocks of identical prefixes")
    gpu_memory_utilization: float = setting(0.9, "GPU: fraction of device memory for weights + activations + KV")
    # "auto": the model's dtype; "float16" / "bfloat16" (CPU): K/V stored in 16 bits, half the
    # bytes a float32 model's attention reads (llama.cpp's default is float16); "fp8" /
    # "fp8_e4m3" / "fp8_e5m2" (CPU): 8 bits, unscaled (vLLM's default k/v scale of 1.0), lossy
    kv_cache_dtype: str = setting(
        "auto",
        "K/V storage: auto (the model's dtype) | float16 | bfloat16 | fp8 (= fp8_e4m3) | fp8_e5m2 (CPU; fp8 is lossy)",
        choices=KV_CACHE_DTYPES,
    )

    # the second KV tier (core/kv_offload.py, executor/kv_offload_store.py): evicted cached
    # blocks go to files under this directory, keyed by their chained hash in a namespace
    # fingerprinted by the model and the KV settings; prefix misses read them back
    kv_offload_dir: str | None = setting(
        None, "directory of the disk KV tier: evicted prefix-cache blocks are kept there and survive restarts (off: none)"
    )
    kv_offload_bytes: int = setting(
        16 << 30, "disk KV tier size bound, e.g. 20GiB (least recently used blocks are deleted)", type=parse_bytes
    )

    def __post_init__(self) -> None:
        if self.kv_cache_memory_bytes is not None:
            self.kv_cache_memory_bytes = parse_bytes(self.kv_cache_memory_bytes)
        self.kv_offload_bytes = parse_bytes(self.kv_offload_bytes)
        if self.kv_offload_bytes < 1:
            raise ValueError(f"kv_offload_bytes must be >= 1, got {self.kv_offload_bytes}.")
        check_choices(self)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}.")


DTYPES = ("auto", "float32", "bfloat16", "float16")
RUNNERS = ("generate", "pooling")
# None: the checkpoint's own (GGUF types run packed; safetensors float); "none": dequantize
QUANTIZATION_METHODS = (None, "none", "gguf", "gguf_q8", "int8", "int4")
STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar", "llguidance")
DP_ROUTINGS = ("prefix", "round_robin", "length")
WEIGHT_COPY_POLICIES = ("auto", "all", "none")


@dataclass
class ModelLoadConfig:
    """Where the model comes from and how it runs."""

    model: str = setting("default", "HF directory, GGUF file, or 'default' (the embedded SmolLM2-135M-Instruct)")
    tokenizer: str | None = setting(None, "tokenizer directory or GGUF (default: the model's)")
    skip_tokenizer_init: bool = setting(False, "no tokenizer: prompts are token ids, outputs carry no text")
    structured_outputs_backend: str = setting(
        "xgrammar", "grammar engine of structured outputs", choices=STRUCTURED_OUTPUTS_BACKENDS
    )
    dtype: str = setting("auto", "weights/activations dtype", choices=DTYPES)
    device: str = setting("auto", "auto | cpu | cuda[:N]")
    seed: int = setting(0, "random seed")
    load_format: str = setting("auto", "auto: the checkpoint; dummy: random weights", choices=("auto", "dummy"))
    quantization: str | None = setting(
        None,
        "None: the checkpoint's own (GGUF types run packed); gguf_q8: packed, activations quantized "
        "to int8 blocks for integer products (as llama.cpp; not float-exact; the fastest under load); "
        "int8 | int4 weight-only; none: dequantize",
        choices=QUANTIZATION_METHODS,
    )
    # CPU, packed weights: executor/quant/copy_budget.py
    weight_copies: str = setting(
        "auto",
        "CPU, packed (GGUF) weights: faster layouts kept beside the packed blocks (row-interleaved for "
        "batch-1 decode; in a bf16 engine, bf16 for prefill and batched decode at 2 bytes a weight): "
        "auto (as many as fit in free memory after the KV cache) | all | none",
        choices=WEIGHT_COPY_POLICIES,
    )
    enforce_eager: bool = setting(False, "no CUDA graphs (GPU); no kernel warm-up at start (CPU)")
    runner: str = setting(
        "generate",
        "generate (text) | pooling (embeddings: LLM.embed / .score, /v1/embeddings, /score, /rerank)",
        choices=RUNNERS,
    )
    pooling_type: str | None = setting(
        None, "pooling runner: last | mean | cls (default: the model's sentence-transformers config, else last)",
        choices=(None, "last", "mean", "cls"),
    )
    pooling_normalize: bool | None = setting(None, "pooling runner: L2-normalize embeddings (default: the model's, else yes)")

    def __post_init__(self) -> None:
        if isinstance(self.quantization, str):
            self.quantization = self.quantization.lower()
        check_choices(self)


@dataclass
class ParallelConfig:
    """data_parallel_size: engine cores (replicas, each with its own KV cache) behind one
    front end; dp_routing: how the front end picks a replica per request ("prefix": the
    one holding the longest cached prefix, else the least loaded; "round_robin")."""

    tensor_parallel_size: int = setting(1, "tensor-parallel ranks: worker processes, one model shard each")
    data_parallel_size: int = setting(1, "engine cores (replicas, each with its own KV cache) behind one front end")
    dp_routing: str = setting(
        "prefix",
        "data parallel: replica per request: prefix (longest cached prefix, else least loaded) | "
        "round_robin | length (short and long requests on different replicas, prefix hits first)",
        choices=DP_ROUTINGS,
    )

    def __post_init__(self) -> None:
        check_choices(self)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}.")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}.")


@dataclass
class LoRAConfig:
    """LoRA adapters over the base model, per request (vLLM's names): at most `max_loras`
    adapters resident (in one step), ranks up to `max_lora_rank`, `max_cpu_loras` read
    adapters kept in memory (default: max_loras)."""

    enable_lora: bool = setting(False, "serve LoRA adapters (PEFT directories), chosen per request")
    max_loras: int = setting(1, "LoRA: adapters resident at once (the most in one step)")
    max_lora_rank: int = setting(16, "LoRA: the largest adapter rank accepted (slots are this wide)")
    max_cpu_loras: int | None = setting(None, "LoRA: adapters kept read in memory (default: max_loras)")

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}.")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass
class ObservabilityConfig:
    """What the engine shows of itself. The live view (`/dashboard`): the engine core
    publishes a snapshot of its state (KV page map, queues, recent steps) at most every
    `snapshot_interval_ms` (0: never). The step log: one line per step to `step_log`."""

    snapshot_interval_ms: int = setting(
        0, "publish an engine-state snapshot for /dashboard at most every N ms (0: off; serve: 250)"
    )

    step_log: str | None = setting(
        None,
        "append one JSON line per engine step to this file (its seconds, and each scheduled request's "
        "lane, tokens and cached tokens): the input of `python -m pagedserve.bench.mixed_sim fit`",
    )

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
        known = {f.name for f in fields(cls)}
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
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.lora.enable_lora and self.parallel.tensor_parallel_size > 1:
            raise ValueError("enable_lora runs with tensor_parallel_size=1 only in this version.")
        s = self.speculative
        if s is not None and s.method == "draft_model" and self.parallel.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config: method 'draft_model' runs with tensor_parallel_size=1 only "
                "in this version ('ngram' works with any)."
            )
