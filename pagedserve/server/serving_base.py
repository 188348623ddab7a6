"""What every OpenAI endpoint shares: errors, the response envelope, usage, logprobs
formatting, admission (the --max-queue bound) and the per-HTTP-request tracker that
owns a request's engine streams.

Lifecycle of one HTTP request: `ServingContext.admit()` checks the model and takes
admission slots (refusing at once when full), then `RequestTracker.add()` sends each
prompt to the engine (all prompts of a list at once, as separate engine requests).
Outputs arrive on the tracker's single queue. The tracker is closed exactly once, by
whoever ends the request first: the handler when the request finishes, the ASGI guard
when the client leaves (it cancels the handler, see `middleware.py`), or the drain at
shutdown. Closing aborts whatever is still running in the engine (freeing its KV
blocks) and gives the admission slots back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time

from fastapi.responses import JSONResponse

from pagedserve.errors import EngineDeadError, InvalidRequestError
from pagedserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

QUOTE_CHARS = 64  # error messages quote at most this much of any user input
CLEANUP_KEY = "pagedserve.cleanup"  # scope key: callbacks the ASGI guard runs when a request ends


# -- errors ---------------------------------------------------------------------------------
def quote(value, limit: int = QUOTE_CHARS) -> str:
    """A short, printable, always-encodable rendering of user input for error messages."""
    s = value if isinstance(value, str) else repr(value)
    cut = len(s) > limit
    s = s[:limit].encode("utf-8", "backslashreplace").decode("utf-8")
    return repr(s + "...") if cut else repr(s)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error envelope; `code` is a string or null as OpenAI's clients expect."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code, self.headers = code, headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, _safe(message), "invalid_request_error", param)


def to_api_error(e: BaseException) -> APIError:
    """Typed errors from the engine/input processor -> HTTP. InvalidRequestError carries its
    OpenAI `param`; a plain ValueError is still a 400 (param null); a dead engine is a 503."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return bad_request(str(e), e.param)
    if isinstance(e, ValueError):
        return bad_request(str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, "the engine is not running", "server_error", code="engine_dead")
    return APIError(500, "internal server error", "server_error")


def _safe(message: str, limit: int = 1024) -> str:
    """Messages built by lower layers may embed user input: bound and make encodable."""
    if len(message) > limit:
        message = message[:limit] + "..."
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


# -- response pieces --------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(rid: str, obj: str, created: int, model: str, choices: list, usage_: dict | None = None) -> dict:
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_error_events(e: Exception, what: str) -> list[str]:
    """A stream that failed mid-way: its OpenAI error event (none when the server is shutting
    down), after logging an unexpected server error (`what` names the stream)."""
    err = to_api_error(e)
    if err.status >= 500 and not isinstance(e, APIError):
        logger.exception("%s failed", what)
    return [] if err.code == "shutting_down" else [sse(err.body())]


MIN_LOGPROB = -9999.0  # vLLM's stand-in for -inf (a token masked by a constraint): JSON has no -inf


def finite_logprob(v: float | None) -> float | None:
    """A logprob JSON can carry: -inf (and NaN) become MIN_LOGPROB."""
    if v is None or v >= MIN_LOGPROB:
        return v
    return MIN_LOGPROB


class LogprobFormatter:
    """Token logprobs in OpenAI's two shapes (completions' parallel lists, chat's content list)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, d, tid: int) -> tuple[str, float | None]:
        lp = d.get(tid) if d is not None else None
        if lp is None:
            return self.tokenizer.decode([tid]), None
        return (
            lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([tid])
        ), finite_logprob(lp.logprob)

    @staticmethod
    def ranked(d, k: int) -> list[int]:
        """The k most likely token ids at one position, best first."""
        return sorted((t for t in d if d[t].rank is not None), key=lambda t: d[t].rank)[:k]

    def completion(self, entries, token_ids, k: int, offset: int = 0) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        pos = offset
        for d, tid in zip(entries, token_ids):
            tok, lp = self.text(d, tid)
            top = None
            if d is not None:
                top = {}
                for t in self.ranked(d, k):
                    s, v = self.text(d, t)
                    if s in top:  # two tokens with the same text (e.g. partial bytes): name them apart
                        s = self.tokenizer.convert_ids_to_tokens(t) or ""
                        if s in top or not s:
                            s = f"<|token_id:{t}|>"
                    top[s] = v
            out["tokens"].append(tok)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(pos)
            pos += len(tok)
        return out

    def chat(self, entries, token_ids, k: int) -> dict:
        content = []
        for d, tid in zip(entries, token_ids):
            tok, lp = self.text(d, tid)
            tops = []
            for t in self.ranked(d, k) if d is not None else ():
                s, v = self.text(d, t)
                tops.append({"token": s, "logprob": v, "bytes": list(s.encode("utf-8", "replace"))})
            content.append(
                {
                    "token": tok,
                    "logprob": lp,
                    "bytes": list(tok.encode("utf-8", "replace")),
                    "top_logprobs": tops,
                }
            )
        return {"content": content}


# -- admission --------------------------------------------------------------------------------
class AdmissionLimiter:
    """The --max-queue bound, counted where requests are admitted.

    `in_flight` is what the front end has sent to the engine (or is still tokenizing) and
    not yet seen finish; a request is admitted only if in_flight + its prompts stays within
    `capacity` (= max_num_seqs + max_queue: a full running batch plus the allowed queue).
    Check and increment are one step under a lock, so no interleaving of event loops,
    threads or workers sharing this limiter can exceed the bound. Several worker
    processes share one by passing `shared=multiprocessing.Value("q", 0)` (made before
    forking); its own lock is then used."""

    def __init__(self, capacity: int | None, shared=None) -> None:
        self.capacity = capacity
        self._shared = shared
        self._lock = shared.get_lock() if shared is not None else threading.Lock()
        self._count = 0

    @property
    def in_flight(self) -> int:
        return self._shared.value if self._shared is not None else self._count

    def try_acquire(self, n: int) -> bool:
        with self._lock:
            cur = self.in_flight
            if self.capacity is not None and cur + n > self.capacity:
                return False  # counted by ServerMetrics.rejected("overloaded")
            self._set(cur + n)
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self._set(max(0, self.in_flight - n))

    def _set(self, v: int) -> None:
        if self._shared is not None:
            self._shared.value = v
        else:
            self._count = v


# -- one HTTP request's engine requests -----------------------------------------------------------
_ABORT = object()


class RequestTracker:
    """The engine requests of one HTTP request (one per prompt of a list), their merged
    outputs, and its admission slots."""

    def __init__(self, ctx: ServingContext, slots: int) -> None:
        self.ctx = ctx
        self.slots = slots
        self.queue: asyncio.Queue = asyncio.Queue()
        self.streams: dict[int, object] = {}
        self.pumps: list[asyncio.Task] = []
        self.closed = False
        self.abort_reason: str | None = None

    async def add(self, prompts: list, params, base_id: str, priority: int, suffix: bool) -> None:
        """Send every prompt to the engine at once (separate engine requests); if one is
        refused, abort the others and raise its error."""

        async def one(i: int, p) -> None:
            rid = f"{base_id}-{i}" if suffix else base_id
            st = await self.ctx.llm.add_request(p, params, rid, priority)
            if self.closed or self.abort_reason is not None:
                st.close()
                return
            self.streams[i] = st
            self.pumps.append(asyncio.create_task(self._pump(i, st)))

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.close()
            for e in errors:
                if isinstance(e, asyncio.CancelledError):
                    raise e
            raise to_api_error(errors[0]) from None
        if self.abort_reason is not None:
            raise APIError(503, self.abort_reason, "server_error", code="shutting_down")

    async def _pump(self, i: int, st) -> None:
        try:
            async for out in st:
                if out.finished:
                    self.ctx.observe_finished(out)
                self.queue.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 (an engine failure: handed to the handler)
            self.queue.put_nowait((i, e))
            return
        self.queue.put_nowait((i, None))

    async def next(self):
        """(prompt index, RequestOutput), (i, None) when prompt i is done, or raises:
        APIError when the tracker was aborted (shutdown) or the engine failed."""
        item = await self.queue.get()
        if item is _ABORT:
            self.queue.put_nowait(_ABORT)  # every later call sees it too
            raise APIError(503, self.abort_reason or "request aborted", "server_error", code="shutting_down")
        if isinstance(item[1], BaseException):
            raise to_api_error(item[1])
        return item

    async def finals(self) -> list[RequestOutput]:
        """Non-streaming: wait for every prompt's final output, in prompt order."""
        finals: dict[int, RequestOutput] = {}
        done = 0
        while done < len(self.streams):
            i, out = await self.next()
            if out is None:
                done += 1
            elif out.finished:
                finals[i] = out
        if len(finals) != len(self.streams):
            raise APIError(503, "request was aborted", "server_error")
        return [finals[i] for i in range(len(finals))]

    def abort(self, reason: str) -> None:
        """Shutdown: end this request now (handlers turn it into final chunks/an error)."""
        if self.abort_reason is None:
            self.abort_reason = reason
            self._abort_engine()
            self.queue.put_nowait(_ABORT)

    def _abort_engine(self) -> None:
        for t in self.pumps:
            t.cancel()
        for st in self.streams.values():
            st.close()  # aborts it in the engine unless it already finished

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._abort_engine()
        self.ctx.limiter.release(self.slots)
        self.ctx.trackers.discard(self)


# -- shared state of the endpoints ---------------------------------------------------------------
class ServingContext:
    def __init__(
        self,
        llm,
        model_name: str,
        metrics,
        limiter: AdmissionLimiter,
        trust_request_chat_template: bool = False,
        compact_json: bool = False,
    ) -> None:
        self.llm = llm
        # --structured-outputs-disable-any-whitespace: JSON constraints without free whitespace
        self.compact_json = compact_json
        self.model_name = model_name
        self.metrics = metrics
        self.limiter = limiter
        self.trust_request_chat_template = trust_request_chat_template
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.config.scheduler.max_model_len
        self.served = {model_name, llm.config.model.model}
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.trackers: set[RequestTracker] = set()
        self.draining = False
        # Cheap pre-check before tokenizing: no token is longer than this many UTF-8 bytes,
        # so a text of more than max_model_len * this many bytes can never fit.
        self.max_prompt_bytes = self.max_model_len * _max_token_bytes(self.tokenizer)

    def observe_finished(self, out: RequestOutput) -> None:
        with contextlib.suppress(Exception):
            self.metrics.observe_finished(out)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served:
            raise APIError(
                404,
                f"The model {quote(model)} does not exist.",
                "not_found_error",
                "model",
                "model_not_found",
            )

    def admit(self, num_prompts: int, scope: dict) -> RequestTracker:
        """Take `num_prompts` admission slots (one per prompt of a list) or refuse now."""
        if self.draining:
            self.metrics.rejected("shutting_down")
            raise APIError(
                503,
                "server is shutting down",
                "server_error",
                code="shutting_down",
                headers={"Retry-After": "1"},
            )
        if not self.llm.is_alive:
            raise APIError(503, "the engine is not running", "server_error", code="engine_dead")
        if not self.limiter.try_acquire(num_prompts):
            self.metrics.rejected("overloaded")
            raise APIError(
                503,
                f"server is overloaded: {self.limiter.in_flight} requests in flight "
                f"(limit {self.limiter.capacity}); retry later",
                "server_overloaded",
                code="server_overloaded",
                headers={"Retry-After": "1"},
            )
        tracker = RequestTracker(self, num_prompts)
        self.trackers.add(tracker)
        scope.setdefault(CLEANUP_KEY, []).append(tracker.close)
        return tracker

    def check_text_size(self, text_bytes: int, param: str) -> None:
        if text_bytes > self.max_prompt_bytes:
            raise bad_request(
                f"the input is {text_bytes} bytes, more than can fit in max_model_len="
                f"{self.max_model_len} tokens.",
                param,
            )

    async def drain(self, timeout: float, grace: float = 2.0) -> None:
        """Shutdown: refuse new requests, let running ones finish for `timeout` seconds,
        then end the rest (streams get a final chunk and [DONE], others an error body)."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.trackers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.trackers:
            logger.info("drain window over: aborting %d requests", len(self.trackers))
        for t in list(self.trackers):
            t.abort("server is shutting down")
        deadline = time.monotonic() + grace
        while self.trackers and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


def _max_token_bytes(tokenizer) -> int:
    try:
        vocab = tokenizer.get_vocab()
        return max(8, max(len(t.encode("utf-8", "surrogatepass")) for t in vocab))
    except Exception:  # noqa: BLE001 (no usable vocabulary: no pre-check)
        return 1 << 20
