"""The engine core's busy loop behind ZMQ, in its own process (or a thread).

Transport: two ZMQ PUSH/PULL pipes over ipc:// sockets that the front end binds, pickled
plain messages (`messages.CoreRequestType` commands in, `EngineCoreOutputs` out). The
loop drains its input without blocking whenever it has work, runs a step, sends that
step's outputs and stats, and blocks on the input only when idle. It never waits on the
front end while requests are running.

Start-up goes over a multiprocessing pipe: the child answers ("ready", info) or
("error", message). A child whose parent dies exits (PR_SET_PDEATHSIG where available,
and a parent-pid check whenever idle), so no orphan is left behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import time
from multiprocessing.connection import Connection

import zmq

from pagedserve import envs
from pagedserve.config import EngineConfig
from pagedserve.core.engine_core import EngineCore
from pagedserve.messages import CoreRequestType, EngineCoreOutputs

logger = logging.getLogger(__name__)

IO_POLL_MS = 20  # idle with disk-tier I/O in flight: look again this often
MAX_SNAPSHOT_SHARE = 0.005  # live-view snapshots take at most 0.5% of the core loop's time


class EngineCoreProc:
    """Runs an EngineCore's loop, fed and drained over ZMQ."""

    def __init__(
        self, core: EngineCore, input_addr: str, output_addr: str, parent_pid: int | None, engine_index: int = 0
    ) -> None:
        self.core = core
        self.engine_index = engine_index  # data parallelism: tags every message this core sends
        # tests: "<index>:<seconds>" makes replica <index> sleep that long after each step
        slow = envs.PAGEDSERVE_TEST_SLOW_ENGINE
        self.step_delay = float(slow.split(":")[1]) if slow.split(":")[0] == str(engine_index) else 0.0
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.connect(output_addr)
        self.parent_pid = parent_pid
        self.step_seconds = self.input_seconds = self.idle_seconds = 0.0
        self.failed: dict[str, str] = {}  # requests that failed on admission, for the next message
        # live-view snapshots (core/snapshot.py): at most one per interval, and never
        # more than MAX_SNAPSHOT_SHARE of the loop's time (the interval stretches if needed)
        self.snapshot_interval = core.config.observability.snapshot_interval_ms / 1e3
        self.snapshot_seconds = 0.0  # time spent taking and pickling snapshots
        self._snap_due = 0.0
        self._snap_dirty = self.snapshot_interval > 0

    def run(self) -> None:
        core, poll, recv = self.core, self.input.poll, self.input.recv
        try:
            while True:
                t0 = time.perf_counter()
                if not core.has_unfinished_requests():
                    if core.on_idle():  # the executor's health; the KV audit once per idle period
                        self._send([], {})  # an audit failure or tier I/O done: the stats carry it
                    if not poll(self._idle_poll_ms()):  # idle: block for input, checking on the parent
                        self.idle_seconds += time.perf_counter() - t0
                        if self.parent_pid is not None and os.getppid() != self.parent_pid:
                            return
                        if self._snap_dirty and time.perf_counter() >= self._snap_due:
                            self._send([], {})  # the state the last step left, once
                        continue
                    t1 = time.perf_counter()
                    self.idle_seconds += t1 - t0
                    t0 = t1
                errors: dict[str, str] = {}
                handled = False
                while True:
                    try:
                        kind, payload = pickle.loads(recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    if kind == CoreRequestType.SHUTDOWN:
                        return
                    self._handle(kind, payload, errors)
                    handled = True
                t1 = time.perf_counter()
                self.input_seconds += t1 - t0
                if core.has_unfinished_requests():
                    outputs = core.step()
                    if self.step_delay:
                        time.sleep(self.step_delay)
                    self.step_seconds += time.perf_counter() - t1
                    self._send(outputs, errors)
                elif handled:  # aborts and refusals while idle: report the state they left
                    self._send([], errors)
        except Exception as e:  # an executor fault: tell the front end, then stop
            logger.exception("engine core loop failed")
            with contextlib.suppress(Exception):
                msg = EngineCoreOutputs([], fatal=f"{type(e).__name__}: {e}", engine_index=self.engine_index)
                self.output.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
            raise
        finally:
            self.core.shutdown()
            self.input.close(0)
            self.output.close(linger=1000)  # let the last message out
            self.ctx.term()

    def _handle(self, kind: int, payload, errors: dict[str, str]) -> None:
        core = self.core
        if kind == CoreRequestType.ADD:
            added = []
            try:
                for req in payload:
                    core.add_request(req)
                    added.append(req.request_id)
            except ValueError as e:  # the input processor checks first; this is a safety net
                core.abort_requests(added)
                for req in payload:
                    errors[req.request_id] = str(e)
            except Exception as e:  # noqa: BLE001 (a bug admitting this request: it fails alone)
                logger.exception(
                    "admitting request %s failed; it is refused", payload[0].request_id if payload else "?"
                )
                core.abort_requests(added)
                for req in payload:
                    self.failed[req.request_id] = f"admitting the request failed: {type(e).__name__}: {e}"
        elif kind == CoreRequestType.ABORT:
            core.abort_requests(payload)
        elif kind == CoreRequestType.FINISH_STOPPED:
            core.finish_requests_stopped(payload)
        elif kind == CoreRequestType.RESET_PREFIX_CACHE:
            core.reset_prefix_cache()
        elif kind == CoreRequestType.REMOVE_LORA:
            core.remove_lora(payload)

    def _idle_poll_ms(self) -> int:
        if self.core.io_pending():  # the disk tier is still writing: report when it is done
            return IO_POLL_MS
        if not self._snap_dirty:
            return 1000
        return max(1, min(1000, int((self._snap_due - time.perf_counter()) * 1e3) + 1))

    def _send(self, outputs, errors) -> None:
        msg = EngineCoreOutputs(
            outputs,
            self.core.get_stats(),
            errors,
            self.step_seconds,
            self.input_seconds,
            self.idle_seconds,
            engine_index=self.engine_index,
        )
        if self.failed:
            msg.failed, self.failed = self.failed, {}
        if not self.snapshot_interval:
            self.output.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), copy=False)
            return
        t0 = time.perf_counter()
        self._snap_dirty = True
        if t0 < self._snap_due:
            self.output.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), copy=False)
            return
        msg.snapshot = self.core.snapshot()
        msg.snapshot["cost_s"] = time.perf_counter() - t0
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        cost = time.perf_counter() - t0
        self.snapshot_seconds += cost
        self._snap_due = t0 + max(self.snapshot_interval, cost / MAX_SNAPSHOT_SHARE)
        self._snap_dirty = False
        self.output.send(data, copy=False)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (no orphans)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _place_replica(config: EngineConfig, engine_index: int) -> None:
    """Data parallelism: replicas share the CPU cores (cores / M threads each) instead of
    each claiming all of them; on GPUs (without tensor parallelism, whose workers pick
    their own), replica i's current device is cuda:(i mod devices). Replicas sharing a
    device need a fixed KV size: profiling (gpu_memory_utilization) counts the other
    replica's memory as taken, and the two start at the same time."""
    import torch

    dp = config.parallel.data_parallel_size
    threads = envs.PAGEDSERVE_NUM_THREADS  # the operator's choice wins
    torch.set_num_threads(threads or max(1, len(os.sched_getaffinity(0)) // dp))
    if engine_index > 0:  # the live view shows replica 0: the others keep no step records
        config.observability.snapshot_interval_ms = 0
    if config.observability.step_log:  # one file per replica: two processes' lines would interleave
        config.observability.step_log += f".dp{engine_index}"
    mc, cc = config.model, config.cache
    on_gpu = mc.device in ("auto", "cuda") and config.parallel.tensor_parallel_size == 1
    if on_gpu and torch.cuda.is_available():
        n = torch.cuda.device_count()
        torch.cuda.set_device(engine_index % n)  # "cuda" means this device from now on
        if n < dp and cc.num_kv_blocks is None and cc.kv_cache_memory_bytes is None:
            raise ValueError(
                f"data_parallel_size={dp} on {n} GPU(s): replicas share a device, so set "
                "num_kv_blocks or kv_cache_memory_bytes (each replica's KV cache)."
            )


def run_engine_core(
    config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int, conn: Connection, engine_index: int = 0
) -> None:
    """The engine-core process's entry point (`engine_index`: its data-parallel replica)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when to stop
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        if config.parallel.data_parallel_size > 1:
            _place_replica(config, engine_index)
        core = EngineCore(config)
        loop = EngineCoreProc(core, input_addr, output_addr, parent_pid, engine_index)  # connects its sockets
        conn.send(("ready", core.info()))
    except BaseException as e:  # noqa: BLE001 (reported to the front end)
        logger.exception("engine core failed to start")
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    finally:
        conn.close()
    loop.run()
