"""Sampling parameters, with vLLM's names, defaults and validation."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` reports for a request."""

    CUMULATIVE = 0  # the whole output so far, every step
    DELTA = 1  # only what is new since the last report (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes (offline batches)


_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample one prompt's completions (vLLM-compatible fields).

    `temperature == 0` means greedy. Invalid values raise ValueError naming the
    field and its allowed range at construction time.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine: the model's EOS ids (never user-facing).
    _eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.temperature < 0.0:
            raise bad("temperature", "non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            raise bad("max_tokens", "an integer >= 0 (0 only with prompt_logprobs / echo)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "in (0, 2]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "an integer >= 0")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", "an integer >= 0")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass
class BeamSearchParams:
    """Beam search settings, as vLLM's `BeamSearchParams`."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}.")
