"""Plain messages passed between the layers:
front end -> engine core (`EngineCoreRequest`), scheduler -> executor (`SchedulerOutput`),
executor -> scheduler (`ModelRunnerOutput`), engine core -> front end (`EngineCoreOutput`).

A neutral module: it imports nothing from the layers, and they all import it. Messages
carry only data (no behaviour), so the engine core and the executor can live in another
thread or process: everything here pickles.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

from pagedserve.lora import LoRARequest
from pagedserve.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """One sequence for the engine core to run (a request with n > 1 arrives as n of
    these, "<id>#<i>"). Validated and tokenized by the front end's input processor."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter to run it with (None: the base model)


DRAFT_PLACEHOLDER = -1  # a guess the executor's draft model fills in


@dataclass(slots=True, kw_only=True)
class CachedRequestData:
    """A running request's share of a step, for an executor that already holds its state.

    The executor computes `token_ids` at positions `num_computed_tokens ...
    num_computed_tokens + len(token_ids) - 1`, writing their K/V into the request's
    blocks (`block_ids`: only those appended this step), and samples one next token if
    `sample`.
    """

    is_new: ClassVar[bool] = False
    req_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    # Speculative decoding: the last len(draft_token_ids) of token_ids are guesses to
    # verify; the executor returns the accepted ones plus one more in spec_token_ids.
    # DRAFT_PLACEHOLDER guesses (method "draft_model"): the executor's draft model makes
    # them up in the step itself; their K/V slots are allocated like any others.
    draft_token_ids: list[int] | None = None


@dataclass(slots=True, kw_only=True)
class NewRequestData:
    """A request's first share of a step (first scheduling, or resumption after
    preemption): as CachedRequestData, with the whole block table in `block_ids` and
    what the executor (re)creates its per-request state from."""

    is_new: ClassVar[bool] = True
    req_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    draft_token_ids: None = None  # never speculative on its first step
    lora_request: LoRARequest | None = None


# One request's share of a step, either kind (`is_new` tells which).
ScheduledRequest = NewRequestData | CachedRequestData


@dataclass
class SchedulerOutput:
    """One step's work. `scheduled`: every request's share, new and cached, in scheduling
    order (the executor orders them for the model itself)."""

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    # Requests the executor must forget: finished or aborted since the last step.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted since the last step: their blocks are gone; they come back later
    # as is_new (the executor may keep what survives preemption, e.g. a seeded generator).
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: the legal next tokens of the constrained requests that sample
    # this step, one int32 bitmask row each (numpy [k, ceil(V / 32)], bit t % 32 of word
    # t // 32 = token t), and request id -> row. None when no sampled request is constrained.
    structured_output_request_ids: dict[str, int] | None = None
    grammar_bitmask: object | None = None


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# Per position: {token_id: Logprob}, with the sampled (or prompt) token always present.
PositionLogprobs = dict[int, Logprob]


@dataclass
class ModelRunnerOutput:
    """What one executed step produced, for the requests that sampled."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    # For chunks of prompts whose requests asked for prompt logprobs: one entry per prompt
    # position covered by the chunk (position 0 has none and is never included).
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # Requests that verified drafts: the accepted drafts followed by one sampled token.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Pooling requests whose prompt ended this step: the pooled (normalized) vector.
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass(slots=True)
class EngineCoreOutput:
    """What changed for one request in one step (scheduler -> front end)."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    new_prompt_logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    pooled: list[float] | None = None  # a pooling request's vector (it finishes with it)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class CoreRequestType(enum.IntEnum):
    """Front end -> engine core commands; each travels as `(type, payload)`."""

    ADD = 0  # payload: list[EngineCoreRequest]
    ABORT = 1  # payload: list of request ids
    FINISH_STOPPED = 2  # payload: list of request ids (a stop string was found)
    RESET_PREFIX_CACHE = 3  # payload: None
    SHUTDOWN = 4  # payload: None
    REMOVE_LORA = 5  # payload: a lora_int_id (unloaded once no request uses it)


@dataclass
class EngineCoreOutputs:
    """Engine core -> front end, once per step (and after commands while idle)."""

    outputs: list[EngineCoreOutput]
    stats: object = None  # EngineStats snapshot taken after the step
    # request id -> message, for requests the core refused (they are not running)
    errors: dict[str, str] = field(default_factory=dict)
    # the core loop's time split so far: seconds stepping, handling input, idle
    step_seconds: float = 0.0
    input_seconds: float = 0.0
    idle_seconds: float = 0.0
    fatal: str | None = None  # the core stopped on this error (an executor fault); nothing follows
    engine_index: int = 0  # data parallelism: the replica that sent this (engine/dp_client.py)
    # engine-state snapshot for the live view (core/snapshot.py), at most every
    # snapshot_interval_ms; None in most messages
    snapshot: dict | None = None
    # request id -> message, for requests the core failed on an internal error while
    # admitting them (a bug, not the client's fault: a 500); they are not running
    failed: dict[str, str] = field(default_factory=dict)

@dataclass
class EngineStats:
    """Engine statistics after a step (engine core -> front end, in EngineCoreOutputs):
    read by LLM.get_stats(), the CLI demo and the server's /metrics."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_cache_usage: float  # used / total blocks
    kv_utilization: float  # stored tokens / allocated token slots
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_steps: int
    computed_tokens: int  # tokens run through the model: prefill chunks, recomputes, decodes
    last_batch_size: int
    last_num_scheduled_tokens: int
    block_size: int
    # speculative decoding (vLLM's meanings): verification steps of one request, guessed
    # tokens, accepted guesses, and accepted guesses by position in the draft
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    # the idle-time KV accounting audit (core/kv_audit.py): failures so far, the last one's text
    kv_audit_failures: int = 0
    kv_audit_error: str | None = None
    # the disk KV tier (core/kv_offload.py): blocks served from it (read back, verified),
    # full prompt blocks found in neither tier, blocks that could not be served (bad
    # checksum, gone, I/O error), blocks written and saves dropped (write queue full),
    # bytes and seconds of I/O, what the store holds, I/O errors (the first disables it)
    kv_offload_enabled: int = 0  # 1: on (summed over data-parallel replicas: those with it on)
    kv_offload_hit_blocks: int = 0
    kv_offload_miss_blocks: int = 0
    kv_offload_failed_blocks: int = 0
    kv_offload_corrupt_blocks: int = 0
    kv_offload_saved_blocks: int = 0
    kv_offload_dropped_saves: int = 0
    kv_offload_bytes_written: int = 0
    kv_offload_bytes_read: int = 0
    kv_offload_write_seconds: float = 0.0
    kv_offload_read_seconds: float = 0.0
    kv_offload_stored_blocks: int = 0
    kv_offload_stored_bytes: int = 0
    kv_offload_errors: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens per verification step (accepted guesses + the one sampled), as vLLM."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
