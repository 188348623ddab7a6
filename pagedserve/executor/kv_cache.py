"""The paged KV cache's memory: its tensors, their size per block, and (on a GPU) how many
bytes the cache may take.

Layout, per layer: K and V of shape [num_blocks, block_size, kv_heads, head_dim] in the
KV cache dtype; block 0 is the null block (padding), never handed to a request.

With sliding-window layers the layers form KV cache groups (`KVCacheLayout`, the hybrid KV
cache manager's other half): each group holds layers of one attention kind, every group
the same number of layers ("slots", padded), and slot s of every group shares one tensor
pair. A block id belongs to one group at a time, so a block costs `num_slots` layers'
K/V, and a group's blocks are managed (freed out of the window) on their own.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.executor.model_config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 << 30  # a server commits it at start; offline, RSS grows as blocks fill


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, without touching it


def prefault(buf: mmap.mmap) -> None:
    """Commit every page of an anonymous mapping now: madvise(MADV_POPULATE_WRITE), or a
    write per page where the kernel lacks it. On the VM of BENCHMARKS section 37 committing
    2 GiB takes ~2.9 s (first touch of guest memory the host backs lazily), and an embedding
    server that faulted its KV cache in as it filled spent ~20% of its first 12 s on it."""
    try:
        buf.madvise(MADV_POPULATE_WRITE)
    except OSError:  # EINVAL before Linux 5.14
        np.frombuffer(buf, dtype=np.uint8)[:: mmap.PAGESIZE] = 0


def lazy_zeros(shape, dtype: torch.dtype, commit: bool = False) -> torch.Tensor:
    """A zeroed CPU tensor whose memory is committed page by page on first write (anonymous
    mmap), in base pages: transparent huge pages would commit (and zero) 2 MB at a time per
    tensor, which on VMs whose memory is backed lazily costs ~10x more per byte on first
    touch (measured here: prefill of 64 x 256 tokens on a fresh engine 31.3-32.7 -> 27.3 s,
    BENCHMARKS 21) and lets RSS run ahead of the blocks in use. Without mmap's
    MADV_NOHUGEPAGE (non-Linux): numpy's calloc, also lazily committed. `commit`: every page
    faulted in now instead (kv_cache_prefault; `prefault`), in base pages as well."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    if not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_NOHUGEPAGE)
    if commit:
        prefault(buf)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def zeros(shape, dtype: torch.dtype, device: torch.device, commit: bool = False) -> torch.Tensor:
    """A zeroed cache tensor: on the CPU lazily committed (unless `commit`), allocated at
    once elsewhere."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return lazy_zeros(shape, dtype, commit)


@dataclass(frozen=True)
class KVCacheLayout:
    windows: tuple[int | None, ...]  # per group: None (full attention) or its window
    group_of_layer: tuple[int, ...]
    slot_of_layer: tuple[int, ...]
    num_slots: int  # layers per group: tensor pairs allocated

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_cache_layout(cfg: ModelConfig) -> KVCacheLayout:
    """Layers grouped by attention kind (full, or one window), groups of min-count layers
    (vLLM's rule: no padding when one kind's count divides the others'). A model without
    sliding layers: one group of all layers, today's layout."""
    n = cfg.num_hidden_layers
    kinds: dict[int | None, list[int]] = {}
    for i in range(n):
        kinds.setdefault(cfg.layer_window(i), []).append(i)
    if len(kinds) == 1:
        (w,) = kinds
        return KVCacheLayout((w,), (0,) * n, tuple(range(n)), n)
    size = min(len(v) for v in kinds.values())
    windows, group, slot = [], [0] * n, [0] * n
    for w in sorted(kinds, key=lambda x: (x is not None, x or 0)):  # full attention first
        layers = kinds[w]
        for c in range(0, len(layers), size):
            for s, i in enumerate(layers[c : c + size]):
                group[i], slot[i] = len(windows), s
            windows.append(w)
    return KVCacheLayout(tuple(windows), tuple(group), tuple(slot), size)


def kv_bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one block over `num_layers` layers."""
    return 2 * num_layers * block_size * kv_heads * head_dim * dtype.itemsize


def max_useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int, num_groups: int) -> int:
    """Blocks that every sequence at full length could hold in every KV cache group, plus the
    null block: more are never allocated, whatever the byte budget."""
    return max_num_seqs * -(-max_model_len // block_size) * num_groups + 1


def allocate(
    num_layers: int, shape, dtype: torch.dtype, device: torch.device, commit: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(zeros(shape, dtype, device, commit), zeros(shape, dtype, device, commit)) for _ in range(num_layers)]


@torch.inference_mode()
def profile_gpu_kv_bytes(runner, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
    """Bytes the KV cache may take on the runner's GPU: what is left under
    `gpu_memory_utilization` of the device's memory after the weights and the activations
    of one `max_num_batched_tokens` prefill, run through the runner (with a scratch cache
    of its own block size that is freed afterwards)."""
    from pagedserve.messages import NewRequestData, SchedulerOutput
    from pagedserve.sampling_params import SamplingParams

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    n, block_size = max_num_batched_tokens, runner.block_size
    nb = -(-n // block_size) + 1
    runner.initialize_kv_cache(nb, block_size)
    scratch = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches)
    toks = [0] * n
    profile = NewRequestData(
        req_id="__profile__",
        token_ids=toks,
        num_computed_tokens=0,
        block_ids=list(range(1, nb)),
        sample=True,
        sampling_params=SamplingParams(max_tokens=1),
        prompt_token_ids=toks,
        output_token_ids=[],
    )
    runner.execute_model(SchedulerOutput([profile], n))
    runner.execute_model(SchedulerOutput([], 0, finished_req_ids={"__profile__"}))  # forget it
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - scratch
    free, total = torch.cuda.mem_get_info()
    others = (total - free) - torch.cuda.memory_reserved()  # CUDA context, other processes
    runner.kv_caches = []
    torch.cuda.empty_cache()
    budget = int(total * gpu_memory_utilization - peak - max(others, 0))
    logger.info(
        "KV cache: %.1f GiB (peak activations+weights %.1f GiB of %.1f GiB)", budget / 2**30, peak / 2**30, total / 2**30
    )
    return max(budget, 0)
