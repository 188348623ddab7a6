"""Float linears on oneDNN with the weight pre-packed once at load (vLLM CPU's `onednn_mm`
idea, through PyTorch's own `mkldnn._reorder_linear_weight` / `_linear_pointwise`).

`F.linear` on a CPU hands oneDNN (or the BLAS) a plain [N, K] weight on every call, which
it re-reads in its plain layout; the pre-packed weight is in the blocked layout oneDNN's
kernels stream. Measured on a 2-vCPU Zen 4 (BENCHMARKS section 32): bfloat16 1.5-2x at 1-8
rows with weights streamed from memory (decode), 1.1-1.3x at 64 rows, about equal at long
prefill chunks; float32 1.4-3x at every row count. Layers under `MIN_ELEMENTS` weights stay
on `F.linear` (the packed call's fixed cost is larger than their product).

Invariants: the products are the same as `F.linear`'s up to the order of float sums (bf16:
the same bits in every case measured); after `pack_linears` the module's `weight` is a
0-element tensor of the same dtype unless another module shares it (a tied LM head keeps
the embedding's), so the model holds each weight once; `in_features` / `out_features` and
`bias` are unchanged. Only CPU tensors of float32 / bfloat16 (bf16 where oneDNN has it).

On AMX (ops/moe_gemm.amx()) a bf16 layer without bias may also keep, as far as the copy
budget allows, its weight in the 16-column VNNI blocks of the MoE tile kernel
(`pack_linears(model, budget)`; 2 bytes a weight): its products of up to TILE_MAX_ROWS rows
run there, 1.0-1.5x oneDNN's at 1-1,024 rows (BENCHMARKS sections 39, 65; equal at 256);
larger ones stay on oneDNN. float32 sums rounded once to bf16 on both.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve import envs

MIN_ELEMENTS = 1 << 18  # N * K; e.g. 512 x 512
SPLIT_GATE_UP = True  # gate_up layers marked `act_halves` keep their weight as halves (packed_silu_mul)
TILE_MAX_ROWS = 1023  # rows a product with a tile copy runs on it (layers.AMX_COPY_MIN_ROWS's bound)
_OFFSETS: dict[int, torch.Tensor] = {}  # rows -> the one group's offsets [0, rows] (experts_mm's argument)


def available(dtype: torch.dtype) -> bool:
    """Whether this PyTorch build's oneDNN runs pre-packed products in `dtype` here."""
    if envs.PAGEDSERVE_NO_ONEDNN_PACK or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def pack_weight(w: torch.Tensor, rows_hint: int = 8) -> torch.Tensor:
    """[N, K] float weight -> oneDNN's packed tensor (layout chosen for ~rows_hint rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), rows_hint)


EXACT_ROWS = 16  # decode-sized products keep their row count (the same kernels as before)


def rows_bucket(m: int) -> int:
    """The row count a product of m rows runs at: m itself up to EXACT_ROWS, else m rounded
    up to one of 8 steps per power of two (at most 12.5% padded rows). oneDNN builds (JITs)
    a primitive for every new row count, ~3.5 ms for a 4096 x 1024 bf16 product on an AMX
    Xeon (BENCHMARKS section 34), while steps of a served engine (chunked prefill beside
    decode rows, an MoE expert's share of a step's tokens) rarely repeat a count: the
    buckets bound the shapes it ever sees to ~8 per octave, each built once."""
    if m <= EXACT_ROWS:
        return m
    step = 1 << max(m.bit_length() - 4, 0)  # 2^(floor(log2 m) - 3)
    return -(-m // step) * step


def _pad_rows(x2: torch.Tensor, rows: int) -> torch.Tensor:
    """x2 [m, K] with zero rows appended up to `rows`: the rows copied once and only the padding
    zeroed (F.pad zero-fills the whole result before copying the rows in: two products of 2,017
    rows took 3.13-3.26 ms that way against 3.00, BENCHMARKS section 72)."""
    out = x2.new_empty(rows, x2.shape[1])
    out[: x2.shape[0]].copy_(x2)
    out[x2.shape[0] :].zero_()
    return out


def _bucketed(x: torch.Tensor, product) -> torch.Tensor:
    """product(x2) for x [..., K] as 2-D rows padded with zeros to `rows_bucket`, the extra
    output rows dropped (a view: the leading rows of a contiguous result are contiguous) and
    x's leading dimensions put back."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    mp = rows_bucket(m)
    if mp != m:
        x2 = _pad_rows(x2, mp)
    y = product(x2)
    if mp != m:
        y = y[:m]
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] (the packed weight's dtype) -> [..., N], rows bucketed for oneDNN (`_bucketed`)."""
    return _bucketed(x, lambda x2: torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], ""))


def packed_silu_mul(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(x @ W_gate.T) * (x @ W_up.T) for x [..., K] in two pre-packed products (a dense
    MLP's gate_up halves, `split_gate_up`): the gate's with oneDNN's swish post-op (SiLU of the
    float32 sums, rounded once to the dtype), the up's with a binary `mul` post-op by that
    result. The [.., 2I] gate_up output and the separate SiLU pass over it (12.6 MB written and
    read back a layer at 2,048 rows of SmolLM2) are gone; the sums are rounded twice instead of
    four times (unfused: gate, SiLU, up, product). Rows bucketed as in `packed_linear`."""
    pointwise = torch.ops.mkldnn._linear_pointwise

    def product(x2: torch.Tensor) -> torch.Tensor:
        return pointwise.binary(x2, pointwise(x2, gate, None, "swish", [], ""), up, None, "mul")

    return _bucketed(x, product)


def split_gate_up(w: torch.Tensor, rows_hint: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A gate_up weight [2I, K] (gate rows, then up rows) -> the halves' packed weights."""
    half = w.shape[0] // 2
    return pack_weight(w[:half], rows_hint), pack_weight(w[half:], rows_hint)


def halves_linear(x: torch.Tensor, halves: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x @ [W_gate; W_up].T from the split packed halves: the plain gate_up product, for a
    caller other than the fused MLP (one more pass over the output than a single product)."""
    return torch.cat([packed_linear(x, h, None) for h in halves], dim=-1)


def bucket_sizes(lo: int, hi: int) -> list[int]:
    """The row counts products of lo..hi rows run at (rows_bucket's values), ascending."""
    return sorted({rows_bucket(m) for m in range(max(1, lo), hi + 1)})


# Rows warm_up goes up to: a budget without chunked prefill is the model's whole context
# (32k+ rows: GB-sized inputs, minutes of start-up); longer steps build theirs when they come.
WARM_UP_MAX_ROWS = 4096


def warm_up(model: nn.Module, max_rows: int, head_rows: int) -> int:
    """Run every packed product of `model` once at each row count a step can hand it
    (`bucket_sizes` up to max_rows, the LM head's up to head_rows), once per distinct weight
    shape: oneDNN JIT-builds a primitive at the first product of a new row count (~4 ms for
    a 3,072 x 576 bf16 weight on an AMX Xeon; the same shape's other weights reuse it), which
    served steps would otherwise pay mid-run (BENCHMARKS section 37). Modules offer their
    products through `packed_products()` -> [(packed weight, bias, fewest rows it takes)].
    Modules with fused gate/up halves offer them through `silu_products()` -> [(gate, up,
    fewest rows)]. Returns how many products ran. Largest row count first: a CPU engine keeps the memory its
    steps free (host_memory.keep_freed_memory), and outputs growing step by step never fit in
    the hole the previous one left, so an ascending warm-up grew the heap by the sum of them
    all (+0.95 GB for one [28672, 4096] weight, +2 GB for a 7 B model; descending: +1 MB)."""
    seen, n = set(), 0

    def run(key, w: torch.Tensor, lo: int, hi: int, product, calls: int) -> None:
        """product(x) at every bucket of lo..hi rows, largest first, once per key."""
        nonlocal n
        if key in seen:
            return
        seen.add(key)
        with torch.inference_mode():
            for m in reversed(bucket_sizes(lo, hi)):
                product(torch.zeros(m, w.shape[1], dtype=w.dtype))
                n += calls

    for name, mod in model.named_modules():
        products = getattr(mod, "packed_products", None)
        for packed, bias, lo in products() if callable(products) else ():
            hi = head_rows if name.rsplit(".", 1)[-1] == "lm_head" else max_rows
            key = (tuple(packed.shape), packed.dtype, bias is None, lo, hi)
            run(key, packed, lo, hi, lambda x, p=packed, b=bias: packed_linear(x, p, b), 1)
        silu = getattr(mod, "silu_products", None)
        for gate, up, lo in silu() if callable(silu) else ():  # packed_silu_mul's two primitives
            key = ("silu", tuple(gate.shape), gate.dtype, lo)
            run(key, gate, lo, max_rows, lambda x, g=gate, u=up: packed_silu_mul(x, g, u), 2)
    return n


class OneDNNLinear(nn.Linear):
    """An nn.Linear whose forward runs on the pre-packed weight (`packed`, set by `pack`)."""

    packed: torch.Tensor | None
    tiles: torch.Tensor | None = None  # the AMX tile kernel's copy (moe_gemm.pack), or None
    # a dense MLP's gate_up (`act_halves` set by the model, models/llama.py's MLP.mark_silu_halves)
    # with a tile copy (AMX, bf16, no bias): its oneDNN weight as the gate and up halves
    # (`split_gate_up`), `packed` None; the MLP runs them fused (`silu_mul`) past the tiles' rows
    act_halves: bool = False
    silu_halves: tuple[torch.Tensor, torch.Tensor] | None = None

    def pack(self, keep_weight: bool, budget=None) -> None:
        """oneDNN's packed weight (or its gate and up halves, see `act_halves`); beside it the
        tile copy where `tile_copy_fits` (budget: a quant.copy_budget.CopyBudget, None: no tile
        copy)."""
        w = self.weight.detach()
        if budget is not None and self.tile_copy_fits(budget):
            from pagedserve.executor.ops import moe_gemm

            self.tiles = moe_gemm.pack(w[None], moe_gemm.AMX_BLOCK_N)
        if SPLIT_GATE_UP and self.act_halves and self.tiles is not None and self.bias is None:
            self.packed, self.silu_halves = None, split_gate_up(w)  # oneDNN past the tiles' rows
        else:
            self.packed = pack_weight(w)
        if not keep_weight:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def tile_copy_fits(self, budget) -> bool:
        """Whether this layer takes a tile copy: bf16, no bias, N and K multiples of 32, the
        MoE tile kernel usable (AMX path, tiles granted) and room in the budget."""
        from pagedserve.executor.ops import moe_gemm

        w = self.weight
        return (
            self.bias is None and w.dtype == torch.bfloat16 and w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0
            and moe_gemm.amx() and budget.take("AMX tile", w.numel() * 2)
        )

    def packed_products(self) -> list[tuple[torch.Tensor, torch.Tensor | None, int]]:
        if self.packed is None:
            return []  # the halves: warm_up runs them fused
        return [(self.packed, self.bias, 1 if self.tiles is None else TILE_MAX_ROWS + 1)]

    def silu_products(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        return [] if self.silu_halves is None else [(*self.silu_halves, TILE_MAX_ROWS + 1)]

    def _oned(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias) if self.packed is not None else halves_linear(x, self.silu_halves)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this gate_up layer's product with x, fused (`packed_silu_mul`)
        where the product runs on oneDNN's halves (past the tiles' rows); None where it does
        not (the caller then takes `forward` and the activation)."""
        halves = self.silu_halves
        if halves is None or x.dtype != self.weight.dtype or x.numel() <= TILE_MAX_ROWS * self.in_features:
            return None
        return packed_silu_mul(x, *halves)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.weight.dtype  # (a 0-element weight after packing keeps it)
        if x.dtype != dtype:  # e.g. float32 activations into a bf16 layer
            return self._oned(x.to(dtype)).to(x.dtype)
        tiles = self.tiles
        if tiles is not None and x.numel() <= TILE_MAX_ROWS * self.in_features:
            return _tile_linear(x, tiles, self.out_features)
        return self._oned(x)


def _tile_linear(x: torch.Tensor, tiles: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] bf16 @ the tile copy's weight.T -> [..., n] bf16 (one expert of experts_mm)."""
    from pagedserve.executor.ops import moe_gemm

    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    off = _OFFSETS.get(m)
    if off is None:
        off = _OFFSETS[m] = torch.tensor([0, m], dtype=torch.int64)
    return moe_gemm.experts_mm(x2, off, tiles).view(*x.shape[:-1], n)


def pack_linears(model: nn.Module, budget=None) -> int:
    """Turn the CPU model's plain float nn.Linear layers (at least MIN_ELEMENTS weights, a
    dtype oneDNN packs) into OneDNNLinear, with tile copies as far as `budget` (a
    quant.copy_budget.CopyBudget; None: none) allows; returns how many. Call once, after
    loading and before the first step (the lean decode loop binds the modules' forward then)."""
    shared: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            shared[id(p)] = shared.get(id(p), 0) + 1
    n = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if (
            type(mod) is nn.Linear
            and w.device.type == "cpu"
            and w.numel() >= MIN_ELEMENTS
            and available(w.dtype)
        ):
            mod.__class__ = OneDNNLinear
            mod.pack(keep_weight=shared[id(w)] > 1, budget=budget)
            n += 1
    return n

