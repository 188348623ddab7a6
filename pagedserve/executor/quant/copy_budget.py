"""How much memory a CPU engine's weight copies may take.

A packed GGUF layer may keep two copies of its weights beside the packed blocks, for speed
(quant/layers.py): the row-interleaved copy of the few-row kernel (batch-1 decode; the same
bytes again for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0, +2% to +30% more for the K-quants) and, in a bfloat16
engine on a native-bf16 CPU, a bf16 copy for oneDNN's many-row products (prefill, batched
decode) at 2 bytes a weight. On an 8 B model in llama.cpp's Q4_K_M (4.9 GB packed) the bf16
copies alone are 16 GB: kept unconditionally, they would push a machine that holds the model
comfortably into swap or the OOM killer.

Policies (`weight_copies`): "all" keeps every copy that applies (what the model needs,
whatever it costs); "none" keeps none (the packed blocks alone, llama.cpp's footprint);
"auto" (the default) keeps copies while they fit in the memory this process may still take
(host_memory.available_bytes, cgroup-aware) less what it will need later: the KV cache that is
not allocated yet and a fixed headroom for activations. When several engine processes load on
one host at once (tensor-parallel ranks, data-parallel replicas), each counts its share of the
free memory.

Invariants: the row-interleaved copies are offered first (the most speed per byte), then the
bf16 copies, each layer in model order; a copy is made only if it fits in what is left,
counting the transient of its making (a bf16 copy: twice its size, the plain weight and its
packed layout); a layer without a copy runs its products on the packed blocks (correct, slower);
the budget is read once, after the packed weights are resident.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pagedserve.config import WEIGHT_COPY_POLICIES, EngineConfig
from pagedserve.executor import host_memory, kv_cache
from pagedserve.executor.dtypes import resolve_dtype, resolve_kv_dtype
from pagedserve.executor.model_config import ModelConfig

logger = logging.getLogger(__name__)

HEADROOM_BYTES = 2 << 30  # activations of the largest step, oneDNN primitives, the runtime's growth


def kv_reserve_bytes(config: EngineConfig, model_config: ModelConfig) -> int:
    """Bytes of the KV cache a CPU engine of `config` will allocate after loading (one rank's)."""
    cc, sc, mc = config.cache, config.scheduler, model_config
    cpu = torch.device("cpu")
    kv_dtype = resolve_kv_dtype(cc.kv_cache_dtype, resolve_dtype(config.model.dtype, mc, cpu), cpu)
    layout = kv_cache.kv_cache_layout(mc)
    heads = max(1, mc.num_key_value_heads // config.parallel.tensor_parallel_size)
    per_block = kv_cache.kv_bytes_per_block(layout.num_slots, cc.block_size, heads, mc.head_dim, kv_dtype)
    if cc.num_kv_blocks is not None:
        return cc.num_kv_blocks * per_block
    budget = cc.kv_cache_memory_bytes if cc.kv_cache_memory_bytes is not None else kv_cache.DEFAULT_CPU_KV_BYTES
    drafts_kv = config.speculative is not None and config.speculative.method == "draft_model"
    if sc.max_model_len is None or drafts_kv:  # (a draft model's K/V rides on every block)
        return budget
    useful = kv_cache.max_useful_blocks(sc.max_num_seqs, sc.max_model_len, cc.block_size, layout.num_groups)
    return min(budget, useful * per_block)


@dataclass(frozen=True)
class CopyPolicy:
    """What a model load may keep beside the packed weights. `reserve_bytes`: memory this
    process will take after loading (its KV cache; default the CPU's default cache);
    `processes`: engine processes loading on this host at once, which share its free memory."""

    mode: str = "auto"
    reserve_bytes: int = kv_cache.DEFAULT_CPU_KV_BYTES
    processes: int = 1

    def __post_init__(self) -> None:
        if self.mode not in WEIGHT_COPY_POLICIES:
            raise ValueError(f"weight_copies must be one of {WEIGHT_COPY_POLICIES}, got {self.mode!r}.")

    @classmethod
    def of_engine(cls, config: EngineConfig, model_config: ModelConfig, local_ranks: int = 1) -> CopyPolicy:
        """An engine's policy: its replicas' and `local_ranks`' processes, and as the reserve
        the KV cache its core will allocate (engine_core._num_kv_blocks): the user's blocks,
        else the user's bytes or the CPU default, at most what every sequence at full length
        could fill; blocks at the KV dtype the runner will resolve, a rank's share of the KV
        heads. (A draft model's own K/V beside each block is not counted.)"""
        processes = config.parallel.data_parallel_size * local_ranks
        return cls(config.model.weight_copies, kv_reserve_bytes(config, model_config), processes)

    def budget(self) -> CopyBudget:
        """The budget from the memory free now (read once: call it after the packed weights
        load); the heap's free pages (loading's temporaries) go back to the OS first."""
        if self.mode != "auto":
            return CopyBudget(None if self.mode == "all" else 0)
        host_memory.release_free_memory()
        free = host_memory.available_bytes() // max(1, self.processes)
        left = max(0, free - self.reserve_bytes - HEADROOM_BYTES)
        return CopyBudget(left, free=free, reserve=self.reserve_bytes)


@dataclass
class CopyBudget:
    """Bytes the copies may still take (`left`; None: no bound), and what was kept and left out,
    per kind of copy, for the log."""

    left: int | None
    free: int | None = None
    reserve: int = 0
    kept: dict[str, list[int]] = field(default_factory=dict)  # kind: [layers, bytes]
    refused: dict[str, list[int]] = field(default_factory=dict)

    def take(self, kind: str, nbytes: int, transient: int = 0) -> bool:
        """Whether a copy of `nbytes` (whose making needs `transient` more for a moment) is
        kept; if so its bytes leave the budget."""
        if self.left is not None and nbytes + transient > self.left:
            _count(self.refused, kind, nbytes)
            return False
        if self.left is not None:
            self.left -= nbytes
        _count(self.kept, kind, nbytes)
        return True

    def give_back(self, nbytes: int) -> None:
        """Bytes freed after a copy was kept (gguf_q8's packed rows that it replaced): later
        copies may take them."""
        if self.left is not None:
            self.left += nbytes

    def log(self) -> None:
        """One line of what was kept; a warning naming the setting when copies were left out."""
        if not self.kept and not self.refused:
            return
        gib = 2**30
        kept = ", ".join(f"{k} {n} layers {_size(b)}" for k, (n, b) in self.kept.items()) or "none"
        if not self.refused:
            logger.info("weight copies kept beside the packed blocks: %s", kept)
            return
        refused = ", ".join(f"{k} {n} layers {_size(b)}" for k, (n, b) in self.refused.items())
        if self.free is None:  # weight_copies="none"
            logger.info("weight copies: none kept (weight_copies='none'; these would apply: %s)", refused)
            return
        logger.warning(
            "weight copies: kept %s; left out for want of memory %s (free %.2f GiB less the KV cache's %.2f "
            "and %.2f headroom). Those layers run on the packed blocks (slower prefill / decode); "
            "weight_copies='all' keeps them anyway; a smaller kv_cache_memory_bytes or more free memory keeps more.",
            kept,
            refused,
            (self.free or 0) / gib,
            self.reserve / gib,
            HEADROOM_BYTES / gib,
        )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _count(table: dict[str, list[int]], kind: str, nbytes: int) -> None:
    n, b = table.setdefault(kind, [0, 0])
    table[kind] = [n + 1, b + nbytes]
