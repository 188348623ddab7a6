"""Admission and one HTTP request's engine requests.

`AdmissionLimiter` is the --max-queue bound. `RequestTracker` owns the engine requests of
one HTTP request (one per prompt of a list): `add()` sends every prompt at once, outputs
arrive on one queue, and `close()` (exactly once, by whoever ends the request first: the
handler, the ASGI guard when the client leaves, or the drain at shutdown) aborts what
still runs in the engine (freeing its KV blocks) and gives the admission slots back.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from typing import TYPE_CHECKING

from pagedserve.outputs import RequestOutput
from pagedserve.server.http_errors import APIError, to_api_error

if TYPE_CHECKING:
    from pagedserve.server.serving_base import ServingContext


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


_ABORT = object()


class RequestTracker:
    """The engine requests of one HTTP request (one per prompt of a list), their merged
    outputs, and its admission slots. The engine puts every prompt's outputs into the one
    queue `next` reads (add_request's `queue`): no task per prompt between the two."""

    def __init__(self, ctx: ServingContext, slots: int) -> None:
        self.ctx = ctx
        self.slots = slots
        self.queue: asyncio.Queue = asyncio.Queue()
        self.streams: dict[int, object] = {}
        self.index: dict[str, int] = {}  # engine request id -> prompt index
        self.ended: deque[int] = deque()  # prompts whose final output `next` returned: (i, None) next
        self.closed = False
        self.abort_reason: str | None = None
        self.abort_error = ("server_error", "shutting_down", 503)  # (type, code, status) of an abort
        self.timer: asyncio.TimerHandle | None = None
        self.lora = None  # the LoRARequest its prompts run with (None: the base model)

    def set_deadline(self, seconds: float) -> None:
        """Abort the request (queued or running: its engine requests end, their blocks are
        freed) `seconds` from now; the client gets a 504 (code request_timeout)."""
        self.timer = asyncio.get_running_loop().call_later(seconds, self._expire, seconds)

    def _expire(self, seconds: float) -> None:
        if not self.closed:
            self.abort(f"the request did not finish within {seconds:g} s", ("timeout_error", "request_timeout", 504))
            with contextlib.suppress(Exception):
                self.ctx.metrics.timed_out()

    async def add(self, prompts: list, params, base_id: str, priority: int, suffix: bool) -> None:
        """Send every prompt to the engine at once (separate engine requests); if one is
        refused, abort the others and raise its error."""

        async def one(i: int, p) -> None:
            rid = f"{base_id}-{i}" if suffix else base_id
            if self.lora is None:
                st = await self.ctx.llm.add_request(p, params, rid, priority, queue=self.queue)
            else:
                st = await self.ctx.llm.add_request(p, params, rid, priority, lora_request=self.lora, queue=self.queue)
            if self.closed or self.abort_reason is not None:
                st.close()
                return
            self.streams[i] = st  # (no output can have arrived: add_request returned without yielding)
            self.index[rid] = i

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.close()
            for e in errors:
                if isinstance(e, asyncio.CancelledError):
                    raise e
            raise to_api_error(errors[0]) from None
        if self.abort_reason is not None:
            raise self._abort_api_error()

    async def next(self):
        """(prompt index, RequestOutput), (i, None) when prompt i is done, or raises:
        APIError when the tracker was aborted (shutdown) or the engine failed."""
        if self.ended:
            return self.ended.popleft(), None
        while True:
            item = await self.queue.get()
            if item is _ABORT:
                self.queue.put_nowait(_ABORT)  # every later call sees it too
                raise self._abort_api_error()
            if isinstance(item, BaseException):  # an engine failure: handed to the handler
                raise to_api_error(item)
            i = self.index.get(item.request_id)
            if i is not None:  # (else a prompt closed before it was tracked)
                break
        if item.finished:
            self.streams[i].finished = True  # (its close() then aborts nothing)
            self.ctx.observe_finished(item)
            self.ended.append(i)
        return i, item

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

    def _abort_api_error(self) -> APIError:
        kind, code, status = self.abort_error
        return APIError(status, self.abort_reason or "request aborted", kind, code=code)

    def abort(self, reason: str, error: tuple[str, str, int] | None = None) -> None:
        """End this request now (shutdown; `error`: another (type, code, status), e.g. a
        deadline); handlers turn it into final chunks / an error body."""
        if self.abort_reason is None:
            self.abort_reason = reason
            if error is not None:
                self.abort_error = error
            self._abort_engine()
            self.queue.put_nowait(_ABORT)

    def _abort_engine(self) -> None:
        for st in self.streams.values():
            st.close()  # aborts it in the engine unless it already finished

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        self._abort_engine()
        self.ctx.limiter.release(self.slots)
        self.ctx.trackers.discard(self)
