"""AsyncLLM: the asyncio front end of the server, over an engine core in its own process.

Front end (this process, the event loop): input processor (tokenize, validate, n > 1),
output processor (detokenize, stop strings) in one task that reads the core's per-step
outputs from ZMQ and hands each request's RequestOutputs to its stream. Engine core (a
child process by default, or a thread with `engine_core_process=False`): the scheduler,
the executor and the step loop (`core/core_proc.py`), so HTTP, JSON and
detokenization never hold the GIL the step needs.

Data parallelism (`data_parallel_size` M > 1): M engine cores, each with its own KV
cache, behind this one front end (engine/dp_client.py); each request goes to the replica
its router picks (engine/dp_router.py), its aborts follow it; `stats` sums the replicas.
A replica that dies fails the requests it held with EngineDeadError and turns `is_alive`
False (new requests are refused, /health says 503); the other replicas finish theirs.

Faults: an exception while processing one request's outputs (detokenizer, stop strings,
logprob text) or inputs fails that request alone: its stream gets a RequestFailedError,
the core aborts it (its KV blocks are freed) and every other request goes on. If the core
dies (an executor fault, or the process was killed), every in-flight stream gets an
EngineDeadError at once, `is_alive` turns False (the server's /health says 503, and
`pagedserve serve` exits non-zero so that a supervisor restarts it), and new requests
are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import pickle
import threading
import time
from collections.abc import AsyncIterator
from multiprocessing.connection import wait

import zmq
import zmq.asyncio

from pagedserve.config import EngineConfig
from pagedserve.engine.core_handle import CoreHandle
from pagedserve.engine.dp_client import EngineReplicas
from pagedserve.engine.llm_engine import FrontEnd
from pagedserve.engine.progress import ProgressWatch
from pagedserve.engine_args import EngineArgs
from pagedserve.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from pagedserve.messages import CoreRequestType, EngineCoreOutputs, EngineStats
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

LARGE_PROMPT_CHARS = 1 << 16  # tokenize prompts longer than this off the event loop
DEFAULT_STALL_TIMEOUT_S = 30.0


class AsyncLLM(FrontEnd):
    def __init__(self, config: EngineConfig, engine_core_process: bool = True, on_finished=None) -> None:
        super().__init__(config)
        self.on_finished = on_finished  # callback(RequestOutput) for finished requests, on the event loop
        # inputs: plain sockets (sends never block: unbounded queue); output: asyncio, one
        # socket for every replica
        self.sync_ctx, self.ctx = zmq.Context(), zmq.asyncio.Context()
        self.replicas = EngineReplicas(config, engine_core_process, self.sync_ctx, self.ctx)
        self.handle: CoreHandle = self.replicas.handles[0]
        self.output = self.replicas.output
        self.num_blocks = min(info.num_kv_blocks for info in self.replicas.infos)  # per replica
        self.core_ready(self.num_blocks)
        self.snapshot: dict | None = None  # replica 0's latest live-view snapshot (core/snapshot.py)
        self._streams: dict[str, asyncio.Queue] = {}
        self._dead: str | None = None
        self._output_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._early_deaths: list[str | None] = [None] * self.replicas.num_replicas
        # forward progress (stall_reason): the last message from a core, the longest gap
        # between two of them while requests were in flight (a step's time), the stall seen
        self.progress = ProgressWatch(DEFAULT_STALL_TIMEOUT_S, time.monotonic())
        self._stalled: str | None = None
        # the cores' processes are watched from now on, not from the first request: a core
        # that dies while idle turns is_alive False at once (/health 503, the server exits)
        threading.Thread(target=self._watch_core, name="pagedserve-core-watch", daemon=True).start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kw) -> AsyncLLM:
        """A server's defaults where the arguments leave them open (None): the engine core in
        its own process, the CPU KV cache committed at start."""
        process = True if args.engine_core_process is None else args.engine_core_process
        if args.kv_cache_prefault is None:
            args = dataclasses.replace(args, kv_cache_prefault=True)
        return cls(args.create_engine_config(), engine_core_process=process, **kw)

    @property
    def stats(self) -> EngineStats:
        """The latest stats, summed over the replicas (`replicas.stats`: each one's)."""
        return self.replicas.total_stats

    @property
    def core_times(self) -> tuple[float, float, float]:
        """The core loops' seconds so far (summed over replicas): stepping, input, idle."""
        times = self.replicas.core_times
        return tuple(sum(t[k] for t in times) for k in range(3))

    # -- requests -------------------------------------------------------------------------
    async def add_request(
        self,
        prompt,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request=None,
        queue: asyncio.Queue | None = None,
    ) -> RequestStream:
        """Validate and queue a request; raises InvalidRequestError (nothing queued) if it is
        invalid, EngineDeadError if the core is gone. Iterate the stream for its outputs, or
        pass `queue`: its outputs (RequestOutputs, or the exception that ends it) go there,
        which several requests may share (a server request's prompts: no task per request
        to merge them); the stream is then only for close()."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine core died: {self._dead}")
        if request_id in self._streams or request_id in self.output_processor.parents:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use.", "request_id")
        self._ensure_output_task()
        process = self.input_processor.process
        if _prompt_size(prompt) > LARGE_PROMPT_CHARS:
            req = await asyncio.to_thread(process, request_id, prompt, params, None, priority, None, lora_request)
        else:
            req = process(request_id, prompt, params, None, priority, None, lora_request)
        if self._dead is not None:
            raise EngineDeadError(f"the engine core died: {self._dead}")
        if request_id in self._streams:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use.", "request_id")
        if queue is None:
            queue = asyncio.Queue()
        if not self._streams:  # work begins now: progress is measured from here
            self.progress.work_begins(time.monotonic())
        self.output_processor.add_request(req)
        self._streams[request_id] = queue
        try:
            self._send(CoreRequestType.ADD, req.children)
        except EngineDeadError as e:  # the core went away unseen (its socket has no peer)
            self._streams.pop(request_id, None)
            self.output_processor.remove(request_id)
            self._on_dead(str(e))
            raise
        return RequestStream(self, request_id, queue)

    async def generate(
        self, prompt, params: SamplingParams, request_id: str, priority: int = 0, lora_request=None
    ) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; closing the iterator early aborts the request."""
        stream = await self.add_request(prompt, params, request_id, priority, lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request from any state; the core frees its blocks at once."""
        self._streams.pop(request_id, None)
        children = self.output_processor.child_ids_of(request_id)
        self.output_processor.remove(request_id)
        if children and not self._closed:  # to the replica holding it, if it is alive
            self._send(CoreRequestType.ABORT, children)

    def reset_prefix_cache(self) -> None:
        self._send(CoreRequestType.RESET_PREFIX_CACHE)

    def remove_lora(self, lora_int_id: int) -> None:
        """Unload an adapter in the core(s); requests using it finish with it first."""
        self.input_processor.lora.forget(lora_int_id)
        self._send(CoreRequestType.REMOVE_LORA, lora_int_id)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and not self._closed

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def shutdown(self, timeout: float = 2.0) -> None:
        """Stop the core (in-flight requests end) and release its process: it gets
        `timeout` seconds to finish its step and exit, then SIGTERM, then SIGKILL."""
        if self._closed:
            return
        self._closed = True
        self.replicas.shutdown(timeout)
        if self._output_task is not None:
            self._output_task.cancel()
        self._fail_all("the engine was shut down")
        self.replicas.close_sockets()
        self.sync_ctx.term()
        self.ctx.term()

    # -- plumbing -------------------------------------------------------------------------
    def _send(self, kind: CoreRequestType, payload=None) -> None:
        """To the replica(s) concerned: ADD where the router says, ABORT / FINISH_STOPPED
        where the requests run, the rest to all. Never blocks."""
        if kind == CoreRequestType.ADD:
            self.replicas.add(payload)
        elif kind in (CoreRequestType.ABORT, CoreRequestType.FINISH_STOPPED):
            self.replicas.abort(payload, kind)
        else:
            self.replicas.broadcast(kind, payload)

    def start_output_loop(self) -> None:
        """Read the core's messages from now on (call on the event loop; idempotent), not
        only from the first request: the live view wants snapshots of an idle engine too."""
        self._ensure_output_task()

    def _ensure_output_task(self) -> None:
        if self._output_task is None:
            self._loop = asyncio.get_running_loop()
            self._output_task = self._loop.create_task(self._output_loop())
            for i, why in enumerate(self._early_deaths):  # died before any loop ran
                if why is not None:
                    self._on_replica_dead(i, why)

    def _watch_core(self) -> None:
        """Notices a dead core process within milliseconds, from start-up on (threads die
        with their loop). Before an event loop runs (no request, no stream yet) a death is
        booked at once and acted on when the loop starts."""
        sentinels = {h.sentinel: i for i, h in enumerate(self.replicas.handles) if h.sentinel is not None}
        while sentinels:
            for s in wait(list(sentinels)):
                i = sentinels.pop(s)
                if self._closed:
                    continue
                why = self.replicas.death_reason(i)
                loop = self._loop
                if loop is None:
                    logger.error("engine core %d died: %s", i, why)
                    self._early_deaths[i] = why
                    self._dead = self._dead or why
                    continue
                with contextlib.suppress(RuntimeError):  # the loop may be closed already
                    loop.call_soon_threadsafe(self._on_replica_dead, i, why)

    def _on_replica_dead(self, i: int, why: str) -> None:
        """Replica i is gone: the requests it held fail; with one replica, all of them."""
        if self._closed or self.replicas.dead[i] is not None:
            return
        if self.replicas.num_replicas == 1:
            self.replicas.mark_dead(i, why)
            self._on_dead(why)
            return
        logger.error("engine core %d died: %s", i, why)
        lost_children = set(self.replicas.mark_dead(i, why))
        if self._dead is None:
            self._dead = f"engine core {i}: {why}"
        children_of = self.output_processor.child_ids_of
        lost = [rid for rid in list(self._streams) if lost_children.intersection(children_of(rid))]
        for rid in lost:
            queue = self._streams.pop(rid, None)
            self.output_processor.remove(rid)
            if queue is not None:
                queue.put_nowait(EngineDeadError(f"the engine core {i} died: {why}"))
        if all(self.replicas.dead):
            self._fail_all(f"the engine cores died: {why}")

    def _on_dead(self, why: str) -> None:
        if self._dead is None and not self._closed:
            logger.error("engine core died: %s", why)
            self._dead = why
            self._fail_all(f"the engine core died: {why}")

    def _fail_all(self, why: str) -> None:
        for rid, queue in list(self._streams.items()):
            queue.put_nowait(EngineDeadError(why))
            self.output_processor.remove(rid)
        self._streams.clear()

    async def _output_loop(self) -> None:
        recv, process = self.output.recv, self.output_processor.process
        try:
            while True:
                msg: EngineCoreOutputs = pickle.loads(await recv())
                self._progressed()
                if msg.fatal is not None:
                    self._on_replica_dead(msg.engine_index, msg.fatal)
                    if all(self.replicas.dead):
                        return
                    continue
                self.replicas.on_message(msg)  # stats, times, which replica holds what
                if msg.snapshot is not None and msg.engine_index == 0:
                    self.snapshot = msg.snapshot
                for rid, err in msg.errors.items():  # refused by the core (invalid)
                    self._fail_request(rid.split("#", 1)[0], InvalidRequestError(err))
                for rid, err in msg.failed.items():  # failed in the core (an internal error)
                    self._fail_request(rid.split("#", 1)[0], RequestFailedError(err))
                if not msg.outputs:
                    continue
                res = process(msg.outputs)  # a request whose outputs fail is in res.failed
                if res.stopped:
                    self._send(CoreRequestType.FINISH_STOPPED, res.stopped)
                if res.abort:
                    self._send(CoreRequestType.ABORT, res.abort)
                for rid, e in res.failed.items():
                    self._fail_request(
                        rid, RequestFailedError(f"processing the request's outputs failed: {e!r}")
                    )
                for out in res.outputs:
                    queue = self._streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                        if out.finished:
                            del self._streams[out.request_id]
                    if out.finished and self.on_finished is not None:
                        try:
                            self.on_finished(out)
                        except Exception:  # noqa: BLE001 (a metrics bug: logged, nothing else)
                            logger.exception("on_finished failed for request %s", out.request_id)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # outside any one request (a protocol bug): clients are told
            logger.exception("output loop failed")
            self._on_dead(f"output processing failed: {e!r}")

    @property
    def stall_timeout_s(self) -> float:
        return self.progress.timeout_s

    @stall_timeout_s.setter
    def stall_timeout_s(self, seconds: float) -> None:
        self.progress.timeout_s = seconds

    def _progressed(self) -> None:
        if self.progress.message(time.monotonic(), bool(self._streams)):
            logger.warning("the engine core makes progress again (%s)", self._stalled)
            self._stalled = None

    def stall_reason(self) -> str | None:
        """Why the core counts as stalled (None: it is not; engine/progress.py). Logged
        once, with the core's last known state, when a stall starts."""
        quiet = self.progress.quiet(time.monotonic(), bool(self._streams)) if self._dead is None else None
        if quiet is None:
            return self._stalled if self._streams else None
        limit = self.progress.limit
        if self._stalled is None:
            self.progress.stalled_for = quiet
            s = self.stats
            logger.error(
                "the engine core made no progress for %.1f s (limit %.1f s) with %d requests in flight; "
                "its last state: %d running, %d waiting, last step %d requests / %d tokens, step %d",
                quiet, limit, len(self._streams), s.num_running, s.num_waiting, s.last_batch_size,
                s.last_num_scheduled_tokens, s.num_steps,
            )
        self._stalled = f"the engine core made no progress for {quiet:.0f} s with requests in flight (limit {limit:.0f} s)"
        return self._stalled

    def _fail_request(self, request_id: str, error: Exception) -> None:
        """End one request with `error` (its stream raises it); the core aborts what is left of it."""
        queue = self._streams.pop(request_id, None)
        self.abort(request_id)
        if queue is not None:
            queue.put_nowait(error)


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
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self.llm.abort(self.request_id)


def _prompt_size(prompt) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return len(prompt["prompt"])
    return 0
