"""How the offline front end (`LLMEngine`) reaches the engine core: in its own process
and thread (`InprocClient`, direct calls), or in a child process over ZMQ
(`SyncMPClient`). Both offer the same calls; `get_output()` returns one step's
`EngineCoreOutputs`."""

from __future__ import annotations

import pickle

from pagedserve.config import EngineConfig
from pagedserve.core.engine_core import EngineCore
from pagedserve.errors import EngineDeadError
from pagedserve.messages import CoreRequestType, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest


class InprocClient:
    def __init__(self, config: EngineConfig) -> None:
        self.engine_core = EngineCore(config)
        self.info = self.engine_core.info()

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        added = []
        try:
            for r in reqs:
                self.engine_core.add_request(r)
                added.append(r.request_id)
        except Exception:  # invalid (ValueError) or a bug admitting it: nothing of it stays queued
            self.engine_core.abort_requests(added)
            raise

    def abort_requests(self, ids: list[str]) -> None:
        self.engine_core.abort_requests(ids)

    def finish_requests_stopped(self, ids: list[str]) -> None:
        self.engine_core.finish_requests_stopped(ids)

    def get_output(self) -> EngineCoreOutputs:
        core = self.engine_core
        return EngineCoreOutputs(core.step() if core.has_unfinished_requests() else [])

    def get_stats(self):
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> None:
        self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class SyncMPClient:
    """The engine core in a child process; blocking calls."""

    engine_core = None  # not reachable from this process

    def __init__(self, config: EngineConfig) -> None:
        import zmq  # only this path needs pyzmq

        from pagedserve.engine.core_handle import CoreHandle

        self._zmq = zmq
        self.ctx = zmq.Context()
        self.handle = CoreHandle(config, process=True)
        self.input, self.output = self.handle.bind(self.ctx, self.ctx)
        try:
            self.info = self.handle.start()
        except BaseException:
            self._close_sockets()
            raise
        self.stats = self.info.stats
        self.dead: str | None = None

    def _send(self, kind: CoreRequestType, payload=None) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine core died: {self.dead}")
        self.input.send(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        self._send(CoreRequestType.ADD, reqs)

    def abort_requests(self, ids: list[str]) -> None:
        self._send(CoreRequestType.ABORT, list(ids))

    def finish_requests_stopped(self, ids: list[str]) -> None:
        self._send(CoreRequestType.FINISH_STOPPED, list(ids))

    def reset_prefix_cache(self) -> None:
        self._send(CoreRequestType.RESET_PREFIX_CACHE)

    def get_output(self) -> EngineCoreOutputs:
        while not self.output.poll(200):
            if not self.handle.is_alive():
                self.dead = f"process exited with code {self.handle.process.exitcode}"
                raise EngineDeadError(f"the engine core died: {self.dead}")
        msg: EngineCoreOutputs = pickle.loads(self.output.recv())
        if msg.fatal is not None:
            self.dead = msg.fatal
            raise EngineDeadError(f"the engine core died: {msg.fatal}")
        self.stats = msg.stats
        for rid in msg.errors:  # refused by the core: ends like an abort
            msg.outputs.append(EngineCoreOutput(rid, [], finish_reason="abort"))
        for rid in msg.failed:  # failed in the core on an internal error
            msg.outputs.append(EngineCoreOutput(rid, [], finish_reason="error"))
        return msg

    def get_stats(self):
        return self.stats

    def shutdown(self) -> None:
        if self.dead is None and self.handle.is_alive():
            self.input.send(pickle.dumps((CoreRequestType.SHUTDOWN, None)))
        self.handle.join(10)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self.input.close(0)
        self.output.close(0)
        self.ctx.term()
