"""MultiprocExecutor: tensor parallelism over N worker processes, one shard each.

All N ranks live in workers (as vLLM v1's MultiprocExecutor): the engine core's process
holds no process group and never enters a collective, so it can always watch the workers.
Each call (`execute_model`, the KV sizing calls) is written once to a shared-memory ring
(`shm_ring.ShmRing`) that every local rank reads; rank 0 relays it to ranks on other
machines through torch.distributed. Rank 0 returns the step's ModelRunnerOutput over its
pipe; the sizing calls are answered by every local rank (the smallest KV budget wins; all
ranks hold the same number of blocks, each of its own KV heads).

Failures: the executor waits on the workers' pipes and process sentinels together, so a
worker that dies (or reports an error) is noticed at once, mid-step or at the next call;
the executor then ends the other workers and raises `WorkerDiedError` naming the rank.
Workers die with the engine's process (PR_SET_PDEATHSIG when started from the main thread,
a parent check while idle, multiprocessing's daemon clean-up), so no process is left behind.

Local ranks: all N by default; `PAGEDSERVE_LOCAL_TP_RANKS=M` starts ranks [0, M) here and
waits for ranks [M, N) to join from other machines (README, "Tensor parallelism").
Rendezvous: MASTER_ADDR (default 127.0.0.1) and MASTER_PORT (default: a free port).
Spawned workers re-import the caller's main module: scripts need the usual
`if __name__ == "__main__":` guard, as with any multiprocessing spawn.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import threading
import time
from multiprocessing.connection import wait

from pagedserve import envs
from pagedserve.config import EngineConfig
from pagedserve.executor.distributed import parallel_state as ps
from pagedserve.executor.distributed.sharding import check_divisible
from pagedserve.executor.distributed.shm_ring import ShmRing
from pagedserve.executor.distributed.worker import SHUTDOWN, WorkerSpec, run_local_worker
from pagedserve.executor.executor import Executor
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.quant.copy_budget import CopyPolicy
from pagedserve.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank died or failed; the message names it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _children_allowed():
    """multiprocessing refuses children to a daemon process, and the engine core's own
    process is one (core/core_proc.py). Our workers are daemons themselves and die with
    their parent (PR_SET_PDEATHSIG), so the refusal is lifted while they start."""
    cfg = multiprocessing.current_process()._config  # noqa: SLF001
    was = cfg.get("daemon", False)
    cfg["daemon"] = False
    try:
        yield
    finally:
        cfg["daemon"] = was


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_path: str, model_config: ModelConfig, device: str) -> None:
        tp = config.parallel.tensor_parallel_size
        check_divisible(model_config, tp)
        spec_cfg = config.speculative
        if spec_cfg is not None and spec_cfg.method != "ngram":  # a draft model is not sharded
            raise NotImplementedError(
                f"speculative method {spec_cfg.method!r} with tensor_parallel_size={tp}: only 'ngram' is supported"
            )
        mc = config.model
        self.model_config = model_config
        self.world_size = tp
        self.num_local = envs.PAGEDSERVE_LOCAL_TP_RANKS or tp
        if not 1 <= self.num_local <= tp:
            raise ValueError(f"PAGEDSERVE_LOCAL_TP_RANKS={self.num_local} must be in [1, {tp}]")
        cores = len(os.sched_getaffinity(0))
        spec = WorkerSpec(
            model_path=model_path,
            model_config=model_config,
            world_size=tp,
            num_local=self.num_local,
            backend=envs.PAGEDSERVE_TP_BACKEND or ps.default_backend(device),
            device="cuda" if device.startswith("cuda") else device,
            runner_kwargs=dict(
                dtype=mc.dtype,
                seed=mc.seed,
                load_format=mc.load_format,
                enforce_eager=True,  # no CUDA graphs around collectives (not verified on a GPU)
                quantization=mc.quantization,  # packed GGUF blocks shard too
                kv_cache_dtype=config.cache.kv_cache_dtype,
                kv_cache_prefault=config.cache.kv_cache_prefault,
                block_size=config.cache.block_size,
                weight_copies=CopyPolicy.of_engine(config, model_config, self.num_local),
            ),
            num_threads=max(1, cores // self.num_local),
            check_tokens=envs.PAGEDSERVE_TP_CHECK_TOKENS,
        )
        self.failed: str | None = None
        self.ring = ShmRing(self.num_local)
        spec.ring = self.ring.handle()
        master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        master_port = int(os.environ.get("MASTER_PORT") or _free_port())
        ctx = multiprocessing.get_context("spawn")
        main_thread = threading.current_thread() is threading.main_thread()
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns = []
        with _children_allowed():
            for rank in range(self.num_local):
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=run_local_worker,
                    args=(spec, rank, master_addr, master_port, send, os.getpid(), main_thread),
                    name=f"pagedserve-tp-rank{rank}",
                    daemon=True,
                )
                p.start()
                send.close()
                self.procs.append(p)
                self.conns.append(recv)
        try:
            infos = self._gather(range(self.num_local), "start-up", timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self.worker_info = infos  # per local rank: pid, dtype, device, packed_layers
        self.pids = [i["pid"] for i in infos]
        self.dtype_name = infos[0]["dtype"]
        self.device = infos[0]["device"]
        logger.info("tensor parallelism: %d ranks (%d here), pids %s", tp, self.num_local, self.pids)

    # -- talking to the ranks -------------------------------------------------------------
    def _fail(self, message: str) -> None:
        self.failed = message
        self._end_workers(grace=0.0)
        raise WorkerDiedError(message)

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise WorkerDiedError(self.failed)
        for rank, p in enumerate(self.procs):
            if not p.is_alive():
                self._fail(f"tensor-parallel worker rank {rank} (pid {p.pid}) died (exit code {p.exitcode})")

    def check_health(self) -> None:
        """WorkerDiedError naming the rank if a worker process is gone (the idle core loop
        calls this, so a rank that dies between requests is seen within a second)."""
        self._check_alive()

    def _died(self, rank: int) -> str:
        """What happened to a rank whose process ended: its own last error if it sent one."""
        p, conn = self.procs[rank], self.conns[rank]
        p.join(0.5)
        code = p.exitcode
        how = f"exit code {code}" if code is None or code >= 0 else f"killed by signal {-code}"
        with contextlib.suppress(EOFError, OSError):
            while conn.poll():
                kind, _, payload = conn.recv()
                if kind == "error":
                    return f"tensor-parallel rank {rank} failed: {payload} (pid {p.pid}, {how})"
        return f"tensor-parallel worker rank {rank} (pid {p.pid}) died ({how})"

    def _gather(self, ranks, what: str, timeout: float | None = None) -> list:
        """The answers of `ranks` (in rank order), watching every worker meanwhile."""
        pending = {self.conns[r]: r for r in ranks}
        results: dict[int, object] = {}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        others = {c: r for r, c in enumerate(self.conns) if c not in pending}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._fail(f"tensor-parallel ranks {sorted(pending.values())} did not answer {what} in {timeout:.0f} s")
            ready = wait([*pending, *others, *by_sentinel], left)
            dead = [by_sentinel[s] for s in ready if s in by_sentinel]
            if dead:
                self._fail(self._died(min(dead)))
            for c in ready:
                rank = pending.get(c, others.get(c))
                try:
                    kind, _, payload = c.recv()
                except (EOFError, OSError):
                    self._fail(self._died(rank))
                if kind == "error":
                    # a peer's death often surfaces first as a collective error on rank 0:
                    # name the dead rank when there is one
                    time.sleep(0.2)
                    dead = [r for r, p in enumerate(self.procs) if r != rank and not p.is_alive()]
                    if dead:
                        self._fail(self._died(dead[0]))
                    self._fail(f"tensor-parallel rank {rank} failed during {what}: {payload}")
                results[rank] = payload
                pending.pop(c, None)
        return [results[r] for r in sorted(results)]

    def _call(self, method: str, *args, all_ranks: bool = False):
        self._check_alive()
        self.ring.enqueue(("call_all" if all_ranks else "call", method, args), on_wait=self._check_alive)
        out = self._gather(range(self.num_local) if all_ranks else [0], method)
        return out if all_ranks else out[0]

    # -- the Executor interface -----------------------------------------------------------
    def kv_bytes_per_block(self, block_size: int) -> int:
        return max(self._call("kv_bytes_per_block", block_size, all_ranks=True))

    def determine_available_kv_memory(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        budgets = self._call(
            "determine_available_kv_memory", gpu_memory_utilization, max_num_batched_tokens, all_ranks=True
        )
        return min(budgets)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._call("initialize_kv_cache", num_blocks, block_size, all_ranks=True)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", scheduler_output)

    def comm_stats(self, reset: bool = False) -> list[dict]:
        """Per local rank: seconds inside collectives and their count (since the last reset)."""
        return self._call("comm_stats", reset, all_ranks=True)

    def shutdown(self) -> None:
        if getattr(self, "ring", None) is None:
            return
        if self.failed is None and all(p.is_alive() for p in self.procs):
            with contextlib.suppress(Exception):
                self.ring.enqueue((SHUTDOWN,), timeout=2.0)
        self._end_workers(grace=5.0)
        for c in self.conns:
            c.close()
        self.ring.close(unlink=True)
        self.ring = None

    def _end_workers(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()
