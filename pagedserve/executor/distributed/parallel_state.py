"""The tensor-parallel process group and the collectives the model uses.

One group: every rank of the job is a tensor-parallel rank (no pipeline or data
parallelism inside one engine), so the TP group is the default (world) group.
Rendezvous is torch.distributed's `env://`: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, as
under torchrun, so ranks on several machines join the same way as local ones.

Invariant: before `init_tensor_parallel` (or after `destroy`) the world size is 1 and the
collectives return their input untouched, so single-process code paths pay nothing.
Each collective's wall time is added to `comm_seconds` (per-step communication cost).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_COMM = {"seconds": 0.0, "calls": 0}


def init_tensor_parallel(
    rank: int,
    world_size: int,
    backend: str,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Join the process group through `env://` rendezvous. master_addr/master_port, when
    given, are written to the environment first (local ranks); otherwise the environment
    must already hold them (torchrun, or the user on another machine)."""
    global _TP_RANK, _TP_SIZE
    if master_addr is not None:
        os.environ["MASTER_ADDR"] = master_addr
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"tensor parallelism needs {var} in the environment (env:// rendezvous)")
    dist.init_process_group(
        backend=backend, init_method="env://", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    _TP_RANK, _TP_SIZE = rank, world_size


def destroy_tensor_parallel() -> None:
    global _TP_RANK, _TP_SIZE
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE = 0, 1


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_world_size() -> int:
    return _TP_SIZE


def default_backend(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks (in place); x itself at world size 1."""
    if _TP_SIZE == 1:
        return x
    t = time.perf_counter()
    dist.all_reduce(x)
    _COMM["seconds"] += time.perf_counter() - t
    _COMM["calls"] += 1
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' x concatenated along `dim` (rank order); x itself at world size 1."""
    if _TP_SIZE == 1:
        return x
    t = time.perf_counter()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x)
    out = torch.cat(parts, dim=dim)
    _COMM["seconds"] += time.perf_counter() - t
    _COMM["calls"] += 1
    return out


def comm_stats(reset: bool = False) -> dict:
    """{"seconds": time inside collectives, "calls": how many} since the last reset."""
    out = dict(_COMM)
    if reset:
        _COMM["seconds"], _COMM["calls"] = 0.0, 0
    return out
