"""The front end's handle on one engine core: its ipc addresses, and the child process
(or thread) that runs the core's busy loop (`pagedserve.core.core_proc`).

Start-up goes over a multiprocessing pipe: the child answers ("ready", info) or
("error", message); `wait_ready` also notices a child that died during start-up.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import threading
import time

import zmq

from pagedserve.config import EngineConfig
from pagedserve.core.core_proc import EngineCoreProc, run_engine_core
from pagedserve.core.engine_core import CoreInfo, EngineCore

STARTUP_TIMEOUT_S = 600.0


class CoreHandle:
    """The front end's handle on an engine core running its busy loop in a child process
    (`process=True`) or in a thread of this process. Owns the ipc addresses; the clients
    open their own sockets on them (`input_addr`: bind PUSH; `output_addr`: bind PULL).
    `engine_index`: its data-parallel replica, stamped on every message it sends."""

    def __init__(self, config: EngineConfig, process: bool = True, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self._dir = tempfile.mkdtemp(prefix="pagedserve-")
        self.input_addr = f"ipc://{self._dir}/input"
        self.output_addr = f"ipc://{self._dir}/output"
        self.process: multiprocessing.process.BaseProcess | None = None
        self.thread: threading.Thread | None = None
        self._config = config
        self._as_process = process
        self.info: CoreInfo | None = None

    def bind(
        self, input_ctx: zmq.Context, output_ctx: zmq.Context, outputs: zmq.Socket | None = None
    ) -> tuple[zmq.Socket, zmq.Socket]:
        """The front end's two sockets, bound before `start()`: a PUSH for commands (no
        high-water mark: sends never block) and a PULL for the core's outputs (`outputs`:
        an existing PULL, that of other replicas, bound to this core's address too)."""
        commands = input_ctx.socket(zmq.PUSH)
        commands.setsockopt(zmq.SNDHWM, 0)
        commands.bind(self.input_addr)
        if outputs is None:
            outputs = output_ctx.socket(zmq.PULL)
        outputs.bind(self.output_addr)
        return commands, outputs

    def start(self) -> CoreInfo:
        """Start the core once the caller has bound its sockets; returns when it is ready."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """`start()`'s first half: spawn the process (in this thread: a child dies with the
        thread that started it) or, for a thread, start the core completely. Several
        replicas launch, then wait, so that their start-ups overlap."""
        if not self._as_process:
            core = EngineCore(self._config)
            self.info = core.info()
            loop = EngineCoreProc(core, self.input_addr, self.output_addr, None, self.engine_index)
            name = f"pagedserve-engine-core-{self.engine_index}"
            self.thread = threading.Thread(target=loop.run, name=name, daemon=True)
            self.thread.start()
            return
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        self._ready_pipe = parent
        self.process = ctx.Process(
            target=run_engine_core,
            args=(self._config, self.input_addr, self.output_addr, os.getpid(), child, self.engine_index),
            name=f"pagedserve-engine-core-{self.engine_index}",
            daemon=True,
        )
        self.process.start()
        child.close()

    def wait_ready(self) -> CoreInfo:
        """`start()`'s second half: wait for the launched core's ("ready", info)."""
        if self.process is None:
            assert self.info is not None, "launch() first"
            return self.info
        parent = self._ready_pipe
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not parent.poll(0.1):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine core process exited during start-up (exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"the engine core did not start within {STARTUP_TIMEOUT_S:.0f} s")
        kind, payload = parent.recv()
        parent.close()
        if kind == "error":
            self.process.join(10)
            raise RuntimeError(f"the engine core failed to start: {payload}")
        self.info = payload
        return payload

    @property
    def sentinel(self) -> int | None:
        """A handle that becomes ready when the core process ends (None: a thread)."""
        return self.process.sentinel if self.process is not None else None

    def is_alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        return self.thread is not None and self.thread.is_alive()

    def join(self, timeout: float) -> None:
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.terminate()  # its SIGTERM handler exits at once
                self.process.join(1.0)
            if self.process.is_alive():
                self.kill()
        elif self.thread is not None:
            self.thread.join(timeout)
        shutil.rmtree(self._dir, ignore_errors=True)

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(5)
