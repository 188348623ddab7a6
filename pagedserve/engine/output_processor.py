"""Turns the scheduler's per-step token deltas into RequestOutputs: detokenization, stop
strings, logprob text, n>1 fan-in, timing metrics.

Fault isolation: an exception while processing one request's outputs (a detokenizer or
logprob-formatting bug, a tokenizer that chokes on an id) fails that request only. It is
removed here and reported in `ProcessedOutputs.failed` with the child ids the core must
abort (which frees its KV blocks); every other request of the step is processed as usual.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pagedserve.engine.detokenizer import IncrementalDetokenizer, raw_decoder
from pagedserve.engine.input_processor import ProcessedRequest
from pagedserve.messages import EngineCoreOutput, PositionLogprobs
from pagedserve.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class SeqState:
    """One generated sequence (one of a request's n)."""

    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None  # None: decode once at the end (no stops, final-only)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    sent_tokens: int = 0  # for DELTA outputs
    sent_logprobs: int = 0
    sent_finish: bool = False
    pooled: list[float] | None = None  # a pooling request's vector


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SeqState]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    num_finished: int = 0
    child_ids: list[str] = field(default_factory=list)  # the scheduler's request ids, one per seq

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.seqs)


@dataclass
class ProcessedOutputs:
    """One step's results for the front end."""

    outputs: list[RequestOutput]  # to hand to the requests' owners
    stopped: list[str]  # child ids that hit a stop string: the core must end them
    # request id -> why its processing failed (the request is already removed here), and
    # the child ids of those requests: the core must abort them
    failed: dict[str, Exception] = field(default_factory=dict)
    abort: list[str] = field(default_factory=list)
    # the failed requests' final outputs (finish_reason "error", extra["error"]), for the
    # offline engine, whose callers wait for every request's final output
    failed_outputs: list[RequestOutput] = field(default_factory=list)


class OutputProcessor:
    """Front-end state of every live request. With `tokenizer=None` (skip_tokenizer_init)
    outputs carry token ids and no text, and stop strings are refused."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decode = raw_decoder(tokenizer) if tokenizer is not None else None  # tokenizer.decode's text
        self.parents: dict[str, ParentState] = {}
        self.child_to_seq: dict[str, tuple[ParentState, SeqState]] = {}

    def add_request(self, req: ProcessedRequest) -> None:
        params = req.params
        if req.request_id in self.parents:
            raise ValueError(f"request_id {req.request_id!r} is already in use.")
        final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
        seqs = []
        for i, child in enumerate(req.children):
            detok = None
            if self.tokenizer is not None and (params.stop or not final_only):
                detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params)
            seqs.append(SeqState(i, child.sampling_params, detok))
        parent = ParentState(
            req.request_id, req.prompt, req.prompt_token_ids, params, seqs, RequestMetrics(req.arrival_time, slo=params.slo)
        )
        self.parents[parent.request_id] = parent
        parent.child_ids = [c.request_id for c in req.children]
        for cid, seq in zip(parent.child_ids, parent.seqs):
            self.child_to_seq[cid] = (parent, seq)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def child_ids_of(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.child_ids) if parent is not None else []

    def remove(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for cid in parent.child_ids:
                self.child_to_seq.pop(cid, None)

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """One step's core outputs -> RequestOutputs, stop-string ends, and the requests
        whose processing raised (each fails alone: see the module docstring)."""
        now = time.time()
        touched: dict[str, ParentState] = {}
        result = ProcessedOutputs([], [])
        for co in core_outputs:
            entry = self.child_to_seq.get(co.req_id)
            if entry is None:
                continue
            parent, seq = entry
            touched[parent.request_id] = parent
            try:
                self._apply(parent, seq, co, now, result.stopped)
            except Exception as e:  # noqa: BLE001 (this request fails, the step goes on)
                self._fail(parent, e, result)
        for parent in touched.values():
            if parent.request_id in result.failed:
                continue
            try:
                out = self._make_output(parent)
            except Exception as e:  # noqa: BLE001
                self._fail(parent, e, result)
                continue
            if out is not None:
                result.outputs.append(out)
            if parent.finished:
                self.remove(parent.request_id)
        return result

    def _fail(self, parent: ParentState, e: Exception, result: ProcessedOutputs) -> None:
        rid = parent.request_id
        if rid in result.failed:
            return
        logger.exception("processing the outputs of request %s failed; it is aborted", rid)
        result.failed[rid] = e
        # every child: one that just hit a stop string still runs in the core (finished ids are ignored)
        result.abort.extend(parent.child_ids)
        result.stopped[:] = [c for c in result.stopped if c not in parent.child_ids]
        self.remove(rid)
        parent.metrics.finished_time = time.time()
        comps = [
            CompletionOutput(seq.index, "", list(seq.token_ids), None, None, "error") for seq in parent.seqs
        ]
        result.failed_outputs.append(
            RequestOutput(
                rid,
                parent.prompt,
                parent.prompt_token_ids,
                comps,
                True,
                metrics=parent.metrics,
                extra={"error": f"{type(e).__name__}: {e}"},
            )
        )

    def _apply(
        self, parent: ParentState, seq: SeqState, co: EngineCoreOutput, now: float, stopped: list[str]
    ) -> None:
        """One core output of one sequence: tokens, text, stop strings, logprobs, finish."""
        m = parent.metrics
        if co.new_prompt_logprobs and parent.prompt_logprobs is not None and seq.index == 0:
            parent.prompt_logprobs.extend(self._decorate(co.new_prompt_logprobs))
        if co.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            parent.num_cached_tokens = co.num_cached_tokens
            new = co.new_token_ids
            stop = None
            if seq.detok is not None:
                taken, stop = seq.detok.add_tokens_until_stop(new)
                if taken < len(new):  # a stop string ended it mid-step
                    new = new[:taken]
            seq.token_ids.extend(new)
            if co.new_logprobs is not None:
                self._add_logprobs(seq, co.new_logprobs)
            if stop is not None:
                co.finish_reason, co.stop_reason = "stop", stop
                if seq.finish_reason is None:
                    stopped.append(co.req_id)
        if co.pooled is not None:
            seq.pooled = co.pooled
            parent.num_cached_tokens = co.num_cached_tokens
        if co.finish_reason is not None and seq.finish_reason is None:
            seq.finish_reason, seq.stop_reason = co.finish_reason, co.stop_reason
            parent.num_finished += 1
            if seq.detok is not None and not isinstance(co.stop_reason, str):
                seq.detok.flush()  # a stop string already trimmed the text
            if parent.finished:
                m.finished_time = now

    def _add_logprobs(self, seq: SeqState, new: list[PositionLogprobs]) -> None:
        if seq.logprobs is None:
            seq.logprobs, seq.cumulative_logprob = [], 0.0
        tok_iter = seq.token_ids[len(seq.token_ids) - len(new) :]
        for lp, tok in zip(self._decorate(new), tok_iter):
            seq.logprobs.append(lp)
            seq.cumulative_logprob += lp[tok].logprob

    def _decorate(self, entries: list[PositionLogprobs]) -> list[PositionLogprobs]:
        if self.tokenizer is None:
            return entries
        for d in entries:
            for tid, lp in d.items():
                if lp.decoded_token is None:
                    lp.decoded_token = self._decode([tid])
        return entries

    def _text(self, seq: SeqState, finished: bool, delta: bool) -> str:
        if seq.detok is None:
            if not finished or self.tokenizer is None:
                return ""
            if not seq.text:
                seq.text = self._decode(seq.token_ids, skip_special_tokens=seq.params.skip_special_tokens)
            return seq.text
        if delta:
            return seq.detok.next_delta(finished)
        return seq.detok.output_text

    def _make_output(self, parent: ParentState) -> RequestOutput | PoolingRequestOutput | None:
        if parent.params.pooling is not None:
            if not parent.finished:
                return None
            return PoolingRequestOutput(
                parent.request_id,
                parent.prompt_token_ids,
                PoolingOutput(parent.seqs[0].pooled or []),
                True,
                parent.num_cached_tokens,
                parent.metrics,
                parent.prompt,
            )
        kind = parent.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not parent.finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        comps = []
        for seq in parent.seqs:
            done = seq.finish_reason is not None
            if delta:
                text = self._text(seq, done, True)
                toks = seq.token_ids[seq.sent_tokens :]
                lps = seq.logprobs[seq.sent_logprobs :] if seq.logprobs is not None else None
                if not toks and not text and (not done or seq.sent_finish):
                    continue
                seq.sent_finish = done
                seq.sent_tokens = len(seq.token_ids)
                seq.sent_logprobs = len(seq.logprobs) if seq.logprobs is not None else 0
            else:
                text, toks, lps = self._text(seq, done, False), list(seq.token_ids), seq.logprobs
            comps.append(
                CompletionOutput(
                    seq.index, text, toks, seq.cumulative_logprob, lps, seq.finish_reason, seq.stop_reason
                )
            )
        if not comps and not parent.prompt_logprobs:
            return None
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=comps,
            finished=parent.finished,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics,
        )
