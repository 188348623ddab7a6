"""What the front end returns for a request (vLLM-compatible field names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.messages import Logprob, PositionLogprobs
from pagedserve.sampling_params import SLO

__all__ = ["CompletionOutput", "Logprob", "PoolingOutput", "PoolingRequestOutput", "RequestMetrics", "RequestOutput"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    slo: SLO | None = None  # the request's latency targets, if any

    def slo_results(self, num_output_tokens: int) -> dict[str, bool]:
        """For each target the request has ("ttft", "tpot"): whether it was met (a finished
        request; TPOT over the tokens after the first, met trivially with one token)."""
        out: dict[str, bool] = {}
        slo = self.slo
        if slo is None or self.first_token_time is None:
            return out
        if slo.ttft_ms:
            out["ttft"] = (self.first_token_time - self.arrival_time) * 1e3 <= slo.ttft_ms
        if slo.tpot_ms:
            n = num_output_tokens - 1
            tpot = (self.last_token_time - self.first_token_time) / n * 1e3 if n > 0 else 0.0
            out["tpot"] = tpot <= slo.tpot_ms
        return out


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class PoolingOutput:
    embedding: list[float]


@dataclass
class PoolingRequestOutput:
    """An embedding request's result (vLLM's `PoolingRequestOutput`: `outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt: str | None = None
