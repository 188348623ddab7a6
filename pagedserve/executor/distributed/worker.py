"""One tensor-parallel rank: joins the process group, builds its ModelRunner over its shard,
then runs the calls the executor broadcasts until told to stop.

Local ranks (on the executor's machine, started by MultiprocExecutor) read each call from
the shared-memory ring and answer over their own pipe (rank 0 answers `execute_model`; all
answer the sizing calls). Ranks on other machines are started by hand with torchrun's
variables and no model flags:

    MASTER_ADDR=<head> MASTER_PORT=29500 WORLD_SIZE=4 RANK=2 [LOCAL_RANK=0] \
        python -m pagedserve.executor.distributed.worker

They receive their WorkerSpec from rank 0 after the rendezvous, and each call through
torch.distributed (`broadcast_object_list` over a gloo group of rank 0 and the remote
ranks: rank 0 relays what it read from the ring). Every rank runs the same forward and
samples from the same all-gathered logits with the same seeds, so tokens agree on every
rank (`PAGEDSERVE_TP_CHECK_TOKENS=1` checks it each step). A rank whose call fails
reports the error (local ranks over their pipe) and exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedserve import envs
from pagedserve.executor.distributed import parallel_state as ps
from pagedserve.executor.model_config import ModelConfig

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"


@dataclass
class WorkerSpec:
    """Everything a rank needs to build its shard (plain data: it is pickled to the ranks)."""

    model_path: str
    model_config: ModelConfig
    world_size: int
    num_local: int  # ranks [0, num_local) on the executor's machine, the rest remote
    backend: str  # "gloo" | "nccl"
    device: str  # "cpu" | "cuda"
    runner_kwargs: dict = field(default_factory=dict)  # dtype, seed, load_format, quantization, ...
    ring: tuple | None = None  # ShmRing handle (local ranks)
    num_threads: int = 1
    check_tokens: bool = False


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (no orphans)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Worker:
    """The calls a rank answers; `execute_model` returns rank 0's ModelRunnerOutput."""

    def __init__(self, spec: WorkerSpec, rank: int, local_rank: int) -> None:
        from pagedserve.executor.model_runner import ModelRunner

        self.spec, self.rank = spec, rank
        device = f"cuda:{local_rank}" if spec.device.startswith("cuda") else spec.device
        self.runner = ModelRunner(spec.model_path, spec.model_config, device=device, **spec.runner_kwargs)
        self.control = None  # gloo group over all ranks, for the token check
        self.busy_seconds = 0.0  # inside execute_model (the rest of a step is dispatch)

    def info(self) -> dict:
        from pagedserve.executor.quant.layers import QuantLinear

        r = self.runner
        packed = sum(isinstance(m, QuantLinear) for m in r.model.modules())
        return {"dtype": str(r.dtype).removeprefix("torch."), "device": str(r.device), "pid": os.getpid(), "packed_layers": packed}

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.runner.kv_bytes_per_block(block_size)

    def determine_available_kv_memory(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        return self.runner.determine_available_kv_memory(gpu_memory_utilization, max_num_batched_tokens)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.runner.initialize_kv_cache(num_blocks, block_size)

    def comm_stats(self, reset: bool = False) -> dict:
        """Seconds inside collectives and their count, and seconds inside execute_model."""
        out = ps.comm_stats(reset) | {"busy_seconds": self.busy_seconds}
        if reset:
            self.busy_seconds = 0.0
        return out

    def bench_all_reduce(self, numels: list[int], iters: int = 50) -> dict[int, float]:
        """Median seconds of one all-reduce of `numel` elements (model dtype), ranks lined
        up by a barrier first: the collective's own cost, without waiting for a late rank."""
        out = {}
        for n in numels:
            x = torch.zeros(n, dtype=self.runner.dtype, device=self.runner.device)
            times = []
            for _ in range(iters):
                dist.barrier()
                t = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t)
            out[n] = sorted(times)[len(times) // 2]
        return out

    def execute_model(self, scheduler_output):
        t = time.perf_counter()
        out = self.runner.execute_model(scheduler_output)
        self.busy_seconds += time.perf_counter() - t
        if self.spec.check_tokens:
            mine = (out.sampled_token_ids, out.spec_token_ids)
            every = [None] * self.spec.world_size
            dist.all_gather_object(every, mine, group=self.control)
            bad = [r for r, o in enumerate(every) if o != every[0]]
            if bad:
                raise RuntimeError(f"sampled tokens differ between rank 0 and rank(s) {bad}")
        return out


def _setup(spec: WorkerSpec, rank: int, local_rank: int):
    """Process group, relay group, runner (every rank calls new_group in the same order)."""
    torch.set_num_threads(spec.num_threads)
    remote = list(range(spec.num_local, spec.world_size))
    forever = timedelta(days=365)  # an idle engine sends nothing for as long as it likes
    relay = dist.new_group([0, *remote], backend="gloo", timeout=forever) if remote else None
    control = dist.new_group(backend="gloo") if spec.check_tokens else None
    worker = Worker(spec, rank, local_rank)
    worker.control = control
    return worker, relay


def _call(worker: Worker, msg):
    _, method, args = msg
    return getattr(worker, method)(*args)


def run_local_worker(
    spec: WorkerSpec, rank: int, master_addr: str, master_port: int, conn, parent_pid: int, pdeathsig: bool
) -> None:
    """Entry point of a rank started by MultiprocExecutor on its own machine. `pdeathsig`:
    the parent started us from its main thread (PR_SET_PDEATHSIG fires when the creating
    *thread* ends, so from another thread only the parent-pid check while idle applies)."""
    if pdeathsig:
        die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when to stop
    from pagedserve.executor.distributed.shm_ring import ShmRing

    def parent_alive() -> None:
        if os.getppid() != parent_pid:
            os._exit(1)

    try:
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(rank)  # before NCCL sees the process
        ps.init_tensor_parallel(rank, spec.world_size, spec.backend, master_addr, master_port)
        if spec.num_local < spec.world_size:
            # the remote ranks learn the spec from rank 0 (they were started without flags);
            # a collective: every rank takes part
            dist.broadcast_object_list([spec if rank == 0 else None], src=0, group=_bootstrap_group())
        worker, relay = _setup(spec, rank, rank)
        ring = ShmRing(*spec.ring[:3], name=spec.ring[3], reader=rank)
        conn.send(("ready", rank, worker.info()))
    except BaseException as e:  # noqa: BLE001 (reported to the executor)
        _report(conn, rank, e)
        return
    try:
        while True:
            msg = ring.dequeue(on_wait=parent_alive)
            if relay is not None and rank == 0:  # other local ranks are not in the relay group
                dist.broadcast_object_list([msg], src=0, group=relay)
            if msg[0] == SHUTDOWN:
                break
            result = _call(worker, msg)
            if rank == 0 or msg[0] == "call_all":
                conn.send(("ok", rank, result))
    except BaseException as e:  # noqa: BLE001
        _report(conn, rank, e)
        os._exit(1)  # peers may be stuck in a collective with us; the executor ends them
    finally:
        ring.close()
    ps.destroy_tensor_parallel()
    _exit_now(0)


def _exit_now(code: int) -> None:
    """Leave without the interpreter's finalization (it takes seconds after torch and the
    OpenMP thread team; there is nothing left to save)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _bootstrap_group():
    return dist.new_group(backend="gloo")


def _report(conn, rank: int, e: BaseException) -> None:
    logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
    with contextlib.suppress(Exception):
        conn.send(("error", rank, f"{type(e).__name__}: {e}"))


def run_remote_worker() -> int:
    """A rank on another machine: torchrun's environment variables, no model flags."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    backend = envs.PAGEDSERVE_TP_BACKEND or ps.default_backend(
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    ps.init_tensor_parallel(rank, world, backend)
    box = [None]
    dist.broadcast_object_list(box, src=0, group=_bootstrap_group())
    spec: WorkerSpec = box[0]
    if not os.path.exists(spec.model_path):
        raise FileNotFoundError(f"rank {rank}: model directory {spec.model_path!r} is not on this machine")
    spec.num_threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    worker, relay = _setup(spec, rank, local_rank)
    logger.info("tensor-parallel rank %d of %d ready (%s)", rank, world, worker.info())
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=relay)
        msg = box[0]
        if msg[0] == SHUTDOWN:
            break
        _call(worker, msg)
    ps.destroy_tensor_parallel()
    return 0


if __name__ == "__main__":
    _exit_now(run_remote_worker())
