"""How the offline front end (`LLMEngine`) reaches the engine core: one protocol
(`EngineCoreClient`), two clients. `InprocClient`: the core in this process and thread
(direct calls). `MPClient`: the core in child processes over ZMQ, one or
`data_parallel_size` replicas (engine/dp_client.py's `EngineReplicas`; with one replica
exactly the single core). `get_output()` returns one step's `EngineCoreOutputs`; requests
the core refused or failed end there with finish_reason "abort" or "error".
"""

from __future__ import annotations

import pickle
from typing import Protocol

import zmq

from pagedserve.config import EngineConfig
from pagedserve.core.engine_core import CoreInfo, EngineCore
from pagedserve.engine.core_handle import CoreHandle
from pagedserve.engine.dp_client import EngineReplicas
from pagedserve.errors import EngineDeadError
from pagedserve.messages import (
    CoreRequestType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
)


class EngineCoreClient(Protocol):
    """What the offline front end calls; every method but get_output returns at once."""

    info: CoreInfo
    engine_core: EngineCore | None  # the core object when it runs in this process

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        """One user request's samples (they go to one replica together)."""

    def abort_requests(self, ids: list[str]) -> None: ...

    def finish_requests_stopped(self, ids: list[str]) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (blocks until one arrives; EngineDeadError if the core died)."""

    def get_stats(self) -> EngineStats: ...

    def shutdown(self) -> None: ...


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

    def get_stats(self) -> EngineStats:
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> None:
        self.engine_core.reset_prefix_cache()

    def remove_lora(self, lora_int_id: int) -> None:
        self.engine_core.remove_lora(lora_int_id)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class MPClient:
    """The engine core's replicas in child processes (`data_parallel_size`, 1 by default);
    blocking calls. `get_output()` returns the next step of whichever replica finished one."""

    engine_core = None  # not reachable from this process

    def __init__(self, config: EngineConfig) -> None:
        self.ctx = zmq.Context()
        self.replicas = EngineReplicas(config, True, self.ctx, self.ctx)
        self.info = self.replicas.infos[0]

    @property
    def handle(self) -> CoreHandle:
        """Replica 0's process handle."""
        return self.replicas.handles[0]

    def _check(self) -> None:
        """EngineDeadError at once if a replica died (also while idle: its process is asked)."""
        reps = self.replicas
        for i, h in enumerate(reps.handles):
            if reps.dead[i] is None and not h.is_alive():
                reps.mark_dead(i, reps.death_reason(i))
        dead = [d for d in reps.dead if d]
        if dead:
            raise EngineDeadError(f"the engine core died: {dead[0]}")

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        self._check()
        self.replicas.add(list(reqs))

    def abort_requests(self, ids: list[str]) -> None:
        self._check()
        self.replicas.abort(list(ids))

    def finish_requests_stopped(self, ids: list[str]) -> None:
        self._check()
        self.replicas.abort(list(ids), CoreRequestType.FINISH_STOPPED)

    def reset_prefix_cache(self) -> None:
        self._check()
        self.replicas.broadcast(CoreRequestType.RESET_PREFIX_CACHE)

    def remove_lora(self, lora_int_id: int) -> None:
        self.replicas.broadcast(CoreRequestType.REMOVE_LORA, lora_int_id)

    def get_output(self) -> EngineCoreOutputs:
        self._check()
        reps = self.replicas
        while not reps.output.poll(200):
            for i, h in enumerate(reps.handles):
                if not h.is_alive():
                    reps.mark_dead(i, reps.death_reason(i))
                    self._check()
        msg: EngineCoreOutputs = pickle.loads(reps.output.recv())
        reps.on_message(msg)
        self._check()
        for rid in msg.errors:  # refused by the core: ends like an abort
            msg.outputs.append(EngineCoreOutput(rid, [], finish_reason="abort"))
        for rid in msg.failed:  # failed in the core on an internal error
            msg.outputs.append(EngineCoreOutput(rid, [], finish_reason="error"))
        return msg

    def get_stats(self) -> EngineStats:
        return self.replicas.total_stats

    def shutdown(self) -> None:
        self.replicas.shutdown(10)  # live replicas are asked to stop first
        self.replicas.close_sockets()
        self.ctx.term()
