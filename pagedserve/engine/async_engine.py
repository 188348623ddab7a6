"""AsyncLLM: the engine loop in a background thread, fed by a command queue, for asyncio callers.

Why a thread and not a process: the engine's work is torch kernels and numpy, which
release the GIL, so the event loop stays responsive while a step runs, and outputs reach
the HTTP handlers without serialization. The thread owns the LLMEngine: every engine
call (add, abort, step) happens on it; other threads only enqueue commands and read the
stats snapshot it publishes after each step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.stats import EngineStats
from pagedserve.errors import EngineDeadError
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)




@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLM:
    def __init__(self, engine: LLMEngine, on_finished=None) -> None:
        self.engine = engine
        self.on_finished = on_finished  # callback(RequestOutput), on the engine thread
        self._cmds: deque = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self._dead: BaseException | None = None
        self.stats: EngineStats = engine.get_stats()
        self._thread = threading.Thread(target=self._loop, name="pagedserve-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        """The engine's resolved EngineConfig (max_model_len etc. filled in)."""
        return self.engine.config

    # -- called from the event loop ---------------------------------------------------
    async def add_request(
        self, prompt, params: SamplingParams, request_id: str, priority: int = 0
    ) -> RequestStream:
        """Queue a request and wait until the engine accepted it; raises ValueError (nothing
        queued) if it is invalid. Iterate the returned stream for its outputs."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, asyncio.Queue())
        added: asyncio.Future = loop.create_future()
        self._streams[request_id] = _Stream(loop, stream.queue)
        self._send(("add", request_id, prompt, params, priority, loop, added))
        try:
            await added
        except asyncio.CancelledError:
            stream.close()  # the abort is queued after the add, so it finds the request
            raise
        except Exception:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def generate(
        self, prompt, params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; closing the iterator early aborts the request."""
        stream = await self.add_request(prompt, params, request_id, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the loop."""
        self._send(("abort_all",))
        self._stop = True
        with self._wake:
            self._wake.notify()
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    # -- the engine thread ----------------------------------------------------------------
    def _send(self, cmd) -> None:
        with self._wake:
            self._cmds.append(cmd)
            self._wake.notify()

    def _deliver(self, request_id: str, item) -> None:
        s = self._streams.get(request_id)
        if s is not None:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, item)

    def _run_commands(self, pending: deque) -> None:
        for cmd in pending:
            kind = cmd[0]
            if kind == "add":
                _, rid, prompt, params, priority, loop, fut = cmd
                try:
                    self.engine.add_request(rid, prompt, params, priority=priority)
                    loop.call_soon_threadsafe(_resolve, fut, None)
                except Exception as e:  # noqa: BLE001 (handed to the caller)
                    loop.call_soon_threadsafe(_resolve, fut, e)
            elif kind == "abort":
                self.engine.abort_request(cmd[1])
            elif kind == "abort_all":
                self.engine.abort_request(list(self.engine.output_processor.parents))

    def _loop(self) -> None:
        engine = self.engine
        engine.owner_thread = threading.get_ident()
        try:
            while True:
                with self._wake:
                    while not self._cmds and not self._stop and not engine.has_unfinished_requests():
                        self._wake.wait(timeout=1.0)
                    if self._stop and not self._cmds:
                        break
                    pending, self._cmds = self._cmds, deque()
                self._run_commands(pending)
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        self._deliver(out.request_id, out)
                        if out.finished and self.on_finished is not None:
                            self.on_finished(out)
                self.stats = engine.get_stats()
        except BaseException as e:  # fail the waiting clients instead of hanging them
            logger.exception("engine loop failed")
            self._dead = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine loop died: {e!r}"))


class RequestStream:
    """The outputs of one request, in order. `close()` before the end aborts the request
    (a client that went away), which frees its KV blocks."""

    def __init__(self, llm: AsyncLLM, request_id: str, queue: asyncio.Queue) -> None:
        self.llm, self.request_id, self.queue = llm, request_id, queue
        self.finished = False
        self.closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.llm._streams.pop(self.request_id, None)
        return item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.llm._streams.pop(self.request_id, None)
        if not self.finished:
            self.llm.abort(self.request_id)


def _resolve(fut: asyncio.Future, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)
