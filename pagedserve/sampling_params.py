"""Sampling parameters, with vLLM's names, defaults and validation."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from pagedserve.errors import InvalidRequestError


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` reports for a request."""

    CUMULATIVE = 0  # the whole output so far, every step
    DELTA = 1  # only what is new since the last report (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes (offline batches)


_GREEDY_EPS = 1e-5
_I32 = 2**31 - 1


def _short(value, limit: int = 64) -> str:
    """repr() of a (user-supplied) value, cut to a short prefix for error messages."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + "..."


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's `StructuredOutputsParams`): exactly one of
    `json` (a JSON schema, dict or str), `json_object` (any JSON object), `regex`, `choice`
    (one of these strings) or `grammar` (EBNF/GBNF with `root ::= ...`, or a Lark grammar).
    The engine compiles it into a token mask (`pagedserve.structured_outputs`)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON only: no whitespace between tokens (a compact, faster-to-generate form)
    disable_any_whitespace: bool = False
    # JSON schemas only: objects without "additionalProperties" admit no other keys
    disable_additional_properties: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = "none is" if not given else f"{', '.join(given)} are"
            raise InvalidRequestError(
                f"structured_outputs needs exactly one of {', '.join(self.KINDS)}; {what} given.",
                "structured_outputs",
            )
        kind = given[0]
        value = getattr(self, kind)
        ok = {
            "json": isinstance(value, (str, dict)),
            "regex": isinstance(value, str) and value != "",
            "choice": isinstance(value, (list, tuple))
            and len(value) > 0
            and all(isinstance(c, str) for c in value),
            "grammar": isinstance(value, str) and value.strip() != "",
            "json_object": value is True,
        }[kind]
        if not ok:
            rule = {
                "json": "a JSON schema (a dict or a JSON string)",
                "regex": "a non-empty string",
                "choice": "a non-empty list of strings",
                "grammar": "a non-empty grammar string",
                "json_object": "true",
            }[kind]
            raise InvalidRequestError(
                f"structured_outputs.{kind} must be {rule}, got {_short(value)}.", "structured_outputs"
            )
        if kind == "choice":
            self.choice = list(value)

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request (a pooling model: `runner="pooling"`): the prompt's hidden
    states pooled into one vector (the model's pooling: last token, mean or CLS),
    truncated to `dimensions` (Matryoshka) and L2-normalized unless `normalize` is False
    (None: the model's own setting)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise InvalidRequestError(f"dimensions must be an integer >= 1, got {_short(d)}.", "dimensions")


@dataclass(frozen=True)
class SLO:
    """A request's latency targets (`"slo": {"ttft_ms": ..., "tpot_ms": ...}` on the server,
    `SamplingParams(slo=...)` offline). The length-aware scheduler admits the requests
    with a time-to-first-token target earliest deadline first; whether each target was met
    is counted per class (`name`, default e.g. "ttft1000" / "ttft1000_tpot50") in
    /metrics (`pagedserve:slo_attained_total`, `pagedserve:slo_missed_total`)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    name: str | None = None

    @classmethod
    def parse(cls, value) -> SLO | None:
        """An SLO, a dict of its fields, or None; InvalidRequestError(param="slo") else."""
        if value is None or isinstance(value, SLO):
            slo = value
        elif isinstance(value, dict) and set(value) <= {"ttft_ms", "tpot_ms", "name"}:
            slo = cls(**value)
        else:
            raise InvalidRequestError(
                f"slo must be an object with ttft_ms, tpot_ms (milliseconds) and an optional name, got {_short(value)}.",
                "slo",
            )
        if slo is None:
            return None
        for f in ("ttft_ms", "tpot_ms"):
            v = getattr(slo, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e9):
                raise InvalidRequestError(f"slo.{f} must be a number of milliseconds > 0, got {_short(v)}.", "slo")
        if slo.ttft_ms is None and slo.tpot_ms is None:
            raise InvalidRequestError("slo needs ttft_ms or tpot_ms.", "slo")
        if slo.name is not None and (not isinstance(slo.name, str) or not 0 < len(slo.name) <= 64):
            raise InvalidRequestError("slo.name must be a string of 1 to 64 characters.", "slo")
        return slo

    @property
    def label(self) -> str:
        """The metrics class label."""
        if self.name:
            return self.name
        parts = [f"ttft{self.ttft_ms:g}" if self.ttft_ms else "", f"tpot{self.tpot_ms:g}" if self.tpot_ms else ""]
        return "_".join(p for p in parts if p)


@dataclass
class SamplingParams:
    """How to sample one prompt's completions (vLLM-compatible fields).

    `temperature == 0` means greedy. Invalid values raise InvalidRequestError (a
    ValueError) naming the field and its allowed range at construction time.
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
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # never generated (as token sequences, with and without a leading space)
    bad_words_token_ids: list[list[int]] | None = None  # set by the engine from bad_words
    slo: SLO | None = None  # latency targets (a dict is accepted): scheduling and /metrics
    pooling: PoolingParams | None = None  # an embedding request (max_tokens 0): its pooled vector

    def __post_init__(self) -> None:
        self._normalize_token_constraints()
        self.slo = SLO.parse(self.slo)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}.",
                "structured_outputs",
            )
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
        """Every numeric field bounded and finite: values reach tensor ops (int64 seeds and
        top-k, float temperatures), so out-of-range input must stop here. Errors are
        InvalidRequestError (a ValueError) naming the field in `param`."""

        def bad(name: str, rule: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name} must be {rule}, got {_short(getattr(self, name))}.", name)

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.n) or not 1 <= self.n <= _I32:
            raise bad("n", "an integer >= 1")
        if not is_num(self.temperature) or self.temperature < 0.0:
            raise bad("temperature", "a finite number >= 0")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not is_int(self.top_k) or not 0 <= self.top_k <= _I32:
            raise bad("top_k", f"0 or -1 (disabled) or an integer in [1, {_I32}]")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or not 0 <= self.max_tokens <= _I32):
            raise bad("max_tokens", "an integer >= 0 (0 only with prompt_logprobs / echo)")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= _I32:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}.", "min_tokens"
            )
        if not is_num(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not is_num(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "in (0, 2]")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= _I32):
            raise bad("logprobs", "an integer >= 0")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= _I32
        ):
            raise bad("prompt_logprobs", "an integer >= 0")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidRequestError(f"stop must be non-empty strings, got {_short(self.stop)}.", "stop")
        if any(not is_int(t) or not 0 <= t <= _I32 for t in self.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be integers in [0, {_I32}], got {_short(self.stop_token_ids)}.",
                "stop_token_ids",
            )
        # n > 1 seeds its samples seed, seed + 1, ...: all must fit a 64-bit generator seed
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed <= 2**63 - self.n):
            raise bad("seed", "a 64-bit signed integer or None")

    def _normalize_token_constraints(self) -> None:
        """logit_bias keys may be strings (OpenAI's JSON); values bounded as OpenAI's."""
        if self.logit_bias is not None:
            try:
                bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(
                    f"logit_bias must map token ids to numbers, got {_short(self.logit_bias)}.", "logit_bias"
                ) from e
            if any(not 0 <= k <= _I32 or not -100.0 <= v <= 100.0 for k, v in bias.items()):
                raise InvalidRequestError(
                    f"logit_bias must map token ids >= 0 to values in [-100, 100], got {_short(self.logit_bias)}.",
                    "logit_bias",
                )
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = list(self.allowed_token_ids)
            if not ids or any(type(t) is not int or not 0 <= t <= _I32 for t in ids):
                raise InvalidRequestError(
                    f"allowed_token_ids must be a non-empty list of token ids, got {_short(self.allowed_token_ids)}.",
                    "allowed_token_ids",
                )
            self.allowed_token_ids = ids
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
            if any(not isinstance(w, str) or not w.strip() for w in words):
                raise InvalidRequestError(
                    f"bad_words must be non-empty strings, got {_short(self.bad_words)}.", "bad_words"
                )
            self.bad_words = words or None

    @property
    def has_token_constraints(self) -> bool:
        """logit_bias, allowed_token_ids or bad words: applied to the logits per row."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids)

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
