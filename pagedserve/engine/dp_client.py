"""Data parallelism: M engine cores (replicas, each with its own scheduler, executor and KV
cache) behind one front end.

`EngineReplicas` is the front end's side of them: a `CoreHandle` per replica, a PUSH
socket per replica for commands, and ONE PULL socket bound to every replica's output
address, so a single reader (AsyncLLM's output loop, or `core_client.MPClient.get_output`) gets
every replica's steps, fair-queued; each message names its sender
(`EngineCoreOutputs.engine_index`). A `DPRouter` picks the replica of each new request;
all of a request's samples (n > 1) go to the same one, and its aborts and stop-string
finishes follow it there.

Invariants: `holder` maps every child request id sent to a replica and not yet finished,
aborted or refused to that replica; `loads[i]` counts the ids held by replica i; a dead
replica gets no more commands, and nothing is routed once any replica died (the front end
refuses new requests: the deployment is degraded and /health says 503).

With M = 1 this is exactly the single engine core (no routing, no hashing).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import pickle
import time
from dataclasses import fields

import zmq

from pagedserve.config import EngineConfig
from pagedserve.core.engine_core import CoreInfo
from pagedserve.core.length_estimator import OutputLengthEstimator
from pagedserve.engine.core_handle import CoreHandle
from pagedserve.engine.dp_router import DPRouter
from pagedserve.errors import EngineDeadError
from pagedserve.messages import (
    CoreRequestType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
)

logger = logging.getLogger(__name__)

CONNECT_WAIT_S = 5.0  # a live core's command socket gets its peer within this (normally at once)


def merge_stats(stats: list[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's: counts and counters summed, the KV usage
    recomputed over all blocks, utilization weighted by blocks used."""
    if len(stats) == 1:
        return stats[0]
    total = {
        f.name: sum(getattr(s, f.name) for s in stats)
        for f in fields(EngineStats)
        if f.name not in ("kv_cache_usage", "kv_utilization", "block_size", "spec_accepted_per_position", "kv_audit_error")
    }
    used, blocks = total["kv_blocks_used"], total["kv_blocks_total"]
    per_pos = [0] * max(len(s.spec_accepted_per_position) for s in stats)
    for s in stats:
        for i, v in enumerate(s.spec_accepted_per_position):
            per_pos[i] += v
    return EngineStats(
        **total,
        kv_cache_usage=used / blocks if blocks else 0.0,
        kv_utilization=sum(s.kv_utilization * s.kv_blocks_used for s in stats) / used if used else 0.0,
        block_size=stats[0].block_size,
        spec_accepted_per_position=per_pos,
        kv_audit_error=next((s.kv_audit_error for s in stats if s.kv_audit_error), None),
    )


class EngineReplicas:
    """The front end's handles, sockets and bookkeeping for `data_parallel_size` cores."""

    def __init__(
        self, config: EngineConfig, process: bool, input_ctx: zmq.Context, output_ctx: zmq.Context
    ) -> None:
        par = config.parallel
        n = par.data_parallel_size
        self.handles = [CoreHandle(config, process=process, engine_index=i) for i in range(n)]
        self.inputs: list[zmq.Socket] = []
        self.output: zmq.Socket | None = None
        for h in self.handles:
            commands, self.output = h.bind(input_ctx, output_ctx, outputs=self.output)
            self.inputs.append(commands)
        try:
            for h in self.handles:  # the start-ups (model load, KV sizing) overlap
                h.launch()
            self.infos: list[CoreInfo] = [h.wait_ready() for h in self.handles]
        except BaseException:
            for h in self.handles:  # the others may be up (or half started): stop them
                with contextlib.suppress(Exception):
                    h.kill()
                    h.join(0)
            self.close_sockets()
            raise
        self.stats: list[EngineStats] = [info.stats for info in self.infos]
        self.core_times = [(0.0, 0.0, 0.0)] * n  # per replica: seconds stepping, input, idle
        self.dead: list[str | None] = [None] * n
        self.holder: dict[str, int] = {}
        self.loads = [0] * n
        slack = max(2, config.scheduler.max_num_seqs // 64)  # 4 with the default 256
        sc = config.scheduler
        self.router = DPRouter(
            n, config.cache.block_size, par.dp_routing, balance_slack=slack, short_tokens=sc.short_request_tokens
        )
        # routing by length: output lengths learned from finished requests, as the scheduler does
        self.estimator = OutputLengthEstimator(sc.expected_output_tokens) if par.dp_routing == "length" else None
        self._lengths: dict[str, list[int]] = {}  # child id -> [prompt tokens, output tokens so far]
        # (replica, reason: dp_router.PREFIX / LOAD / ROUND_ROBIN) -> requests routed
        self.routed: collections.Counter[tuple[int, str]] = collections.Counter()

    @property
    def num_replicas(self) -> int:
        return len(self.handles)

    @property
    def total_stats(self) -> EngineStats:
        return merge_stats(self.stats)

    # -- commands -------------------------------------------------------------------------
    def add(self, children: list[EngineCoreRequest]) -> int:
        """Route one request (all its samples) to a replica and send it there."""
        if any(self.dead):
            raise EngineDeadError(f"the engine core died: {next(d for d in self.dead if d)}")
        if self.num_replicas == 1:
            i = 0
        else:
            first = children[0]
            work = None
            if self.estimator is not None:
                n_prompt = len(first.prompt_token_ids)
                out = self.estimator.expected_output(n_prompt, first.sampling_params.max_tokens)
                work = n_prompt + min(out, first.max_tokens)
                for c in children:
                    self._lengths[c.request_id] = [n_prompt, 0]
            i, reason = self.router.route(
                first.prompt_token_ids, first.cache_salt, self.loads, work,
                first.lora_request.lora_int_id if first.lora_request is not None else 0,
            )
            self.routed[i, reason] += 1
        self.send(i, CoreRequestType.ADD, children)
        for c in children:
            self.holder[c.request_id] = i
        self.loads[i] += len(children)
        return i

    def abort(self, child_ids: list[str], kind: CoreRequestType = CoreRequestType.ABORT) -> None:
        """Abort (or finish on a stop string: `kind` FINISH_STOPPED) requests wherever they run."""
        by_replica: dict[int, list[str]] = collections.defaultdict(list)
        for rid in child_ids:
            self._lengths.pop(rid, None)
            i = self.holder.pop(rid, None)
            if i is not None:
                self.loads[i] -= 1
                by_replica[i].append(rid)
        for i, ids in by_replica.items():
            if self.dead[i] is None:
                with contextlib.suppress(EngineDeadError):  # gone meanwhile: nothing left to abort
                    self.send(i, kind, ids)

    def broadcast(self, kind: CoreRequestType, payload=None) -> None:
        for i in range(self.num_replicas):
            if self.dead[i] is None:
                with contextlib.suppress(EngineDeadError):
                    self.send(i, kind, payload)
        if kind == CoreRequestType.RESET_PREFIX_CACHE:
            self.router.forget()

    def send(self, i: int, kind: CoreRequestType, payload=None, flags: int = 0) -> None:
        """Never blocks: no high-water mark while the core is connected, and NOBLOCK for when
        it is not (a PUSH socket with no peer would block the caller, the event loop, for
        ever: a dead core's commands raise EngineDeadError instead). Pickling takes
        microseconds."""
        data, sock, deadline = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL), self.inputs[i], None
        while True:
            try:
                sock.send(data, flags=flags | zmq.NOBLOCK)
                return
            except zmq.Again:  # no peer: a core that died, or one still connecting
                if not self.handles[i].is_alive() or (deadline is not None and time.monotonic() > deadline):
                    alive = self.handles[i].is_alive()
                    why = "its command socket has no peer" if alive else self.death_reason(i)
                    self.mark_dead(i, why)
                    raise EngineDeadError(f"the engine core is not reachable: {why}") from None
                deadline = deadline or time.monotonic() + CONNECT_WAIT_S
                sock.poll(50, zmq.POLLOUT)

    # -- what comes back ------------------------------------------------------------------
    def on_message(self, msg: EngineCoreOutputs) -> list[str]:
        """Book one message of replica `msg.engine_index`: its stats, times, and the
        requests it finished or refused. A fatal message marks the replica dead and
        returns the ids of the requests it held (now lost); else returns []."""
        i = msg.engine_index
        if msg.fatal is not None:
            return self.mark_dead(i, msg.fatal)
        if msg.stats is not None:
            self.stats[i] = msg.stats
        self.core_times[i] = (msg.step_seconds, msg.input_seconds, msg.idle_seconds)
        holder = self.holder
        for out in msg.outputs:
            if self.estimator is not None:
                self._learn_length(out)
            if out.finish_reason is not None and holder.pop(out.req_id, None) is not None:
                self.loads[i] -= 1
        for rid in (*msg.errors, *msg.failed):  # refused, or failed on admission
            self._lengths.pop(rid, None)
            if holder.pop(rid, None) is not None:
                self.loads[i] -= 1
        return []

    def _learn_length(self, out: EngineCoreOutput) -> None:
        lengths = self._lengths.get(out.req_id)
        if lengths is None:
            return
        lengths[1] += len(out.new_token_ids)
        if out.finish_reason is not None:
            del self._lengths[out.req_id]
            if out.finish_reason in ("stop", "length"):
                self.estimator.observe(*lengths)

    def mark_dead(self, i: int, why: str) -> list[str]:
        """Replica i is gone: returns the child ids it held (forgotten here)."""
        if self.dead[i] is None:
            self.dead[i] = why
        lost = [rid for rid, r in self.holder.items() if r == i]
        for rid in lost:
            del self.holder[rid]
            self._lengths.pop(rid, None)
        self.loads[i] = 0
        return lost

    def death_reason(self, i: int) -> str:
        code = self.handles[i].process.exitcode if self.handles[i].process is not None else None
        return (
            f"engine core {i} process exited (code {code})"
            if self.num_replicas > 1
            else f"engine core process exited (code {code})"
        )

    # -- lifecycle ------------------------------------------------------------------------
    def shutdown(self, timeout: float) -> None:
        """Ask every live replica to stop, then join them (SIGTERM, SIGKILL after `timeout`)."""
        for i, h in enumerate(self.handles):
            if self.dead[i] is None and h.is_alive():
                with contextlib.suppress(zmq.ZMQError, EngineDeadError):
                    self.send(i, CoreRequestType.SHUTDOWN)
        for h in self.handles:  # they stop concurrently: the first join waits for most of them
            h.join(timeout)

    def close_sockets(self) -> None:
        for s in self.inputs:
            s.close(0)
        if self.output is not None:
            self.output.close(0)
