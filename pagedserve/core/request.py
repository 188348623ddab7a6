"""A request as the scheduler sees it: tokens, progress and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from pagedserve.lora import LoRARequest
from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_GRAMMAR = 1  # structured outputs: queued, its grammar still compiling
    RUNNING = 2
    PREEMPTED = 3  # back in the waiting queue after its blocks were freed
    WAITING_FOR_KV = 4  # queued, its cached prefix being read back from the disk KV tier
    FINISHED_STOPPED = 5  # EOS, a stop token or a stop string
    FINISHED_LENGTH = 6  # max_tokens or max_model_len
    FINISHED_ABORTED = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """One sequence to generate.

    Invariants:
      * `all_token_ids == prompt_token_ids + output_token_ids`;
      * `0 <= num_computed_tokens <= num_tokens`: tokens whose K/V are in the cache;
      * when `num_computed_tokens == num_tokens` after a step, a new token was sampled.
    The next step computes tokens `all_token_ids[num_computed_tokens:]` (a decode is the
    single last sampled token; a prefill or a recompute after preemption is many).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first under the priority policy (as vLLM)
    cache_salt: str | None = None
    max_tokens: int = 16  # resolved (never None)
    eos_token_ids: frozenset[int] = frozenset()  # the model's; ignored with ignore_eos
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)

    def __post_init__(self) -> None:
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of all_token_ids
        self.stop_token_set: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + stop_token_ids
        self.in_executor = False  # the executor holds state for it (set at its first scheduling)
        # speculative decoding (core/spec_decode.py): guesses per step (0: undecided,
        # -1: never), and steps left without guesses
        self.spec_k = 0
        self.spec_pause = 0
        # structured outputs: the grammar (compiling, then a matcher); None if unconstrained
        self.structured_output_request = None
        if not self.arrival_time:
            self.arrival_time = time.time()
        # the length-aware policy's view (core/policies.py): prompt + expected output tokens,
        # its lane, and the time-to-first-token deadline (wall clock) when the request has one
        # a pooling request whose pooling reads every prompt position (mean, CLS): no
        # prefix-cache hit (its blocks still enter the cache for others)
        self.whole_prompt = False
        self.expected_work = 0
        self.is_short = False
        slo = self.sampling_params.slo
        self.ttft_deadline = self.arrival_time + slo.ttft_ms / 1e3 if slo is not None and slo.ttft_ms else None

    @property
    def lora_int_id(self) -> int:
        """The adapter's id (0: the base model); it keys the request's block hashes."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)
