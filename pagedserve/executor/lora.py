"""Many LoRA adapters over one base model, in one batch (Punica / S-LoRA style).

`LoRAManager` wraps each layer's qkv_proj, o_proj, gate_up_proj and down_proj (float
nn.Linear, FloatLinear or a packed QuantLinear: the delta is added to the base layer's
output, so any base works) in a `LoRALinear` holding `max_loras` resident slots, stacked:
A as [slots, in, P * max_rank] and B (times the adapter's scale) as [slots, P * max_rank,
out], P the parts of a fused layer (q/k/v: 3, gate/up: 2; B is block-diagonal over them,
a part the adapter does not target is zeros; a rank under the max is zero-padded).

One step (`LoRABatch`): each token's slot (-1: the base model), tokens grouped by slot
once per step, and cut into tiles of up to 8 rows of one slot. Each wrapped layer then makes
one call of the fused C++ kernel (ops/csrc/lora_kernels.cpp, Punica's SGMV idea): per tile,
the adapter's A and B are read once for its rows, x @ A (rank R, float sums) then @ B is
added to the base output in place (no gathered copies, no index_add), and a fused layer's
parts meet only their own block of B (q/k/v, gate/up: the zero blocks are never read).
bfloat16 weights on a CPU with avx512_bf16 are kept packed for vdpbf16ps (`pack`: pairs of
rows interleaved, B's zero blocks dropped); otherwise the AVX-512 / AVX2 FMA kernel reads the
plain layouts. Without the kernel (no AVX2, no compiler, a GPU tensor, `use_kernel = False`)
the PyTorch path runs: a gather of the groups' rows, one batched shrink and one batched
expand (`torch.bmm` over [groups, longest group, ...]) and one index_add (one product pair
per group when padding to the longest group would waste much). No per-token Python.

Adapters are read (and checked) into a CPU cache of `max_cpu_loras` (LRU) on a loader
thread when a request arrives (`prefetch`; the scheduler holds the request back, and runs
the others, until `ready`), and copied into a resident slot (LRU over `max_loras`) at the
first step that needs them; the scheduler never puts more than `max_loras` adapters in a
step.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

from pagedserve import envs
from pagedserve.executor.cpp_build import load_extension
from pagedserve.lora import FUSED_PARTS, TARGETS, BaseDims, LoRARequest, PEFTAdapter, load_peft_adapter

_CSRC = os.path.join(os.path.dirname(__file__), "ops", "csrc")
# included by lora_kernels.cpp; part of the build key
_LORA_HEADERS = ("isa_target.h", "lora_vec_avx2.h", "lora_vec_avx512.h", "lora_tiles.h", "lora_bf16.h")
TILE = 8  # token rows per kernel tile (lora_tiles.h's register blocking)
# False: every step runs the PyTorch path below (tests and A/B measurements flip it)
use_kernel = True


@functools.cache
def load_kernels():
    """The fused shrink+expand module (ops/csrc/lora_kernels.cpp: AVX-512 or AVX2, chosen at
    run time), or None (no compiler, no AVX2, PAGEDSERVE_NO_CPP_KERNELS=1): the PyTorch path."""
    if envs.PAGEDSERVE_NO_CPP_KERNELS:
        return None
    try:
        mod = load_extension("lora", [os.path.join(_CSRC, "lora_kernels.cpp")],
                             headers=tuple(os.path.join(_CSRC, h) for h in _LORA_HEADERS),
                             cflags=("-O3", "-fopenmp", "-fno-math-errno"), ldflags=("-fopenmp",),
                             expected_seconds=25)
    except Exception as e:  # noqa: BLE001 (any build failure means: the PyTorch path)
        logging.getLogger(__name__).warning("pagedserve: LoRA kernels unavailable (%s); using PyTorch", e)
        return None
    return mod if mod.get_isa() > 0 else None


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
AVX512_BF16 = 3  # the kernels' level with vdpbf16ps (packed bf16 weights)


def _kernel_for(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor):
    ok = (use_kernel and x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES and a.dtype == x.dtype
          and y.dtype in _KERNEL_DTYPES and x.stride(-1) == 1 and y.stride(-1) == 1)
    return load_kernels() if ok else None


def packs(dtype: torch.dtype, device: torch.device, in_features: int, rank: int, parts: int) -> bool:
    """Whether a layer's slots are kept in the bf16 kernel's packed layouts (bf16 weights on a
    CPU with avx512_bf16, even sizes); else the PyTorch path's [slots, in, R] / [slots, R, out]."""
    if not use_kernel or dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return False
    k = load_kernels()
    return k is not None and k.get_isa() == AVX512_BF16 and in_features % 2 == 0 and rank % 2 == 0


def pack(a: torch.Tensor, b: torch.Tensor, cols: list[int], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot's A [in, R] and B [R, out] (block-diagonal over the parts of `cols`) in the
    kernel's layouts: A2 [in/2, R, 2] (pairs of input rows), B2 [RP/2, out, 2] with RP = rank
    for a fused layer (each part's rank rows over its own columns: the zero blocks dropped),
    else R."""
    k, r = a.shape
    a2 = a.reshape(k // 2, 2, r).transpose(1, 2)
    parts = len(cols) - 1
    if parts > 1:
        b = torch.cat([b[p * rank : (p + 1) * rank, cols[p] : cols[p + 1]] for p in range(parts)], dim=1)
    b2 = b.reshape(b.shape[0] // 2, 2, b.shape[1]).transpose(1, 2)
    return a2, b2


def unpack(a2: torch.Tensor, b2: torch.Tensor, cols: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack`'s inverse over every slot: [S, in, R] and [S, R, out] (a copy; the PyTorch path
    over packed slots, when the kernel cannot run)."""
    s, k2, r, _ = a2.shape
    a = a2.transpose(2, 3).reshape(s, 2 * k2, r)
    bc = b2.transpose(2, 3).reshape(s, 2 * b2.shape[1], b2.shape[2])
    bounds = [int(c) for c in cols]
    if len(bounds) == 2:
        return a, bc
    b = bc.new_zeros(s, r, bc.shape[2])
    for p in range(len(bounds) - 1):
        b[:, p * rank : (p + 1) * rank, bounds[p] : bounds[p + 1]] = bc[:, :, bounds[p] : bounds[p + 1]]
    return a, b


class LoRABatch:
    """One step's tokens grouped by adapter slot. `token_slots[t]`: slot of token t (-1: none)."""

    def __init__(self, token_slots: np.ndarray, device: torch.device) -> None:
        idx = np.nonzero(token_slots >= 0)[0]
        order = idx[np.argsort(token_slots[idx], kind="stable")]
        slots, starts, counts = np.unique(token_slots[order], return_index=True, return_counts=True)
        g, longest, n = len(slots), int(counts.max()), len(order)
        self.rows = torch.from_numpy(order).to(device)  # token rows, grouped by slot
        # the kernel's tiles: (slot, offset in rows, count <= TILE), every segment cut in TILEs
        per = (counts + TILE - 1) // TILE
        seg = np.repeat(np.arange(g), per)
        off = (np.arange(len(seg)) - np.repeat(np.cumsum(per) - per, per)) * TILE
        self.tiles = torch.from_numpy(np.stack(
            [slots[seg], starts[seg] + off, np.minimum(TILE, counts[seg] - off)], axis=1).astype(np.int64))
        self.slots = torch.from_numpy(slots).to(device)
        self.padded = g * longest <= 2 * n + 16
        if self.padded:  # [g, longest] gather of rows (padding repeats a group's first row)
            pos = np.minimum(np.arange(longest)[None, :], counts[:, None] - 1) + starts[:, None]
            self.gather = torch.from_numpy(order[pos].reshape(-1)).to(device)
            self.shape = (g, longest)
            valid = (np.arange(longest)[None, :] < counts[:, None]).reshape(-1)
            self.valid = None if valid.all() else torch.from_numpy(np.nonzero(valid)[0]).to(device)
        else:  # one product pair per group
            self.segments = [(int(s), int(a), int(a + c)) for s, a, c in zip(slots, starts, counts)]

    def apply(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              cols: torch.Tensor | None = None, rank: int = 0, packed: bool = False) -> torch.Tensor:
        """y (the base output [T, out]) plus each token's adapter delta, in place. cols / rank:
        the column bounds of a fused layer's parts and the rank of each (B block-diagonal: the
        kernel skips the zero blocks); None: one part. packed: a and b in the bf16 kernel's
        layouts (`pack`)."""
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        if cols is None:
            cols = torch.tensor([0, y2.shape[1]], dtype=torch.int64)
        k = _kernel_for(x2, y2, a)
        if k is not None and (not packed or k.get_isa() == AVX512_BF16):
            k.lora_apply_(x2, y2, a, b, self.rows, self.tiles, cols, rank, packed)
            return y
        if packed:
            a, b = unpack(a, b, cols, rank)
        if self.padded:
            g, longest = self.shape
            a_g, b_g = (a, b) if g == a.shape[0] else (a.index_select(0, self.slots), b.index_select(0, self.slots))
            xg = x2.index_select(0, self.gather).view(g, longest, -1)
            d = torch.bmm(torch.bmm(xg, a_g), b_g).view(g * longest, -1)
            if self.valid is not None:
                d = d.index_select(0, self.valid)
            y2.index_add_(0, self.rows, d.to(y2.dtype))
            return y
        for s, lo, hi in self.segments:
            rows = self.rows[lo:hi]
            d = (x2.index_select(0, rows) @ a[s]) @ b[s]
            y2.index_add_(0, rows, d.to(y2.dtype))
        return y


class _StepRef:
    """The current step's LoRABatch, shared by every LoRALinear (None: base model only)."""

    batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    """A base projection plus the delta of each token's resident adapter."""

    def __init__(self, base: nn.Module, in_features: int, part_outs: list[int], slots: int, rank: int, ref: _StepRef,
                 dtype: torch.dtype, device) -> None:
        super().__init__()
        self.base = base
        self.part_outs = list(part_outs)
        self.rank = rank
        self.ref = ref
        r, out = rank * len(part_outs), sum(part_outs)
        self.cols = torch.tensor(np.cumsum([0, *part_outs]), dtype=torch.int64)  # the parts' column bounds
        self.packed = packs(dtype, device, in_features, rank, len(part_outs))
        if self.packed:  # the bf16 kernel's layouts (`pack`)
            rp = r if len(part_outs) == 1 else rank
            shapes = (slots, in_features // 2, r, 2), (slots, rp // 2, out, 2)
        else:
            shapes = (slots, in_features, r), (slots, r, out)
        self.register_buffer("lora_a", torch.zeros(shapes[0], dtype=dtype, device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(shapes[1], dtype=dtype, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base.forward(x)
        batch = self.ref.batch
        if batch is None:
            return y
        return batch.apply(x, y, self.lora_a, self.lora_b, self.cols, self.rank, self.packed)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's A [slots, in, R] and B [slots, R, out] (B block-diagonal over the parts)."""
        return unpack(self.lora_a, self.lora_b, self.cols, self.rank) if self.packed else (self.lora_a, self.lora_b)

    @torch.no_grad()
    def set_slot(self, slot: int, parts: list[tuple | None]) -> None:
        """Write one adapter's (A [r, in], B [out, r], scale) per part (None: not targeted)."""
        n_in, r_all, dtype = self.lora_a.shape[1] * (2 if self.packed else 1), self.rank * len(self.part_outs), self.lora_a.dtype
        a_s = torch.zeros(n_in, r_all, dtype=dtype, device=self.lora_a.device)
        b_s = torch.zeros(r_all, sum(self.part_outs), dtype=dtype, device=self.lora_a.device)
        col = 0
        for p, (part, out) in enumerate(zip(parts, self.part_outs)):
            if part is not None:
                a, b, scale = part[0], part[1], part[2]
                r, lo = a.shape[0], p * self.rank
                a_s[:, lo : lo + r] = a.t().to(dtype)
                b_s[lo : lo + r, col : col + out] = (b.float() * scale).t().to(dtype)
            col += out
        if self.packed:
            a_s, b_s = pack(a_s, b_s, self.cols.tolist(), self.rank)
        self.lora_a[slot].copy_(a_s)
        self.lora_b[slot].copy_(b_s)


class LoRAManager:
    """The adapters of one model runner: CPU cache, resident slots, per-step grouping."""

    def __init__(self, model: nn.Module, model_config, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if getattr(model, "tp", None) is not None and model.tp.size > 1:
            raise ValueError("enable_lora runs with tensor_parallel_size=1 only in this version.")
        self.dims = BaseDims.of(model_config)
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_lora_rank, max(max_cpu_loras, max_loras)
        self.device = device
        self.ref = _StepRef()
        self.layers: list[dict[str, LoRALinear]] = [self._wrap(layer, dtype) for layer in model.layers]
        model.__dict__.pop("_plan", None)  # the lean decode loop picks up the wrappers' forward
        self.cpu: OrderedDict[int, PEFTAdapter] = OrderedDict()
        self.paths: dict[int, str] = {}
        self.resident: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recent first
        self.free_slots = list(range(max_loras))
        self.loading: dict[int, Future] = {}  # lora id -> its read on the loader thread
        self.failed: dict[int, str] = {}  # lora id -> why its read failed (until reported)
        self._pool: ThreadPoolExecutor | None = None

    def _wrap(self, layer: nn.Module, dtype) -> dict[str, LoRALinear]:
        d, out = self.dims, {}
        owners = {"qkv_proj": layer.self_attn, "o_proj": layer.self_attn}
        parts = {"qkv_proj": [d.q_out, d.kv_out, d.kv_out], "o_proj": [d.hidden]}
        ins = {"qkv_proj": d.hidden, "o_proj": d.q_out, "gate_up_proj": d.hidden, "down_proj": d.intermediate}
        if hasattr(layer.mlp, "gate_up_proj") and d.dense_mlp:
            owners.update(gate_up_proj=layer.mlp, down_proj=layer.mlp)
            parts.update(gate_up_proj=[d.intermediate] * 2, down_proj=[d.hidden])
        for name, owner in owners.items():
            wrapped = LoRALinear(getattr(owner, name), ins[name], parts[name], self.max_loras, self.max_rank, self.ref,
                                 dtype, self.device)
            setattr(owner, name, wrapped)
            out[name] = wrapped
        return out

    # -- adapters -------------------------------------------------------------------
    def add_lora(self, req: LoRARequest) -> PEFTAdapter:
        """Read and check the adapter into the CPU cache (ValueError naming what is wrong)."""
        known = self.paths.get(req.lora_int_id)
        if known is not None and known != req.lora_path:
            raise ValueError(f"lora_int_id {req.lora_int_id} is already adapter {known!r}, not {req.lora_path!r}.")
        if req.lora_int_id in self.loading:  # being read: wait for it
            self.loading[req.lora_int_id].result()
            self.ready(req.lora_int_id)
        adapter = self.cpu.get(req.lora_int_id)
        if adapter is None:
            adapter = load_peft_adapter(req.lora_name, req.lora_path, self.dims, self.max_rank)
            self.paths[req.lora_int_id] = req.lora_path
            self.cpu[req.lora_int_id] = adapter
            while len(self.cpu) > self.max_cpu_loras:
                self.cpu.popitem(last=False)
        self.cpu.move_to_end(req.lora_int_id)
        return adapter

    def prefetch(self, req: LoRARequest) -> None:
        """Start reading the adapter on the loader thread (nothing if it is read or being read)."""
        known = self.paths.get(req.lora_int_id)
        if known is not None and known != req.lora_path:
            raise ValueError(f"lora_int_id {req.lora_int_id} is already adapter {known!r}, not {req.lora_path!r}.")
        if req.lora_int_id in self.cpu or req.lora_int_id in self.loading:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-lora")
        self.paths[req.lora_int_id] = req.lora_path
        self.loading[req.lora_int_id] = self._pool.submit(
            load_peft_adapter, req.lora_name, req.lora_path, self.dims, self.max_rank
        )

    def ready(self, lora_int_id: int) -> bool:
        """Whether a request of this adapter may be scheduled (its read finished, or none ran)."""
        fut = self.loading.get(lora_int_id)
        if fut is None:
            return True
        if not fut.done():
            return False
        del self.loading[lora_int_id]
        try:
            self.cpu[lora_int_id] = fut.result()
        except Exception as e:  # noqa: BLE001 (reported by take_failures: its requests are aborted)
            self.failed[lora_int_id] = f"{type(e).__name__}: {e}"
            self.paths.pop(lora_int_id, None)
            return False
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        return True

    def take_failures(self) -> dict[int, str]:
        """Adapters whose read failed since the last call (lora id -> message)."""
        for i in [i for i, f in self.loading.items() if f.done()]:
            self.ready(i)
        failed, self.failed = self.failed, {}
        return failed

    def wait_loading(self, timeout: float) -> None:
        """Block up to `timeout` s for a pending read (an idle core waiting on adapters)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        if self.loading:
            wait(list(self.loading.values()), timeout, return_when=FIRST_COMPLETED)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot frees); the caller ensures no running request uses it."""
        self.paths.pop(lora_int_id, None)
        found = self.cpu.pop(lora_int_id, None) is not None
        slot = self.resident.pop(lora_int_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        return found or slot is not None

    def _slot_for(self, req: LoRARequest, in_use: set[int]) -> int:
        slot = self.resident.get(req.lora_int_id)
        if slot is not None:
            self.resident.move_to_end(req.lora_int_id)
            return slot
        adapter = self.add_lora(req)  # (re)read if the CPU cache let it go
        if self.free_slots:
            slot = self.free_slots.pop()
        else:  # evict the least recently used adapter this step does not need
            victim = next((i for i in self.resident if i not in in_use), None)
            if victim is None:
                raise RuntimeError(f"more than max_loras={self.max_loras} adapters in one step.")
            slot = self.resident.pop(victim)
        for i, mods in enumerate(self.layers):
            for name, lin in mods.items():
                targets = [t for t, (fused, _) in TARGETS.items() if fused == name]
                lin.set_slot(slot, [adapter.modules.get((i, t)) for t in targets][: FUSED_PARTS[name]])
        self.resident[req.lora_int_id] = slot
        return slot

    # -- one step -------------------------------------------------------------------
    def begin_step(self, loras: list[LoRARequest | None], q_lens: np.ndarray) -> None:
        """Group the step's tokens (request i has q_lens[i] tokens, adapter loras[i])."""
        if not any(loras):
            self.ref.batch = None
            return
        in_use = {r.lora_int_id for r in loras if r is not None}
        per_req = np.fromiter((-1 if r is None else self._slot_for(r, in_use) for r in loras), np.int64, len(loras))
        self.ref.batch = LoRABatch(np.repeat(per_req, q_lens), self.device)

    def end_step(self) -> None:
        self.ref.batch = None
