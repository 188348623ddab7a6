"""The packed-weight C++ kernels (csrc/), compiled once per machine (executor/cpp_build.py).

One module holds a portable scalar path, an AVX2+FMA path (avx_vnni: its int8-activation
products on AVX-VNNI's vpdpbusd where the CPU has it), an AVX-512 path and, above it,
avx512_vnni (vpdpbusd in the int8-activation kernels), avx512_bf16 (and the bf16 products of
bfloat16 models: many rows, and few rows on the row-interleaved copies) and amx_bf16 /
amx_int8 (AMX tiles present and granted by Linux: a bf16 model's Q4_0 / Q4_1 / Q4_K / Q5_0 /
Q5_1 / Q5_K / Q8_0 products of 1-16 rows, and Q6_K's (six-bit copies) of 2-16, on the exact
tile kernel, csrc/quant_rows16_amx_exact.h; more rows on the tiles over bf16-rounded weights,
csrc/quant_rows16_amx.h; other types' many rows through oneDNN, which runs
them on the tiles). The best one the CPU has is used, or the
one named by PAGEDSERVE_CPU_ISA (those names; a path the CPU lacks is an error). `set_isa()` switches at run time (tests run every
available path).
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import torch

from pagedserve import envs
from pagedserve.executor.cpp_build import load_extension

_DIR = os.path.join(os.path.dirname(__file__), "csrc")
# included by quant_kernels.cpp (one file per ISA, and what they share): every header of csrc/,
# part of the build key
_HEADERS = tuple(sorted(f for f in os.listdir(_DIR) if f.endswith(".h")))
_OPS_HEADERS = ("avx512_transpose.h", "isa_target.h")
# The paths by name -> the module's level. avx_vnni is the avx2 level with its int8-activation
# (gguf_q8) products on AVX-VNNI's vpdpbusd (the same bits; the CPUs with AVX2 and AVX-VNNI but
# no AVX-512: Alder Lake and later clients, Sierra Forest): the auto choice there; avx2 forces
# vpmaddubsw.
ISAS = {
    "scalar": 0,
    "avx2": 1,
    "avx_vnni": 1,
    "avx512": 2,
    "avx512_vnni": 3,
    "avx512_bf16": 4,
    "amx_bf16": 5,
    "amx_int8": 6,
}


_load_lock = threading.Lock()


def load():
    """The compiled module (built once per machine by executor/cpp_build.py: about a
    minute). Raises if it cannot be built: packed weights have no Python fallback fast
    enough to be worth running (`try_load` says None instead). Threads that ask at once
    (cpp_build.build_all's, the attention module's load) wait for one build."""
    with _load_lock:
        return _load()


@functools.cache
def _load():
    mod = load_extension(
        "quant",
        [os.path.join(_DIR, "quant_kernels.cpp")],
        headers=(
            *(os.path.join(_DIR, h) for h in _HEADERS),
            *(os.path.join(_DIR, os.pardir, os.pardir, "ops", "csrc", h) for h in _OPS_HEADERS),
        ),
        cflags=("-O3", "-fopenmp", "-fno-math-errno"),
        ldflags=("-fopenmp",),
        expected_seconds=40,
    )
    check_amx(mod)
    isa = (envs.PAGEDSERVE_CPU_ISA or "auto").strip().lower()
    if isa != "auto":
        _set(mod, isa)
    return mod


def check_amx(mod) -> bool:
    """Where the CPU has AMX tiles, ask Linux for their state (arch_prctl ARCH_REQ_XCOMP_PERM);
    refused, say so once: the AMX levels are then unavailable and avx512_bf16 runs. True when
    the tiles may be used."""
    if not mod.amx_in_cpu() and mod.amx_permission() < 0:
        return False
    err = mod.amx_permission()
    if err < 0:
        err = mod.request_amx_permission()
    if err != 0:
        logging.getLogger(__name__).warning(
            "pagedserve: the CPU has AMX tiles but Linux refused this process their state (%s); "
            "bf16 products run on avx512_bf16",
            os.strerror(err),
        )
        return False
    return True


def try_load():
    """The module, or None where it cannot be built (or PAGEDSERVE_NO_CPP_KERNELS=1)."""
    if envs.PAGEDSERVE_NO_CPP_KERNELS:
        return None
    try:
        return load()
    except Exception as e:  # noqa: BLE001 (no compiler, no headers: the callers fall back)
        logging.getLogger(__name__).warning("pagedserve: packed-weight kernels unavailable (%s)", e)
        return None


# Called after every set_isa: modules whose own routes follow the path register here (the
# attention kernels' bf16 decode, attention/cpu_kernels.py, which reads it once at its load).
_isa_listeners: list = []


def on_isa_change(fn) -> None:
    """Call fn() after every later set_isa."""
    _isa_listeners.append(fn)


def _available(mod, isa: str) -> bool:
    return bool(mod.isa_available(ISAS[isa])) and (isa != "avx_vnni" or bool(mod.avx_vnni_in_cpu()))


def _set(mod, isa: str) -> None:
    if isa not in ISAS:
        raise ValueError(f"PAGEDSERVE_CPU_ISA must be one of {', '.join(ISAS)} (or auto), got {isa!r}")
    if not _available(mod, isa):
        raise RuntimeError(f"PAGEDSERVE_CPU_ISA={isa}: this CPU lacks that instruction set")
    mod.set_isa(ISAS[isa])
    if ISAS[isa] == ISAS["avx2"]:
        mod.set_avx_vnni(isa == "avx_vnni")


def available_isas() -> list[str]:
    """The paths this CPU runs, lowest first."""
    mod = load()
    return [name for name in ISAS if _available(mod, name)]


def set_isa(isa: str) -> str:
    """Force a kernel path; returns the previous one."""
    mod = load()
    prev = current_isa()
    _set(mod, isa)
    for fn in _isa_listeners:
        fn()
    return prev


def current_isa() -> str:
    mod = load()
    i = mod.get_isa()
    if i == ISAS["avx2"]:
        return "avx_vnni" if mod.avx_vnni_in_use() else "avx2"
    return next(k for k, v in ISAS.items() if v == i)


def amx_in_use() -> bool:
    """Whether the kernels run on an AMX path now (the CPU has the tiles, Linux granted them,
    and neither PAGEDSERVE_CPU_ISA nor set_isa chose a path below); False without the kernels.
    The one answer the AMX-only routes read (the prefill attention tiles, MoE's tile kernel)."""
    return try_load() is not None and current_isa().startswith("amx")


def native_bf16_in_use() -> bool:
    """Whether the kernels run on a path whose CPU computes bf16 natively now (avx512_bf16 or
    an AMX one; PAGEDSERVE_CPU_ISA / set_isa below it: no); False without the kernels. The
    answer the bf16 copies of packed weights read (quant/layers.py)."""
    return try_load() is not None and ISAS[current_isa()] >= ISAS["avx512_bf16"]


def set_prefill_rows(m: int) -> int:
    """From this many activation rows on, the many-row path: the blocked kernel over
    dequantized chunks of rows (AVX2), else dequantized weight tiles and the float GEMM."""
    return int(load().set_prefill_rows(int(m)))


def set_q8_many_rows(m: int) -> int:
    """act_q8 with Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K weights: from this many rows on, the
    column-interleaved integer kernel; below it, the few-row integer kernel (returns the previous
    value)."""
    return int(load().set_q8_many_rows(int(m)))


def set_float_blas_rows(m: int) -> int:
    """Packed weights' float32 products on the AVX-512 levels: the AVX2 many-row kernel below this
    many rows (512), dequantized tiles + BLAS from it. Returns the previous value."""
    return int(load().set_float_blas_rows(int(m)))


def set_int8_rows(qtype: int, m: int) -> int:
    """act_q8 with a K-quant's weights (Q4_K, Q5_K, Q6_K): int8 activations from m rows; fewer keep
    float activations on the row-interleaved copy, the faster few-row product there. -1 (the
    default): Q4_K and Q5_K at every row count (their int8 kernels on the copy beat its float and
    bf16 ones, BENCHMARKS section 63), Q6_K too where an int8 kernel reads its copy
    (rows16_q8_type: AVX512-VNNI, or the byte layout; section 64), else from 9 rows.
    Returns the previous value."""
    return int(load().set_int8_rows(int(qtype), int(m)))


def set_bf16_rows(m: int, rows16: bool = False) -> int:
    """bfloat16 models on avx512_bf16 and up: from this many activation rows (6; rows16: for
    segments with an interleaved copy, 9), block-type products run on the many-row bf16
    kernels, the weights' exact quants against the bf16 activations; below it the float path,
    or a segment's interleaved copy on its bf16 kernel (set_rows16_bf16). Returns the previous
    value."""
    return int(load().set_bf16_rows(int(m), bool(rows16)))


def set_bf16_onednn_rows(m: int, amx: bool = False) -> int:
    """From this many rows the bf16 products go to oneDNN (split bf16 weight tiles, at::mm),
    below it to the vdpbf16ps kernel; amx: the threshold of the AMX levels (32 rows, where
    oneDNN runs on the tiles; unmeasured) instead of avx512_bf16's (off: the kernel won every
    shape measured). Returns the previous value."""
    return int(load().set_bf16_onednn_rows(int(m), bool(amx)))


def gemm_bf16(x: torch.Tensor, w: torch.Tensor, qtype: int, out: torch.Tensor, col0: int = 0, onednn: bool = False,
              interleaved: torch.Tensor | None = None):
    """out[:, col0:col0+N] (float32) = x (bf16) @ dequant(w).T on the bf16 units (block types);
    interleaved: w's interleave_rows16 copy, read by the few-row kernel of csrc/quant_rows16_bf16.h."""
    load().gemm_bf16(x, w, int(qtype), out, int(col0), bool(onednn), interleaved)


def gemm_amx_rows16(x: torch.Tensor, w: torch.Tensor, interleaved: torch.Tensor, qtype: int, out: torch.Tensor,
                    col0: int = 0) -> None:
    """out[:, col0:col0+N] (float32) = x (bf16) @ dequant(w).T on the AMX tiles, the weights read
    from `interleaved` (w's interleave_rows16 copy; Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K,
    Q6_K's six-bit one) and rounded to bf16 as
    they are used (csrc/quant_rows16_amx.h). Needs an AMX path."""
    load().gemm_amx_rows16(x, w, interleaved, int(qtype), out, int(col0))


def gemm_amx_exact(x: torch.Tensor, w: torch.Tensor, interleaved: torch.Tensor, qtype: int, out: torch.Tensor,
                   col0: int = 0) -> None:
    """out[:, col0:col0+N] (float32) = x (bf16, 1-16 rows) @ dequant(w).T on the AMX tiles, the
    quants exact (no weight rounded), read from `interleaved` (w's interleave_rows16 copy; Q4_0 /
    Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q8_0, Q6_K's six-bit one; csrc/quant_rows16_amx_exact.h). A row's result does
    not depend on the others.
    Needs an AMX path."""
    load().gemm_amx_exact(x, w, interleaved, int(qtype), out, int(col0))


def set_amx_exact_rows(m: int) -> int:
    """A bfloat16 model's Q4_0 / Q4_1 / Q4_K / Q5_x / Q8_0 products of 1 .. m rows, Q6_K's (six-bit
    copies) of 2 .. m (16, the default and the most; 0: off) on the exact AMX kernel where the layer keeps an interleaved copy, on an AMX
    path. Returns the previous m."""
    return int(load().set_amx_exact_rows(int(m)))


def set_rows16_bf16(on: bool | None) -> bool:
    """Whether a bf16 model's few-row products on interleaved copies run on the bf16 units
    (csrc/quant_rows16_bf16.h) or on float activations (csrc/quant_rows16.h); None: the rule
    (the default: the bf16 kernel, but on the AMX levels the float one for Q4_0 / Q4_1 / Q8_0,
    measured faster there). Returns whether Q4_1's took the bf16 kernel before."""
    return bool(load().set_rows16_bf16(None if on is None else bool(on)))


def amx_rows16(qtype: int) -> bool:
    """Whether a bfloat16 model's products of this type from 9 rows (the exact kernel's types: past
    its 16, set_amx_exact_rows) run on the AMX tiles over the row-interleaved copy (csrc/quant_rows16_amx.h: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K, Q6_K's six bits; weights dequantized to
    bf16 as they are used) where the layer keeps one, on the path set now: an AMX path and
    set_amx_rows16 on. 1.2-2x oneDNN on the bf16 copies at 9-64 rows (BENCHMARKS section 65);
    such layers' bf16 copies serve the products from layers.amx_copy_min_rows(K) rows."""
    return try_load() is not None and bool(load().amx_rows16(int(qtype)))


def set_amx_rows16(on: bool) -> bool:
    """The AMX tile products over the copies on (the default) or off (then the vdpbf16ps kernel
    below the bf16 copies' rows, as below AMX). Returns the previous setting."""
    return bool(load().set_amx_rows16(bool(on)))


def set_q6k_six_bits(on: bool) -> bool:
    """Whether Q6_K's interleaved copies keep six bits a quant (the packed size; the default
    where the CPU has AVX512-VBMI, which their kernels need: csrc/quant_rows16_q6k_vbmi.h and
    gguf_q8's quant_rows16_q6k_vnni.h, unless
    PAGEDSERVE_CPU_ISA forced a path below avx512) or a byte (30% more). Copies written before a
    switch no longer fit the kernels (other size). Returns the previous setting; RuntimeError
    asking for six bits without AVX512-VBMI."""
    return bool(load().set_q6k_six_bits(bool(on)))


def q6k_six_bits() -> bool:
    """Whether Q6_K's interleaved copies keep six bits a quant now (set_q6k_six_bits)."""
    return bool(load().q6k_six_bits())


def has_many_rows_kernel() -> bool:
    """Whether the current path has the blocked many-row kernel (AVX2 today)."""
    return bool(load().has_many_rows_kernel())


def gemm(x: torch.Tensor, w: torch.Tensor, qtype: int, out: torch.Tensor, col0: int = 0, act_q8: bool = False,
         interleaved: torch.Tensor | None = None) -> None:
    """out[:, col0:col0+N] = x @ dequant(w).T; act_q8: activations quantized to int8 blocks first
    (the act_q8_type ones: Q4_0 / Q4_1 / Q8_0; the K-quants from set_int8_rows's rows; others
    ignore it);
    interleaved: w's interleave_rows16 copy, which the few-row float products then read on
    AVX2 and above (Q6_K's six-bit copy: AVX-512 and above), and act_q8's int8 ones where
    rows16_q8_type (below set_rows16_q8_rows's rows)."""
    load().gemm(x, w, int(qtype), out, int(col0), bool(act_q8), interleaved)


def interleave_rows16(w: torch.Tensor, qtype: int, k: int) -> torch.Tensor | None:
    """Packed rows -> the copy the few-row kernels read (16 rows' blocks side by side,
    csrc/quant_rows16_layout.h: the same bytes again; Q4_K's 2.8% and Q5_K's 2.3% more, their
    scales unpacked; Q6_K's the same where the CPU has AVX512-VBMI, else 30% more, a byte a
    quant), or None where it does not apply (types other than Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 /
    Q4_K / Q5_K / Q6_K, rows not a multiple of 16, the scalar path; Q6_K's six-bit copy on the
    AVX2 path, whose kernel reads the byte layout only)."""
    out = load().interleave_rows16(w, int(qtype), int(k))
    return out if out.numel() else None


def act_q8_rows(qtype: int, m: int) -> bool:
    """Whether gguf_q8 (act_q8) runs this type's product over m activation rows on int8 ones."""
    return bool(load().act_q8_rows(int(qtype), int(m)))


def act_q8_type(qtype: int) -> bool:
    """Whether gguf_q8 (act_q8) runs this type's products on int8 activations at every row count
    (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K; Q6_K where rows16_q8_type), so that its layers need no float few-row copy (an int8 kernel
    may read one: rows16_q8_type).
    The K-quants otherwise run on int8 activations from set_int8_rows's rows (act_q8_rows); the
    other types keep float ones."""
    return bool(load().act_q8_type(int(qtype)))


def rows16_q8_type(qtype: int) -> bool:
    """Whether act_q8 (gguf_q8) runs this type's products on its row-interleaved copy where the layer
    keeps one, on the path set now: Q4_0 / Q4_1 / Q4_K / Q5_K and Q6_K's byte layout from AVX2 up
    (csrc/quant_rows16_q8_avx2.h), Q8_0 and Q6_K's six bits too from AVX512-VNNI up
    (csrc/quant_rows16_vnni.h, quant_rows16_q6k_vnni.h); at 1-8 rows 0.3-0.9x the packed rows'
    time (BENCHMARKS sections 63-64)."""
    return bool(load().rows16_q8_type(int(qtype)))


def rows16_q8_every_row(qtype: int) -> bool:
    """Whether act_q8 (gguf_q8) runs every product of this type on its row-interleaved copy, at
    any row count, on the path set now (AVX512-VNNI: Q4_0 / Q4_1 / Q4_K / Q5_K), so that a layer
    with the copy needs no packed rows (quant/layers.py's drop_packed_rows)."""
    return bool(load().rows16_q8_every_row(int(qtype)))


def set_rows16_q8_rows(qtype: int, m: int) -> int:
    """act_q8 on a Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K layer's row-interleaved copy below this
    many rows, the packed rows' kernels from it; -1 (the default): the ISA's rule (AVX512-VNNI:
    every row count, Q8_0 and Q6_K 64; below it 12, Q6_K 32). Returns the previous value."""
    return int(load().set_rows16_q8_rows(int(qtype), int(m)))


def rows16_copy_size(w: torch.Tensor, qtype: int, k: int) -> int:
    """Bytes `interleave_rows16` would return (0: no copy applies)."""
    return int(load().rows16_copy_size(w, int(qtype), int(k)))


def dequant(w: torch.Tensor, qtype: int, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    return load().dequant(w, int(qtype), int(k), rows)
