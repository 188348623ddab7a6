"""Linear and embedding layers over packed weights, and the model surgery that installs them.

A QuantLinear holds one or more row segments (a fused Q/K/V or gate/up projection is several
checkpoint tensors; they are joined into one packed matrix when their types agree, else kept
as segments that write their own output columns). Activations are float: x is cast to
float32 for the kernel and the result back to the model dtype; `act_q8` (quantization
"gguf_q8") lets the kernel quantize them to int8 blocks for the few-row products.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedserve import envs
from pagedserve.executor import onednn_linear
from pagedserve.executor.quant import kernels
from pagedserve.executor.quant.copy_budget import CopyBudget
from pagedserve.executor.quant.formats import F32, NAMES, QUANTIZERS, PackedWeight

logger = logging.getLogger(__name__)


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, parts: list[int], bias: nn.Parameter | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.parts = list(parts)
        self.out_features = sum(parts)
        self.bias = bias
        self._pending: list[PackedWeight | None] = [None] * len(parts)
        self.segments: list[tuple[int, torch.Tensor, int]] = []  # (qtype, data [n, rb], first column)
        self.act_q8 = False
        self._dense: torch.Tensor | None = None  # oneDNN-packed bf16 copy (attach_bf16_copy)
        self._rows16: list[torch.Tensor] = []  # per segment, its row-interleaved copy (attach_rows16)
        self._dense_min = 0  # x.numel() from which products run on it
        # a dense MLP's gate_up (set by the model: MLP.mark_silu_halves): the bf16 copy may be
        # kept as its gate and up halves (`silu_halves`, `_dense` None), which the MLP runs
        # fused (`silu_mul`: onednn_linear.packed_silu_mul)
        self.act_halves = False
        self.silu_halves: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_part(self, i: int, w: PackedWeight | torch.Tensor) -> None:
        if not isinstance(w, PackedWeight):  # a float part of a fused layer: run it as F32 rows
            w = w.detach().float().contiguous()
            w = PackedWeight(F32, w.view(torch.uint8).reshape(w.shape[0], -1), tuple(w.shape))
        if w.shape != (self.parts[i], self.in_features):
            raise ValueError(f"packed part {i}: shape {w.shape} != {(self.parts[i], self.in_features)}")
        self._pending[i] = w
        if all(p is not None for p in self._pending):
            self._finalize()

    @property
    def complete(self) -> bool:
        return bool(self.segments)

    def _finalize(self) -> None:
        ws: list[PackedWeight] = self._pending  # type: ignore[assignment]
        self.segments = []
        col, i = 0, 0
        while i < len(ws):  # join runs of parts with the same type into one matrix
            j = i
            while j + 1 < len(ws) and ws[j + 1].qtype == ws[i].qtype:
                j += 1
            run = ws[i : j + 1]
            data = run[0].data if len(run) == 1 else torch.cat([w.data for w in run], dim=0)
            self.segments.append((run[0].qtype, data.contiguous(), col))
            col += sum(w.shape[0] for w in run)
            i = j + 1
        self._pending = [None] * len(self.parts)
        self._set_args()
        self._op = kernels.load().qlinear
        self._bias = self.bias  # a plain attribute (the Parameter, loaded in place)

    def _set_args(self) -> None:
        self._args = (
            [d for _, d, _ in self.segments],
            [t for t, _, _ in self.segments],
            [c for _, _, c in self.segments],
            self.out_features,
            self._rows16,
        )

    @classmethod
    def from_packed(cls, w: PackedWeight, bias: nn.Parameter | None = None) -> QuantLinear:
        layer = cls(w.shape[1], [w.shape[0]], bias)
        layer.set_part(0, w)
        return layer

    def attach_bf16_copy(self, min_rows: int, budget: CopyBudget | None = None, halves: bool = False) -> bool:
        """Keep beside the packed blocks the dequantized weight rounded once to bfloat16, in
        oneDNN's packed layout: bf16 products of at least `min_rows` rows run on it (oneDNN's
        AMX brgemm), fewer rows stay on the packed blocks (a quarter of the bytes to stream).
        Costs 2 bytes a weight of memory, and as much again while it is made (the plain bf16
        weight; the float32 dequantization goes in slices of DEQUANT_SLICE values). `halves`
        (a gate_up layer without bias): the copy as its gate and up halves (`silu_mul`). False
        (nothing kept) where `budget` has no room for it."""
        n, k = self.out_features, self.in_features
        if budget is not None and not budget.take("bf16", 2 * n * k, transient=2 * n * k):
            return False
        w = torch.empty(n, k, dtype=torch.bfloat16)
        step = max(1, DEQUANT_SLICE // k)
        for t, d, col in self.segments:
            for r in range(0, d.shape[0], step):
                rows = d[r : r + step]
                w[col + r : col + r + rows.shape[0]] = kernels.dequant(rows, t, k)
        split = onednn_linear.SPLIT_GATE_UP and halves and self.bias is None
        if split and len(self.parts) == 2 and self.parts[0] == self.parts[1]:
            self.silu_halves = onednn_linear.split_gate_up(w, rows_hint=max(8, min_rows))
        else:
            self._dense = onednn_linear.pack_weight(w, rows_hint=max(8, min_rows))
        self._dense_min = max(1, min_rows) * k
        return True

    def attach_rows16(self, budget: CopyBudget | None = None) -> bool:
        """Keep beside each block-type segment (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K /
        Q6_K; under gguf_q8 those whose few-row products stay float, not kernels.act_q8_type, and
        those whose int8 kernel reads the copy, kernels.rows16_q8_type, at 1.1-2.5x the packed
        rows' int8 kernels, section 63) its
        row-interleaved copy, which the few-row products (decode at batch 1-11 in float32, 1-8
        in bf16; verification rows) read at ~2x the packed rows' kernel on AVX-512
        (BENCHMARKS sections 39, 44; the K-quants 3-6x, sections 49, 55), 1.2-2.1x at 1 row on
        AVX2 (section 56). Costs the segments' packed bytes again (Q4_K +2.8%, its scales
        unpacked; Q5_K +2.3%, the same; Q6_K +0% in six bits where the CPU has AVX512-VBMI,
        else +30%, a byte a quant). Every few-row kernel reads every copy, except that the AVX2
        path (no six-bit copy is made on it) reads Q6_K's byte layout only. False (nothing
        kept) where no segment takes it or `budget` has no room for the layer's copies."""
        k = self.in_features
        # integer products: no copy, unless their own kernel reads one (kernels.rows16_q8_type)
        no_copy = [self.act_q8 and kernels.act_q8_type(t) and not kernels.rows16_q8_type(t) for t, _, _ in self.segments]
        sizes = [0 if nc else kernels.rows16_copy_size(d, t, k) for (t, d, _), nc in zip(self.segments, no_copy)]
        if not any(sizes) or (budget is not None and not budget.take("row-interleaved", sum(sizes))):
            return False
        empty = torch.empty(0, dtype=torch.uint8)
        copies = [kernels.interleave_rows16(d, t, k) if size else empty for (t, d, _), size in zip(self.segments, sizes)]
        self._rows16[:] = copies  # the list _args holds
        return True

    def packed_products(self) -> list[tuple[torch.Tensor, torch.Tensor | None, int]]:
        """The bf16 copy's product (onednn_linear.warm_up), from its fewest rows."""
        return [] if self._dense is None else [(self._dense, self._bias, self._dense_min // self.in_features)]

    def silu_products(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """The copy's gate and up halves (onednn_linear.warm_up), from its fewest rows."""
        return [] if self.silu_halves is None else [(*self.silu_halves, self._dense_min // self.in_features)]

    def _on_copy(self, x: torch.Tensor) -> bool:
        """Whether x's product runs on the bf16 copy (whole or halves)."""
        return x.dtype is torch.bfloat16 and x.numel() >= self._dense_min

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this gate_up layer's product with x, fused on the copy's halves
        (onednn_linear.packed_silu_mul) where the product would run on the copy; None where it
        would not (the caller then takes `forward` and the activation)."""
        halves = self.silu_halves
        return onednn_linear.packed_silu_mul(x, *halves) if halves is not None and self._on_copy(x) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense is not None and self._on_copy(x):
            return onednn_linear.packed_linear(x, self._dense, self._bias)
        if self.silu_halves is not None and self._on_copy(x):
            return onednn_linear.halves_linear(x, self.silu_halves)
        # one C++ call: reshape, float32 activations, every segment, bias, back to x's dtype
        ws, types, cols, n, rows16 = self._args
        return self._op(x, ws, types, cols, n, self._bias, self.act_q8, rows16)

    def drop_packed_rows(self, keep: set[int]) -> int:
        """Under gguf_q8, free the packed rows of each segment whose row-interleaved copy serves
        every product (`kernels.rows16_q8_every_row`: AVX512-VNNI, Q4_0 / Q4_1 / Q4_K / Q5_K) and
        whose data no other module reads (`keep`: data pointers, e.g. a tied embedding's). The
        segment keeps its shape as one byte expanded, which only that product accepts (the C++
        kernels refuse it anywhere else). Returns the bytes freed."""
        freed = 0
        for i, (t, d, col) in enumerate(self.segments):
            if not self.act_q8 or i >= len(self._rows16) or not self._rows16[i].numel():
                continue
            if _dropped(d) or d.data_ptr() in keep or not kernels.rows16_q8_every_row(t):
                continue
            self.segments[i] = (t, torch.zeros(1, dtype=torch.uint8).expand(*d.shape), col)
            freed += d.numel()
        if freed:
            self._set_args()
        return freed

    @property
    def packed_bytes(self) -> int:
        return sum(d.numel() for _, d, _ in self.segments if not _dropped(d))

    @property
    def copy_bytes(self) -> int:
        """Bytes of the bf16 copy (0 without one)."""
        copies = [self._dense] if self._dense is not None else list(self.silu_halves or ())
        return sum(c.numel() * c.element_size() for c in copies)

    @property
    def rows16_everywhere(self) -> bool:
        """Whether every segment has its row-interleaved copy."""
        return bool(self._rows16) and all(c.numel() for c in self._rows16)

    @property
    def amx_rows16_everywhere(self) -> bool:
        """Whether every segment's many-row bf16 products run on the AMX tiles over its copy
        (kernels.amx_rows16): the layer's bf16 copy serves only from amx_copy_min_rows(K) rows."""
        return self.rows16_everywhere and all(kernels.amx_rows16(t) for t, _, _ in self.segments)

    @property
    def rows16_bytes(self) -> int:
        """Bytes of the row-interleaved copies (0 without them)."""
        return sum(c.numel() for c in self._rows16)

    def extra_repr(self) -> str:
        types = "+".join(NAMES[t] for t, _, _ in self.segments)
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={types}"


class QuantEmbedding(nn.Module):
    """Embedding lookup that dequantizes only the rows it gathers."""

    def __init__(self, w: PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_packed = w
        self.num_embeddings, self.embedding_dim = w.shape
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight_packed
        out = kernels.dequant(w.data, w.qtype, w.shape[1], ids.reshape(-1))
        if self.dtype != torch.float32:
            out = out.to(self.dtype)
        return out.view(*ids.shape, self.embedding_dim)


def quantize_linears(model: nn.Module, method: str) -> None:
    """Replace every nn.Linear of the model (projections and lm_head) by a QuantLinear whose
    weights are quantized now with `method` ("int8": Q8_0 layout, "int4": Q4_1 layout); a layer
    whose K is not a multiple of 32 stays float."""
    quantize = QUANTIZERS[method]
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or mod.in_features % 32:
            continue
        q = QuantLinear.from_packed(quantize(mod.weight), mod.bias)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, q)


class FloatLinear(nn.Linear):
    """An nn.Linear with float32 weights whose middle row counts run through the packed
    kernels' blocked many-row path (the weight as F32 "packed" rows; AVX2 CPUs): at 12-128
    rows it is 1.1-2x the BLAS (BENCHMARKS section 20). Other row counts go to F.linear: one
    row (a gemv reads the weight once either way) and long prefill chunks, where the BLAS's
    packing pays for itself. Same products up to float rounding."""

    many_rows: tuple[int, int] = (12, 128)  # inclusive; (1, 0) turns the kernel path off

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = self.many_rows
        if lo <= x.numel() // self.in_features <= hi and x.dtype == torch.float32:
            w = self.weight.view(torch.uint8)  # [N, 4K]: type F32 rows
            return kernels.load().qlinear(x, [w], [F32], [0], self.out_features, self.bias, False)
        return nn.functional.linear(x, self.weight, self.bias)


def use_float_kernels(model: nn.Module) -> int:
    """Turn the float32 CPU model's nn.Linear layers into FloatLinear where the kernels have
    the many-row path (AVX2); returns how many. Nothing changes elsewhere (other ISAs, no
    compiler: the BLAS path as before)."""
    if envs.PAGEDSERVE_NO_CPP_KERNELS:
        return 0
    try:
        if not kernels.has_many_rows_kernel():  # another ISA (AVX-512, scalar)
            return 0
    except Exception:  # noqa: BLE001 (the extension does not build here: the BLAS, as before)
        return 0
    n = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if (
            type(mod) is nn.Linear
            and w.dtype == torch.float32
            and w.device.type == "cpu"
            and w.is_contiguous()
            and mod.in_features % 8 == 0
        ):  # the micro-kernel's step
            mod.__class__ = FloatLinear  # same parameters, another forward
            n += 1
    return n


DEQUANT_SLICE = 1 << 22  # values a bf16 copy's float32 dequantization takes at a time (16 MiB)
# bf16 rows from which a packed layer's product runs on its bf16 copy where one is kept.
# Measured on an AMX Xeon, default model's decode steps: 1 row 17 ms on the copy vs 10.5-11.5
# on the packed blocks (a quarter of the bytes); 4 rows 19-19.5 vs 21-25; 8 rows 22.6-23 vs 34-35.
# 6, not 3: a batch-1 speculative verification of k <= 4 tokens (k + 1 rows) must compute what
# 1-row decode steps compute (the same exact-quant kernels) for greedy outputs to stay identical.
BF16_COPY_MIN_ROWS = 6
# A layer whose every segment has a row-interleaved copy: its few-row kernel is faster than the
# copy up to 8 rows (BENCHMARKS section 39; the C++ side's g_rows16_bf16_rows), and a
# verification of k <= 7 tokens then computes what 1-row steps do.
ROWS16_COPY_MIN_ROWS = 9
# A layer whose many-row products run on the AMX tiles over its interleaved copies
# (`amx_rows16_everywhere`): they beat oneDNN on the bf16 copy 1.2-2x from 9 to 64 rows; at 128
# rows 1.4x on SmolLM2's shapes but only level on a 1 B model's (Q4_K), whose 192-512 rows they
# run at 0.74-0.79x (SmolLM2's 256-1,024 at 0.97-1.11x hot, 2,048 at 0.72x; AMX Xeon, BENCHMARKS
# section 65). The copy serves the products of one tile row chunk + 1 rows and more
# (amx_copy_min_rows: the 1 B model's K of 2,048 / 8,192 from 129 / 65), and of this many at most:
# SmolLM2's prefill steps of 160 / 256 prompt tokens ran 1.25x / 1.05-1.10x faster on the tiles
# than on the copy, 384 level (the copy's 2 bytes a weight come from memory; section 71).
AMX_COPY_MIN_ROWS = 512


def amx_copy_min_rows(in_features: int) -> int:
    """Rows from which a layer whose many-row products run on the AMX tiles serves them on its
    bf16 copy: AMX_COPY_MIN_ROWS, or one chunk of the tile kernel's rows plus one at this K if
    that is fewer (past a chunk the kernel dequantizes the weights again). A 1 B model's K = 8,192
    (chunks of 64): Q4_K 1.31-1.48x oneDNN's copy at 32-64 rows, 0.89-0.92x at 80-128; Q6_K 1.05x
    at 64, 0.6-0.77x at 80-128 (AMX Xeon, BENCHMARKS section 68). SmolLM2's K (576, 1,536): 449
    and 161 (section 71)."""
    return min(AMX_COPY_MIN_ROWS, int(kernels.load().amx_rows16_chunk(in_features)) + 1)


def bf16_copies(model: nn.Module, dtype: torch.dtype, budget: CopyBudget | None = None) -> int:
    """A bfloat16 model's packed layers get a oneDNN-packed bf16 copy of their weights
    (`QuantLinear.attach_bf16_copy`) where the kernels run on a native-bf16 path
    (kernels.native_bf16_in_use: avx512_bf16 and the AMX ones, so PAGEDSERVE_CPU_ISA=avx512_vnni
    and below keep the packed kernels alone) and oneDNN packs bf16 here
    (PAGEDSERVE_NO_ONEDNN_PACK=1 turns it off), as far as `budget` allows (None: no bound).
    oneDNN's tiles run these products 2-10x faster than any of the packed kernels on AMX
    (BENCHMARKS section 33), its vdpbf16ps products 1.3-1.8x from 16 rows on a Zen 4 (section
    41). Not with `gguf_q8` (act_q8 layers keep its integer numerics). Where the AMX tiles read
    the layer's row-interleaved copies (`QuantLinear.amx_rows16_everywhere`: kernels.amx_rows16's
    types on AMX) the copy serves amx_copy_min_rows(K) rows and more only. Returns how many layers."""
    if dtype != torch.bfloat16 or not onednn_linear.available(torch.bfloat16) or not kernels.native_bf16_in_use():
        return 0
    n = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear) and mod.complete and not mod.act_q8:
            # rows16_copies came first
            if mod.amx_rows16_everywhere:
                min_rows = amx_copy_min_rows(mod.in_features)
            else:
                min_rows = ROWS16_COPY_MIN_ROWS if mod.rows16_everywhere else BF16_COPY_MIN_ROWS
            # gate_up halves where the copy serves many rows only (AMX): fewer rows keep the tiles
            n += mod.attach_bf16_copy(min_rows, budget, halves=mod.act_halves and mod.amx_rows16_everywhere)
    return n


def rows16_copies(model: nn.Module, budget: CopyBudget | None = None, drop_packed: bool = False) -> int:
    """The packed layers get their row-interleaved copies for the few-row kernels
    (`attach_rows16`; under `gguf_q8` the segments whose few-row products stay float, not
    `kernels.act_q8_type`: Q5_0 / Q5_1, Q6_K's six-bit copies below AVX512-VNNI; and those whose
    int8 kernel reads the copy, `kernels.rows16_q8_type`: Q4_0 / Q4_1 / Q4_K / Q5_K and Q6_K's byte
    layout from AVX2 up, Q8_0 and Q6_K's six bits from AVX512-VNNI up)
    where the kernels run on AVX2 or above (PAGEDSERVE_CPU_ISA=scalar: none), as far as `budget`
    allows (None: no bound). Returns how many layers.

    `drop_packed` (gguf_q8): each layer then gives up the packed rows its copies make useless
    (`QuantLinear.drop_packed_rows`; not rows an embedding reads, a tied LM head's), before the
    next layer's copies are made, and their bytes go back to `budget`: on AVX512-VNNI a Q4_0 /
    Q4_1 layer ends where it began in memory, a Q4_K / Q5_K one 2-3% above."""
    if kernels.current_isa() == "scalar":
        return 0
    n, freed = 0, 0
    keep = _shared_packed(model) if drop_packed else set()
    for mod in model.modules():
        if isinstance(mod, QuantLinear) and mod.complete:
            n += mod.attach_rows16(budget)
            if drop_packed:
                f = mod.drop_packed_rows(keep)
                freed += f
                if budget is not None:
                    budget.give_back(f)
    if freed:
        logger.info("gguf_q8: %.1f MB of packed rows dropped (their row-interleaved copies serve every product)", freed / 2**20)
    return n


def _shared_packed(model: nn.Module) -> set[int]:
    """Data pointers of the packed rows an embedding reads (a tied LM head shares them)."""
    return {m.weight_packed.data.data_ptr() for m in model.modules() if isinstance(m, QuantEmbedding)}


def _dropped(d: torch.Tensor) -> bool:
    """Whether a segment's packed rows were dropped (one byte expanded to their shape)."""
    return d.dim() == 2 and d.shape[1] > 1 and d.stride(1) == 0


def packed_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            for _, d, _ in mod.segments:
                if not _dropped(d) and d.data_ptr() not in seen:
                    seen.add(d.data_ptr())
                    total += d.numel()
    return total


__all__ = [
    "FloatLinear",
    "QuantLinear",
    "QuantEmbedding",
    "quantize_linears",
    "use_float_kernels",
    "bf16_copies",
    "rows16_copies",
    "packed_bytes",
    "kernels",
]


def load_packed(
    model: nn.Module, target: str, shard: int | None, sizes: list[int] | None, w: PackedWeight | torch.Tensor
) -> None:
    """Install checkpoint tensor `w` (packed, or a float part of an already packed layer) as
    `target` ("layers.0.self_attn.qkv_proj.weight"), shard `shard` of a fused layer."""
    mod_name, _, attr = target.rpartition(".")
    if attr != "weight":
        raise ValueError(f"{target}: only weights can be packed")
    mod = model.get_submodule(mod_name)
    parent, _, child = mod_name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    if isinstance(mod, nn.Embedding):
        if not isinstance(w, PackedWeight):
            raise TypeError(f"{target}: expected a packed weight")
        if w.shape != (mod.num_embeddings, mod.embedding_dim):
            raise ValueError(f"{target}: packed shape {w.shape} != {tuple(mod.weight.shape)}")
        setattr(owner, child, QuantEmbedding(w, mod.weight.dtype))
        return
    if isinstance(mod, nn.Linear):
        mod = QuantLinear(mod.in_features, sizes or [mod.out_features], mod.bias)
        setattr(owner, child, mod)
    if not isinstance(mod, QuantLinear):
        raise TypeError(f"{target}: a packed weight for a {type(mod).__name__}")
    mod.set_part(shard or 0, w)


def finish_packed(model: nn.Module) -> None:
    """After loading: a tied lm_head shares a packed embedding; every packed layer is whole."""
    emb = getattr(model, "embed_tokens", None)
    if isinstance(emb, QuantEmbedding) and getattr(model.config, "tie_word_embeddings", False):
        model.lm_head = QuantLinear.from_packed(emb.weight_packed)
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear) and not mod.complete:
            raise ValueError(f"{name}: packed layer is missing parts")
