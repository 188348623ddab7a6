"""Packed-weight kernels against gguf's numpy dequantization plus a float64 matmul.

Every type, odd shapes (N odd, K not a multiple of 256 where the block allows), M = 1, 3, 64,
300 through both the few-rows kernel and the dequantize-tile + GEMM path, on every instruction
set this CPU has (the others are skipped with the reason): the float kernels on scalar / avx2 /
avx512, the int8-activation ones also on avx512_vnni (bit-equal to avx2's), the bf16 many-row
products of bfloat16 models on avx512_bf16; the AMX levels' refusal path simulated."""

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from pagedserve.executor.quant import kernels  # noqa: E402

try:
    kernels.load()
    HAVE_KERNELS, WHY = True, ""
except Exception as e:  # noqa: BLE001
    HAVE_KERNELS, WHY = False, f"quant kernels do not build here: {e}"

pytestmark = pytest.mark.skipif(not HAVE_KERNELS, reason=WHY or "no kernels")

# byte offsets of the float16 scale fields inside one block
FP16_FIELDS = {
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q8_0: [0],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
}
TYPES = list(FP16_FIELDS)


def random_packed(qtype, n, k, seed=0):
    """Random blocks with finite, moderate float16 scales."""
    rng = np.random.default_rng(seed)
    be, bb = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // be, bb), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        raw[..., off : off + 2] = (
            rng.uniform(-0.05, 0.05, size=(n, k // be))
            .astype(np.float16)
            .view(np.uint8)
            .reshape(n, k // be, 2)
        )
    return raw.reshape(n, k // be * bb)


def reference(x, raw, qtype, k):
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(raw.shape[0], k)
    return x.double().numpy() @ w.T, np.abs(x.double().numpy()) @ np.abs(w).T


def isa_param(names=None):
    out = []
    for isa in names or kernels.ISAS:
        ok = HAVE_KERNELS and isa in kernels.available_isas()
        out.append(pytest.param(isa, marks=pytest.mark.skipif(not ok, reason=f"this CPU lacks {isa}")))
    return out


# The levels above avx512 run its float kernels (dequantization, float-activation products):
# the float tests run the paths that have their own code; the act_q8 tests add avx512_vnni
# (its integer kernels; avx512_bf16 and the AMX levels run those same ones).
FLOAT_ISAS = ("scalar", "avx2", "avx512")
Q8_ISAS = ("scalar", "avx2", "avx_vnni", "avx512", "avx512_vnni")


def _forced(request):
    prev = kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(prev)


def _forced_q8(request):
    """An ISA, with the K-quants' act_q8 products on int8 activations at every row count (by
    default their few rows may stay float: test_kquant_act_q8_rows_follow_the_isa), so the act_q8
    tests below run their int8 few-row tiles too."""
    prev = kernels.set_isa(request.param)
    with int8_rows(1):
        yield request.param
    kernels.set_isa(prev)


isa = pytest.fixture(params=isa_param(FLOAT_ISAS), name="isa")(_forced)
q8_isa = pytest.fixture(params=isa_param(Q8_ISAS), name="q8_isa")(_forced_q8)


def ks_for(qtype):
    be = gguf.GGML_QUANT_SIZES[qtype][0]
    return [96, 576] if be == 32 else [512]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequant_matches_gguf(isa, qtype):
    for k in ks_for(qtype):
        raw = random_packed(qtype, 5, k)
        ref = gguf.quants.dequantize(raw, qtype).reshape(5, k)
        got = kernels.dequant(torch.from_numpy(raw), int(qtype), k).numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
        rows = torch.tensor([4, 0, 4, 2])
        got = kernels.dequant(torch.from_numpy(raw), int(qtype), k, rows).numpy()
        np.testing.assert_allclose(got, ref[[4, 0, 4, 2]], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 5, 8, 11, 17, 64, 300])
def test_gemm_matches_dequantized_matmul(isa, qtype, m):
    n = 37
    for k in ks_for(qtype):
        raw = random_packed(qtype, n, k, seed=m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m))
        ref, mag = reference(x, raw, qtype, k)
        w = torch.from_numpy(raw)
        for prefill_rows in (16, 10**9):  # the GEMM path (from 16 rows here) and the few-rows kernel at any m
            if m < 16 and prefill_rows == 16:
                continue
            if m == 300 and prefill_rows > 16 and isa == "scalar":
                continue  # slow and adds nothing the m=64 case does not check
            old = kernels.set_prefill_rows(prefill_rows)
            try:
                out = torch.full((m, n + 5), 7.0)
                kernels.gemm(x, w, int(qtype), out, 3)
            finally:
                kernels.set_prefill_rows(old)
            got = out[:, 3 : 3 + n].numpy()
            assert np.all(np.abs(got - ref) <= 2e-6 * mag + 1e-6), (k, prefill_rows, np.abs(got - ref).max())
            assert torch.all(out[:, :3] == 7.0) and torch.all(out[:, 3 + n :] == 7.0)  # only its columns


@pytest.mark.skipif(not HAVE_KERNELS or "avx512" not in kernels.available_isas(), reason="this CPU lacks avx512f")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_avx512_float_many_rows_take_the_avx2_kernel_below_the_blas_rows(qtype):
    """A float32 product of packed weights on the AVX-512 levels from the prefill threshold up to
    set_float_blas_rows (512) runs the AVX2 many-row kernel: the AVX2 level's bits exactly; from
    there the dequantized tiles + BLAS, within float rounding of it."""
    n, k = 37, 512
    w = torch.from_numpy(random_packed(qtype, n, k, seed=3))
    for m, blas_from in ((12, 512), (40, 512), (40, 40)):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        outs = {}
        for isa in ("avx2", "avx512"):
            prev, old = kernels.set_isa(isa), kernels.set_float_blas_rows(blas_from)
            try:
                outs[isa] = torch.zeros(m, n)
                kernels.gemm(x, w, int(qtype), outs[isa], 0)
            finally:
                kernels.set_isa(prev)
                kernels.set_float_blas_rows(old)
        if m < blas_from:
            assert torch.equal(outs["avx512"], outs["avx2"]), m
        else:
            ref, mag = reference(x, w.numpy(), qtype, k)
            assert np.all(np.abs(outs["avx512"].numpy() - ref) <= 2e-6 * mag + 1e-6), m


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tiled_few_rows_bits_do_not_depend_on_the_other_rows(isa, qtype):
    """Every type's few-row float products on the packed rows (no copy: quant_avx2.h's fused
    tiles for Q4_0 / Q4_1 / Q8_0, quant_kquant_avx2.h's for the K-quants and Q5_0 / Q5_1, the
    AVX-512 ones, the scalar code) give each activation row the bits it gets alone, whatever the
    tile (1-8 rows) it falls in: a verification of k tokens computes what 1-row steps do."""
    n, k, rows = 21, 512, 11
    w = torch.from_numpy(random_packed(qtype, n, k, seed=7))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(9))
    together = torch.zeros(rows, n)
    old = kernels.set_prefill_rows(10**9)  # every row count on the few-row kernels
    try:
        kernels.gemm(x, w, int(qtype), together, 0)
        for r in (0, 3, 7, rows - 1):
            for lo in {0, max(0, r - 2), max(0, r - 5), r}:
                part = torch.zeros(r + 1 - lo, n)
                kernels.gemm(x[lo : r + 1].contiguous(), w, int(qtype), part, 0)
                assert torch.equal(part[-1], together[r]), (r, lo)
    finally:
        kernels.set_prefill_rows(old)


def quantize_q8_reference(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's q8 activations, in float32 as the kernel computes them: per 32-element
    block, scale max|x| / 127, quants round-half-even(x / scale); returns scale * quants."""
    b = x.reshape(x.shape[0], -1, 32)
    d = b.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(b * inv) * d).reshape(x.shape)


# gguf_q8's int8-activation types (Q4_K / Q5_K: sub-blocks as Q4_1 / Q5_1; Q6_K: centred blocks of
# 32, halves scaled)
ACT_Q8_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
SUPER_BLOCKS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)  # K a multiple of 256
# a block's quant bytes (Q4_K: past d, dmin and scales; Q5_K: qh and qs, past them; Q6_K: ql and
# qh, before scales and d)
QUANT_BYTES = {Q.Q4_1: (4, 20), Q.Q4_0: (2, 18), Q.Q8_0: (2, 34), Q.Q4_K: (16, 144), Q.Q5_K: (16, 176), Q.Q6_K: (0, 192)}


@pytest.mark.parametrize("qtype", ACT_Q8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 5, 9, 13, 14, 40, 64, 100])
def test_gemm_act_q8_matches_quantized_activation_matmul(q8_isa, qtype, m):
    """act_q8 ("gguf_q8"): the integer paths (few rows; many rows over column-interleaved int8
    weights) equal (q8-quantized x) @ dequantized w up to float rounding, and stay near the
    float product. Odd N: whole groups of 8 columns, a pair and a single one, a partial last
    group; K of 3 and 48 blocks (Q4_K: 1, 2 and 6 super-blocks); rows in tiles of 3 with 1- and
    2-row tails (Q8_0 takes the many-row kernel from 12 rows: 13 and 14 give its tails). Each
    row count through both nibble kernels (the many-row one forced from 1 row, then never)."""
    ks = (512, 256, 1536, 512) if qtype in SUPER_BLOCKS else (576, 96, 1536, 576)
    for (n, k), many_from in zip(zip((37, 21, 13, 37), ks), (1, 1, 1, 10**9)):
        raw = random_packed(qtype, n, k, seed=m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
        x[0, :32] = 0.0  # an all-zero block: scale 0
        xq = quantize_q8_reference(x)
        ref, mag = reference(xq, raw, qtype, k)
        exact, _ = reference(x, raw, qtype, k)
        out = torch.full((m, n + 4), 7.0)
        old = kernels.set_q8_many_rows(many_from)
        try:
            kernels.gemm(x, torch.from_numpy(raw), int(qtype), out, 1, act_q8=True)
        finally:
            kernels.set_q8_many_rows(old)
        got = out[:, 1 : 1 + n].numpy()
        assert np.all(np.abs(got - ref) <= 2e-6 * mag + 1e-5), (n, k, np.abs(got - ref).max())
        assert torch.all(out[:, :1] == 7.0) and torch.all(out[:, 1 + n :] == 7.0)  # only its columns
        rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        assert 1e-4 < rel < 2e-2, rel  # quantized activations: close to, not equal to, the float product


def _act_q8_out(isa, x, raw, qtype, n, many_from):
    prev = kernels.set_isa(isa)
    old = kernels.set_q8_many_rows(many_from)
    oldp = kernels.set_prefill_rows(many_from)  # Q8_0's many-row threshold
    try:
        with int8_rows(1):  # the K-quants' int8 few-row tiles too
            out = torch.full((x.shape[0], n + 2), 7.0)
            kernels.gemm(x, torch.from_numpy(raw), int(qtype), out, 1, act_q8=True)
    finally:
        kernels.set_q8_many_rows(old)
        kernels.set_prefill_rows(oldp)
        kernels.set_isa(prev)
    assert torch.all(out[:, 0] == 7.0) and torch.all(out[:, -1] == 7.0)
    return out[:, 1 : 1 + n]


def _extreme_blocks(raw, qtype, rng):
    """Some blocks at the quants' extremes: nibbles all 15 or all 0 (Q6_K: quants 63 or 0, i.e.
    31 or -32 centred), Q8_0 bytes -128 / -127 / 127."""
    be, bb = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(raw.shape[0], -1, bb).copy()
    first, end = QUANT_BYTES[qtype]
    values = (0x80, 0x81, 0x7F) if qtype == Q.Q8_0 else (0xFF, 0x00)
    pick = rng.random(blocks.shape[:2]) < 0.4
    blocks[pick, first:end] = np.uint8(rng.choice(values))
    return blocks.reshape(raw.shape[0], -1)


@pytest.mark.parametrize("qtype", ACT_Q8_TYPES, ids=lambda t: t.name)
def test_act_q8_few_rows_bits_do_not_depend_on_the_other_rows(q8_isa, qtype):
    """gguf_q8's few-row tiles give each activation row the bits it gets alone, whatever the
    tile it falls in: one row (Q4_K's AVX2 tile then decodes a super-block's 8 scales at once,
    q4k_scales8) sums as the same row among 2-8 (each sub-block's scale as it goes; on VNNI,
    Q4_K's own tile from 3 rows, and column pairs where rows are short). Random scale bytes,
    so every 6-bit field of Q4_K's packing is exercised."""
    rows = 8
    for n, k in ((21, 512), (5, 1536)) if qtype in SUPER_BLOCKS else ((21, 576), (5, 1536)):
        w = torch.from_numpy(random_packed(qtype, n, k, seed=11))
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(13)) * 3
        together = torch.zeros(rows, n)
        old = kernels.set_q8_many_rows(10**9)
        oldp = kernels.set_prefill_rows(10**9)
        try:
            kernels.gemm(x, w, int(qtype), together, 0, act_q8=True)
            for r in (0, 2, 5, rows - 1):
                for lo in {0, max(0, r - 1), max(0, r - 4), r}:
                    part = torch.zeros(r + 1 - lo, n)
                    kernels.gemm(x[lo : r + 1].contiguous(), w, int(qtype), part, 0, act_q8=True)
                    assert torch.equal(part[-1], together[r]), (n, k, r, lo)
        finally:
            kernels.set_q8_many_rows(old)
            kernels.set_prefill_rows(oldp)


@pytest.mark.parametrize("vnni", isa_param(("avx512_vnni", "avx_vnni")))
@pytest.mark.parametrize("qtype", ACT_Q8_TYPES, ids=lambda t: t.name)
def test_act_q8_vnni_bit_equal_to_avx2(vnni, qtype):
    """vpdpbusd gives the AVX2 kernels' exact integer block sums and then their float steps
    lane for lane: the outputs' bits are equal. AVX512-VNNI (few rows: 512-bit over column pairs
    where rows are short, K up to 576 here, else 256-bit one column at a time, Q4_K's own tile
    from 3 rows; many rows: 16 columns a register, the repack 8 columns' rows at a time); AVX-VNNI
    (the AVX2 kernels themselves with each step one 256-bit vpdpbusd into 32-bit sums where
    they sum vpmaddubsw's pairs in 16 bits). Odd N (partial groups of 16 and 8 columns, a single
    column), K of 1 to 48 blocks, row tails of the 4-row micro-kernel, extreme quants against x
    at +-127 and at random, an all-zero block."""
    rng = np.random.default_rng(int(qtype))
    shapes = ((37, 512), (1, 256), (17, 768), (33, 1536)) if qtype in SUPER_BLOCKS else ((37, 576), (1, 32), (2, 64), (17, 96), (33, 1536))
    for n, k in shapes:
        raw = _extreme_blocks(random_packed(qtype, n, k, seed=n), qtype, rng)
        for m in (1, 2, 3, 5, 7, 13, 17, 64):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 3
            x[0, :32] = 0.0
            x[m // 2, 32:] = torch.where(torch.rand(k - 32, generator=torch.Generator().manual_seed(m)) < 0.5, -1.0, 1.0)
            for many_from in (1, 10**9):  # the many-row kernel at every m, then the few-row one
                ref = _act_q8_out("avx2", x, raw, qtype, n, many_from)
                got = _act_q8_out(vnni, x, raw, qtype, n, many_from)
                assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (n, k, m, many_from, (got - ref).abs().max())


ROWS16_Q8_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def q6k_layouts(qtype):
    """The copy layouts a test walks: Q6_K's byte layout, and its six bits where the CPU has
    AVX512-VBMI (and the path is AVX-512); one (None: as it is) for the other types."""
    if qtype != Q.Q6_K:
        return [None]
    return [False, True] if HAVE_VBMI and kernels.ISAS[kernels.current_isa()] >= kernels.ISAS["avx512"] else [False]


@pytest.mark.parametrize("qtype", ROWS16_Q8_TYPES, ids=lambda t: t.name)
def test_act_q8_on_the_copy_gives_the_many_row_kernels_bits(q8_isa, qtype):
    """gguf_q8 on a row-interleaved copy (quant_rows16_vnni.h on AVX512-VNNI: 16 output rows a
    register, Q4's nibbles gathered by one vpshufb a chunk, Q8_0's bytes transposed; Q6_K's
    quant_rows16_q6k_vnni.h on its six-bit copy, vpermb + vpmultishiftqb, and on its byte copy, as
    Q8_0; quant_rows16_q8_avx2.h below it: halves of 8 rows, vpmaddubsw, Q4_0 / Q4_1 / Q4_K / Q5_K
    and Q6_K's byte layout, transposed a dword a row) sums
    each block exactly and then rounds as the many-row kernel on the packed rows, so their
    outputs' bits are equal at every row count (tiles of 1-8 rows, the AVX2 kernel's of 1-4, and
    their tails), and a row's bits do not depend on the rows computed with it. Q4_K / Q5_K: each
    sub-block of 32 a Q4_1 / Q5_1 block (Q5_K's fifth bits from the copy's masks); Q6_K's halves
    times their int8 scales. One to ten groups of 16 rows, K of 1 to 48 blocks (1 to 6
    super-blocks), extreme quants against x at +-127, an all-zero block, random scales; only its
    own columns are written."""
    rng = np.random.default_rng(int(qtype) + 100)
    mod = kernels.load()
    shapes = ((16, 256), (48, 512), (160, 1536)) if qtype in SUPER_BLOCKS else ((16, 32), (48, 96), (160, 576), (32, 1536))
    ran = 0
    for six in q6k_layouts(qtype):
        prev = kernels.set_q6k_six_bits(six) if six is not None else None
        try:
            if not kernels.rows16_q8_type(int(qtype)):  # (Q6_K's six bits below AVX512-VNNI)
                continue
            for n, k in shapes:
                raw = torch.from_numpy(_extreme_blocks(random_packed(qtype, n, k, seed=n), qtype, rng))
                copy = kernels.interleave_rows16(raw, int(qtype), k)
                _copy_bits_equal(mod, q8_isa, raw, copy, qtype, n, k)
                ran += 1
        finally:
            if six is not None:
                kernels.set_q6k_six_bits(prev)
    if not ran:
        pytest.skip(f"no int8 kernel reads {qtype.name}'s copy on the {q8_isa} path")


def _copy_bits_equal(mod, q8_isa, raw, copy, qtype, n, k):
    """The copy's int8 kernel against the packed rows' many-row kernel, bit for bit, at 1-40 rows."""
    for m in (1, 2, 3, 5, 8, 9, 17, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 3
        x[0, :32] = 0.0
        x[m // 2, 32:] = torch.where(torch.rand(k - 32, generator=torch.Generator().manual_seed(m)) < 0.5, -1.0, 1.0)
        out = torch.full((m, n + 2), 7.0)
        before = mod.rows16_q8_calls()
        old = kernels.set_rows16_q8_rows(int(qtype), 10**9)  # (below AVX512-VNNI: from 12 rows by default)
        try:
            kernels.gemm(x, raw, int(qtype), out, 1, act_q8=True, interleaved=copy)
        finally:
            kernels.set_rows16_q8_rows(int(qtype), old)
        assert mod.rows16_q8_calls() == before + 1
        assert torch.all(out[:, 0] == 7.0) and torch.all(out[:, -1] == 7.0)
        ref = _act_q8_out(q8_isa, x, raw.numpy(), qtype, n, 1)  # the packed rows' many-row kernel
        assert torch.equal(out[:, 1:-1].view(torch.int32), ref.view(torch.int32)), (n, k, m)
        r = m - 1
        alone = torch.zeros(1, n)
        kernels.gemm(x[r:].contiguous(), raw, int(qtype), alone, 0, act_q8=True, interleaved=copy)
        assert torch.equal(alone[0], out[r, 1:-1]), (n, k, m)


@pytest.mark.skipif(not HAVE_KERNELS, reason="no C++ kernels")
def test_act_q8_reads_the_copy_where_its_kernel_runs():
    """Which types' copies the int8 kernels read (rows16_q8_type), on each path: Q4_0 / Q4_1 /
    Q4_K / Q5_K and Q6_K's byte layout from AVX2 up, Q8_0 and Q6_K's six bits from AVX512-VNNI up,
    none on the scalar path (a copy given where none applies is ignored: the packed rows' kernels
    run); and only below the ISA's rows (AVX512-VNNI: every row count, Q8_0 and Q6_K 64; below
    it 12, AVX-VNNI's 16, Q6_K 32) or set_rows16_q8_rows's."""
    mod = kernels.load()
    n, k = 32, 96
    raw = torch.from_numpy(random_packed(Q.Q4_1, n, k, seed=3))
    raw8 = torch.from_numpy(random_packed(Q.Q8_0, n, k, seed=3))
    raw6 = torch.from_numpy(random_packed(Q.Q6_K, n, 256, seed=3))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(4))
    for isa in kernels.available_isas():
        prev = kernels.set_isa(isa)
        try:
            avx2, vnni = (kernels.ISAS[isa] >= kernels.ISAS[i] for i in ("avx2", "avx512_vnni"))
            q6 = vnni or (avx2 and not kernels.q6k_six_bits())  # (AVX2's kernel: the byte layout)
            got = [kernels.rows16_q8_type(int(t)) for t in (*ROWS16_Q8_TYPES, Q.Q5_0)]
            assert got == [avx2, avx2, vnni, avx2, avx2, q6, False], isa
            copy = kernels.interleave_rows16(raw, int(Q.Q4_1), k)
            if copy is None:  # (the scalar path makes none)
                continue
            before = mod.rows16_q8_calls()
            kernels.gemm(x, raw, int(Q.Q4_1), torch.zeros(4, n), 0, act_q8=True, interleaved=copy)
            assert mod.rows16_q8_calls() == before + 1, isa
            old = kernels.set_rows16_q8_rows(int(Q.Q4_1), 4)  # 4 rows: the packed rows' kernels
            try:
                kernels.gemm(x, raw, int(Q.Q4_1), torch.zeros(4, n), 0, act_q8=True, interleaved=copy)
            finally:
                assert kernels.set_rows16_q8_rows(int(Q.Q4_1), old) == 4
            assert mod.rows16_q8_calls() == before + 1, isa
            # below AVX512-VNNI: the packed rows' kernels from 12 rows (AVX-VNNI: from 16)
            for m, on_copy in ((11, True), (12, vnni or isa == "avx_vnni"), (15, vnni or isa == "avx_vnni"), (16, vnni)):
                before = mod.rows16_q8_calls()
                kernels.gemm(torch.randn(m, k), raw, int(Q.Q4_1), torch.zeros(m, n), 0, act_q8=True, interleaved=copy)
                assert mod.rows16_q8_calls() == before + on_copy, (isa, m)
            q6_from = 64 if vnni else 32  # the packed rows' many-row kernels from there
            for qt, w, kw, lines in ((Q.Q8_0, raw8, k, ((63, vnni), (64, False))), (Q.Q6_K, raw6, 256, ((q6_from - 1, q6), (q6_from, False)))):
                wi = kernels.interleave_rows16(w, int(qt), kw)
                for m, on_copy in lines:
                    before = mod.rows16_q8_calls()
                    kernels.gemm(torch.randn(m, kw), w, int(qt), torch.zeros(m, n), 0, act_q8=True, interleaved=wi)
                    assert mod.rows16_q8_calls() == before + on_copy, (isa, qt.name, m)
        finally:
            kernels.set_isa(prev)


KQUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


@contextlib.contextmanager
def int8_rows(m: int):
    """act_q8 runs every K-quant on int8 activations from m rows (1: every row count; by default
    their few rows may stay float, test_kquant_act_q8_rows_follow_the_isa)."""
    old = [kernels.set_int8_rows(int(t), m) for t in KQUANTS]
    try:
        yield
    finally:
        for t, o in zip(KQUANTS, old):
            kernels.set_int8_rows(int(t), o)


@pytest.mark.skipif(not HAVE_KERNELS, reason="no C++ kernels")
@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda t: t.name)
def test_kquant_act_q8_rows_follow_the_isa(qtype):
    """The K-quants under act_q8 by default: Q6_K where no int8 kernel reads its copy (its six
    bits below AVX512-VNNI; the scalar path) up to 8 rows on float activations (the bits of
    act_q8=False, on the interleaved copy where given), from 9 rows on int8 ones (the
    quantized-activation product, not the float one); Q4_K and Q5_K, and Q6_K elsewhere, int8
    at every row count (act_q8_type; their layers keep a copy for the int8 kernels that read
    it). qlinear (the layers' one call) draws the same line, on every path."""
    n, k = 19, 512
    raw = torch.from_numpy(random_packed(qtype, n, k, seed=5))
    assert kernels.set_int8_rows(int(qtype), -1) == -1  # the default: the ISA's rule
    for isa in kernels.available_isas():
        prev = kernels.set_isa(isa)
        try:
            few_float = qtype == Q.Q6_K and not kernels.rows16_q8_type(int(qtype))
            assert kernels.act_q8_type(int(qtype)) is (not few_float)
            copy = kernels.interleave_rows16(raw, int(qtype), k)
            for m in (1, 8, 9, 40):
                int8 = m >= 9 or not few_float
                assert kernels.act_q8_rows(int(qtype), m) is int8, (isa, m)
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
                outs = {}
                for q8 in (False, True):
                    outs[q8] = torch.zeros(m, n)
                    kernels.gemm(x, raw, int(qtype), outs[q8], 0, act_q8=q8, interleaved=copy)
                lin = kernels.load().qlinear(x, [raw], [int(qtype)], [0], n, None, True, [] if copy is None else [copy])
                assert torch.equal(lin, outs[True]), (isa, m)
                if int8:
                    ref, mag = reference(quantize_q8_reference(x), raw.numpy(), qtype, k)
                    assert np.all(np.abs(outs[True].numpy() - ref) <= 2e-6 * mag + 1e-5), (isa, m)
                    assert not torch.equal(outs[True], outs[False]), (isa, m)
                else:
                    assert torch.equal(outs[True], outs[False]), (isa, m)
        finally:
            kernels.set_isa(prev)


@pytest.mark.parametrize("q8_isa", isa_param(Q8_ISAS[1:]), indirect=True)
def test_q8_many_rows_sums_stay_in_range(q8_isa):
    """The many-row integer kernel sums a block's nibble products in 16 bits: the largest
    quants (15 against +-127 everywhere; Q4_K's sub-blocks too) must not overflow, for any sign
    pattern; Q8_0's extremes (-127, and -128, which a file may hold) neither; Q6_K's centred
    quants (-32 and 31, summed in 16 bits over half a block) neither, with int8 scales to -128."""
    n, k, m = 16, 256, 24
    cases = ((Q.Q4_1, 0xFF), (Q.Q4_0, 0xFF), (Q.Q4_K, 0xFF), (Q.Q5_K, 0xFF), (Q.Q8_0, 0x81), (Q.Q8_0, 0x80),
             (Q.Q6_K, 0x00), (Q.Q6_K, 0xFF))
    for qtype, byte in cases:
        raw = random_packed(qtype, n, k, seed=1)
        be, bb = gguf.GGML_QUANT_SIZES[qtype]
        blocks = raw.reshape(n, k // be, bb)
        first, end = QUANT_BYTES[qtype]
        blocks[..., first:end] = np.uint8(byte)  # nibbles 15 / Q5_K 31 / int8 -127 / int8 -128 / Q6_K -32 or 31
        if qtype == Q.Q6_K:
            blocks[..., 192:208] = np.uint8(0x80)  # int8 scales -128
        raw = blocks.reshape(n, -1)
        x = torch.ones(m, k)
        x[1::2] = -1.0
        x[2::3, ::2] *= -1.0
        ref, mag = reference(quantize_q8_reference(x), raw, qtype, k)
        out = torch.zeros(m, n)
        kernels.gemm(x, torch.from_numpy(raw), int(qtype), out, 0, act_q8=True)
        assert np.all(np.abs(out.numpy() - ref) <= 2e-6 * mag + 1e-5), (qtype, np.abs(out.numpy() - ref).max())


def test_isa_names_are_checked():
    mod = kernels.load()
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_ISA"):
        kernels._set(mod, "sse9")
    for name in kernels.ISAS:
        if name not in kernels.available_isas():
            with pytest.raises(RuntimeError, match="lacks"):
                kernels._set(mod, name)
    assert "scalar" in kernels.available_isas() and kernels.current_isa() in kernels.available_isas()


@pytest.mark.skipif(not HAVE_KERNELS, reason="no C++ kernels")
def test_avx_vnni_is_the_avx2_level_with_vpdpbusd():
    """avx_vnni names the avx2 level with AVX-VNNI's integer products on: forcing avx2 turns
    them off, avx_vnni on (an error where the CPU lacks AVX-VNNI), and set_isa's other levels
    never run them; the module's own set_isa(avx2 level) takes the CPU's answer."""
    mod = kernels.load()
    prev = kernels.current_isa()
    try:
        if "avx2" not in kernels.available_isas():
            pytest.skip("this CPU lacks avx2")
        kernels.set_isa("avx2")
        assert kernels.current_isa() == "avx2" and not mod.avx_vnni_in_use()
        mod.set_isa(kernels.ISAS["avx2"])
        assert mod.avx_vnni_in_use() == mod.avx_vnni_in_cpu()
        if not mod.avx_vnni_in_cpu():
            with pytest.raises(RuntimeError, match="lacks"):
                mod.set_avx_vnni(True)
            return
        kernels.set_isa("avx_vnni")
        assert kernels.current_isa() == "avx_vnni" and mod.avx_vnni_in_use()
        for isa in kernels.available_isas():
            kernels.set_isa(isa)
            assert mod.avx_vnni_in_use() == (isa == "avx_vnni"), isa
    finally:
        kernels.set_isa(prev)



@pytest.mark.parametrize("q8_isa", isa_param(Q8_ISAS[1:]), indirect=True)
def test_q8_many_rows_over_row_blocks(q8_isa):
    """More rows than one L2 block of activations (48 rows at K = 8192): every block of rows
    meets every chunk of columns."""
    n, k, m = 13, 8192, 50
    raw = random_packed(Q.Q4_1, n, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    ref, mag = reference(quantize_q8_reference(x), raw, Q.Q4_1, k)
    out = torch.zeros(m, n)
    kernels.gemm(x, torch.from_numpy(raw), int(Q.Q4_1), out, 0, act_q8=True)
    assert np.all(np.abs(out.numpy() - ref) <= 2e-6 * mag + 1e-4), np.abs(out.numpy() - ref).max()


def test_activation_quantizer_same_bits_on_every_isa():
    """The q8 activation quantizer: round half to even (exact ties included) as the reference,
    and the same bits from the scalar and the vector code for every input, non-finite and
    tiny blocks too (bounded quants, never -128)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    x[1, :32] = torch.arange(32) - 15.5  # amax 16.5: scale ties at +-0.5 steps
    x[2, :32] = torch.tensor([127.0, -127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5] * 4)  # exact ties
    x[3, :32] = 0.0
    x[3, 32:64] = -0.0
    x[4, :32] = 1e-39  # denormal: scale below FLT_MIN
    x[4, 32:64] = 2e-37
    x[5, :8] = float("nan")
    x[5, 40] = float("inf")
    x[5, 70] = -float("inf")
    x[6, :32] = 3e38
    results = {}
    for isa in kernels.available_isas():
        prev = kernels.set_isa(isa)
        try:
            results[isa] = kernels.load().quantize_act_q8(x)
        finally:
            kernels.set_isa(prev)
    q, d, s = results["scalar"]
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    normal = torch.ones(64, 8, dtype=torch.bool)
    normal[4] = normal[5] = False
    xq = quantize_q8_reference(x).reshape(64, 8, 32)
    deq = q.reshape(64, 8, 32).float() * d[..., None]
    assert torch.equal(deq[normal], xq[normal])
    assert torch.equal(s[normal], (d * q.reshape(64, 8, 32).sum(-1).float())[normal])
    for isa, (q2, d2, s2) in results.items():
        assert torch.equal(q2, q) and torch.equal(d2.view(torch.int32), d.view(torch.int32)), isa
        assert torch.equal(s2.view(torch.int32), s.view(torch.int32)), isa


HAVE_BF16 = HAVE_KERNELS and "avx512_bf16" in kernels.available_isas()
needs_bf16 = pytest.mark.skipif(not HAVE_BF16, reason="this CPU lacks avx512_bf16")


def bf16_reference(x, raw, qtype, k):
    """x (bf16) @ dequantized w (unrounded) in float64, and |x| @ |w|.T for the tolerance."""
    w = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], k)).double()
    xd = x.double()
    return (xd @ w.T).numpy(), (xd.abs() @ w.abs().T).numpy()


@needs_bf16
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_bf16_products_match_dequantized_matmul(qtype):
    """The bf16 many-row products equal x @ dequant(w).T with the weights unrounded: the
    vdpbf16ps kernel (exact quants, float group scales and minimums) up to float32 summation;
    oneDNN over the weights split into bf16 hi + lo up to the split's 2^-17 and its bf16
    output. Odd N (a partial group of 16 and of the 48-column chunk), K of 3 to 48 blocks,
    M = 1, 3, 16, 17 (row tiles of 4 and tails), 64, 300; only its own columns written."""
    prev = kernels.set_isa("avx512_bf16")
    try:
        shapes = ((37, 96), (50, 576), (17, 1536)) if gguf.GGML_QUANT_SIZES[qtype][0] == 32 else ((50, 512),)
        for n, k in shapes:
            for m in (1, 3, 16, 17, 64, 300):
                raw = random_packed(qtype, n, k, seed=m)
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).bfloat16()
                ref, mag = bf16_reference(x, raw, qtype, k)
                for onednn in (False, True):
                    out = torch.full((m, n + 3), 7.0)
                    kernels.gemm_bf16(x, torch.from_numpy(raw), int(qtype), out, 2, onednn=onednn)
                    got = out[:, 2 : 2 + n].numpy()
                    tol = 2e-6 * mag + 1e-6 + (np.abs(ref) / 256 + 2e-5 * mag if onednn else 0)
                    assert np.all(np.abs(got - ref) <= tol), (n, k, m, onednn, np.abs(got - ref).max())
                    assert torch.all(out[:, :2] == 7.0) and torch.all(out[:, 2 + n :] == 7.0)
    finally:
        kernels.set_isa(prev)


@needs_bf16
def test_bf16_products_only_for_bf16_models():
    """qlinear (the QuantLinear forward) takes the bf16 products for bf16 activations from the
    row threshold on, on avx512_bf16: the vdpbf16ps kernel, or oneDNN from its threshold on;
    float32 activations (a float32 model) never: their result is the float kernels' bit for
    bit whatever the thresholds; act_q8 keeps its integer kernels for Q4_1 and for Q6_K from
    its int8 threshold, below which it sends Q6_K to bf16; float rows (F32 parts) keep the float path; below avx512_bf16 bf16 activations take
    the float path. Three segments (Q4_1, Q6_K, F32) and a bias."""
    mod = kernels.load()
    k, m = 512, 20
    raws = [random_packed(Q.Q4_1, 24, k, seed=1), random_packed(Q.Q6_K, 13, k, seed=2)]
    ws = [torch.from_numpy(r) for r in raws] + [(torch.randn(5, k) * 0.05).view(torch.uint8)]
    types, cols, n = [int(Q.Q4_1), int(Q.Q6_K), 0], [0, 24, 37], 42
    bias = torch.randn(n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(0))
    xb = x.bfloat16()

    def qlinear(x, act_q8=False):
        before = mod.bf16_calls()
        y = mod.qlinear(x, ws, types, cols, n, bias, act_q8)
        return y, [a - b for a, b in zip(mod.bf16_calls()[:3], before)]  # (no AMX tiles: avx512_bf16 below)

    def by_hand(bf16_types, act_q8=False, onednn=False):
        out = torch.empty(m, n)
        for w, t, c in zip(ws, types, cols):
            if t in bf16_types:
                kernels.gemm_bf16(xb, w, t, out, c, onednn=onednn)
            else:
                kernels.gemm(xb.float(), w, t, out, c, act_q8=act_q8)
        return (out + bias).bfloat16()

    def float_path(x):
        out = torch.empty(m, n)
        for w, t, c in zip(ws, types, cols):
            kernels.gemm(x.float(), w, t, out, c)
        return out + bias

    prev = kernels.set_isa("avx512_bf16")
    old, old_dnn = kernels.set_bf16_rows(m), kernels.set_bf16_onednn_rows(10**9)
    try:
        y, calls = qlinear(xb)
        assert y.dtype == torch.bfloat16 and calls == [2, 0, 0] and torch.equal(y, by_hand({int(Q.Q4_1), int(Q.Q6_K)}))
        y, calls = qlinear(xb, act_q8=True)  # 20 rows: Q6_K's int8 many-row kernel too
        assert calls == [0, 0, 0] and torch.equal(y, by_hand(set(), act_q8=True))
        old6 = kernels.set_int8_rows(int(Q.Q6_K), m + 1)  # below Q6_K's int8 threshold: its float product, on bf16
        try:
            y, calls = qlinear(xb, act_q8=True)
        finally:
            kernels.set_int8_rows(int(Q.Q6_K), old6)
        assert calls == [1, 0, 0] and torch.equal(y, by_hand({int(Q.Q6_K)}, act_q8=True))
        kernels.set_bf16_onednn_rows(m)
        y, calls = qlinear(xb)
        assert calls == [0, 2, 0] and torch.equal(y, by_hand({int(Q.Q4_1), int(Q.Q6_K)}, onednn=True))
        for rows in (1, m, 10**9):
            kernels.set_bf16_rows(rows)
            y, calls = qlinear(x)
            assert calls == [0, 0, 0] and torch.equal(y, float_path(x))  # a float32 model: never
        kernels.set_bf16_rows(m + 1)  # below the threshold: the float path
        y, calls = qlinear(xb)
        assert calls == [0, 0, 0] and torch.equal(y, float_path(xb).bfloat16())
        kernels.set_bf16_rows(m)
        kernels.set_isa("avx512")
        y, calls = qlinear(xb)
        assert calls == [0, 0, 0] and torch.equal(y, float_path(xb).bfloat16())
    finally:
        kernels.set_bf16_rows(old)
        kernels.set_bf16_onednn_rows(old_dnn)
        kernels.set_isa(prev)


HAVE_AMX = HAVE_KERNELS and "amx_bf16" in kernels.available_isas()
needs_amx = pytest.mark.skipif(not HAVE_AMX, reason="this CPU lacks AMX-BF16 (or Linux refused the tiles)")
AMX_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)  # (Q6_K: its six-bit copies, VBMI)


def layer_segments(k: int, *segments):
    """A layer's segments of (type, rows), random blocks over K = k: (weights, type codes, their
    interleave_rows16 copies), as qlinear takes them."""
    ws = [torch.from_numpy(random_packed(t, n, k, seed=i + 1)) for i, (t, n) in enumerate(segments)]
    types = [int(t) for t, _ in segments]
    return ws, types, [kernels.interleave_rows16(w, t, k) for w, t in zip(ws, types)]


def amx_path():
    """The best AMX path whatever PAGEDSERVE_CPU_ISA chose (restore with kernels.set_isa)."""
    return kernels.set_isa(kernels.available_isas()[-1])


@needs_amx
@pytest.mark.parametrize("qtype", AMX_TYPES, ids=lambda t: t.name)
def test_amx_tile_products_match_the_bf16_reference(qtype):
    """The AMX tile kernel (csrc/quant_rows16_amx.h) equals x @ W.T with W the dequantized
    weights (gguf's dequantize) rounded to bf16, in float64, up to float32 sums: every row count (1, 3: a short
    tile; 16, 17: a 16-row block and a tail; 64; 300: 32-row blocks and tails), N of one, two,
    three (an item of one group) and five groups, K of 3 to 48 blocks (the next item's
    dequantization spread over few or many steps); only its own columns written."""
    mod = kernels.load()
    prev = amx_path()
    try:
        if qtype == Q.Q6_K and not kernels.q6k_six_bits():
            pytest.skip("Q6_K's tiles read its six-bit copies (AVX512-VBMI)")
        super_blocks = gguf.GGML_QUANT_SIZES[qtype][0] == 256
        for n, k in ((48, 256), (16, 768), (80, 1536)) if super_blocks else ((48, 96), (16, 576), (80, 1536), (32, 160)):
            for m in (1, 3, 16, 17, 64, 300):
                raw = random_packed(qtype, n, k, seed=m)
                w = torch.from_numpy(raw)
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).bfloat16()
                wb = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k)).bfloat16().double()
                ref, mag = (x.double() @ wb.T).numpy(), (x.double().abs() @ wb.abs().T).numpy()
                out = torch.full((m, n + 3), 7.0)
                before = mod.bf16_calls()[3]
                kernels.gemm_amx_rows16(x, w, kernels.interleave_rows16(w, int(qtype), k), int(qtype), out, 2)
                assert mod.bf16_calls()[3] == before + 1
                got = out[:, 2 : 2 + n].numpy()
                assert np.all(np.abs(got - ref) <= 1e-5 * mag + 1e-6), (n, k, m, np.abs(got - ref).max())
                assert torch.all(out[:, :2] == 7.0) and torch.all(out[:, 2 + n :] == 7.0)
    finally:
        kernels.set_isa(prev)


@needs_amx
def test_qlinear_runs_bf16_layers_on_the_amx_tiles_past_the_exact_rows():
    """On an AMX path a bf16 layer's products past the exact kernel's 16 rows (Q4_1 + Q8_0: both
    take it below; a type without it, Q6_K, from 9 rows) run on the tile kernel over its copies:
    every segment there (a float bias): bf16 straight out of the kernel, the bias added before
    rounding, the bits of the float product plus bias rounded once; a segment of another type
    (Q6_K in its byte layout) beside them keeps its own product and the others still take the
    tiles. Fewer rows, set_amx_rows16(False), a path below AMX, float32 activations: no tile product."""
    mod = kernels.load()
    k = 512
    six = kernels.set_q6k_six_bits(False)  # Q6_K's byte layout, through the test: no tiles read it
    ws, types, wis = layer_segments(k, (Q.Q4_1, 32), (Q.Q8_0, 48), (Q.Q6_K, 16))
    bias = torch.randn(96)

    def qlinear(x, n_seg):
        before = mod.bf16_calls()[3]
        y = mod.qlinear(x, ws[:n_seg], types[:n_seg], [0, 32, 80][:n_seg], [32, 80, 96][n_seg - 1], bias[: [32, 80, 96][n_seg - 1]], False, wis[:n_seg])
        return y, mod.bf16_calls()[3] - before

    def by_hand(x, n_seg):
        n = [32, 80, 96][n_seg - 1]
        out = torch.empty(x.shape[0], n)
        for w, wi, t, c in list(zip(ws, wis, types, [0, 32, 80]))[:2]:
            kernels.gemm_amx_rows16(x, w, wi, t, out, c)
        return out, n

    prev = amx_path()
    try:
        for m in (9, 17, 40):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
            y, calls = qlinear(x, 2)
            y3, calls3 = qlinear(x, 3)  # with a Q6_K segment: the float output, products per segment
            if m <= 16:  # both segments on the exact kernel (test_qlinear_runs_few_rows_of_q4_layers_on_the_exact_tiles)
                assert calls == calls3 == 0
                continue
            out, n = by_hand(x, 2)
            assert calls == 2 and y.dtype == torch.bfloat16 and torch.equal(y, (out + bias[:n]).bfloat16())
            assert calls3 == 2 and torch.equal(y3[:, :80], y)  # the same two tile products
        x8 = torch.randn(8, k).bfloat16()
        assert qlinear(x8, 2)[1] == 0  # few rows: the copies' few-row kernel
        assert qlinear(x8.float(), 2)[1] == 0 and qlinear(torch.randn(20, k), 2)[1] == 0  # a float32 model
        assert kernels.set_amx_rows16(False) is True
        try:
            assert not kernels.amx_rows16(int(Q.Q4_1)) and qlinear(torch.randn(20, k).bfloat16(), 2)[1] == 0
        finally:
            kernels.set_amx_rows16(True)
        kernels.set_isa("avx512_bf16")
        assert not kernels.amx_rows16(int(Q.Q4_1)) and qlinear(torch.randn(20, k).bfloat16(), 2)[1] == 0
        with pytest.raises(RuntimeError, match="amx_bf16 path"):
            kernels.gemm_amx_rows16(x8, ws[0], wis[0], types[0], torch.empty(8, 32))
    finally:
        kernels.set_isa(prev)
        kernels.set_q6k_six_bits(six)


EXACT_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q8_0, Q.Q6_K)


@needs_amx
@pytest.mark.parametrize("qtype", EXACT_TYPES, ids=lambda t: t.name)
def test_amx_exact_products_match_the_float_reference_row_by_row(qtype):
    """The exact few-row tile kernel (csrc/quant_rows16_amx_exact.h) equals x @ W.T with W the
    dequantized weights unrounded (gguf's dequantize), in float64, up to float32 sums (1e-5 of
    |x| @ |W|: bf16-rounded weights miss it by ~1e-4) for 1 .. 16 rows, N of one, two, three and
    five groups (a thread's stream crossing groups), K of 1 to 48 blocks; only its own columns
    written; and each row alone gives the bits it gives among the others (what keeps a k-token
    verification equal to the 1-row steps)."""
    mod = kernels.load()
    prev = amx_path()
    try:
        super_blocks = gguf.GGML_QUANT_SIZES[qtype][0] == 256
        shapes = ((48, 256), (16, 768), (80, 1536)) if super_blocks else ((48, 96), (16, 32), (80, 1536), (32, 160))
        for n, k in shapes:
            raw = random_packed(qtype, n, k, seed=n + k)
            w, wd = torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k)).double()
            wi = kernels.interleave_rows16(w, int(qtype), k)
            for m in (1, 2, 3, 7, 16):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).bfloat16()
                ref, mag = (x.double() @ wd.T).numpy(), (x.double().abs() @ wd.abs().T).numpy()
                out = torch.full((m, n + 3), 7.0)
                before = mod.bf16_calls()[4]
                kernels.gemm_amx_exact(x, w, wi, int(qtype), out, 2)
                assert mod.bf16_calls()[4] == before + 1
                got = out[:, 2 : 2 + n]
                assert np.all(np.abs(got.numpy() - ref) <= 1e-5 * mag + 1e-6), (n, k, m, np.abs(got.numpy() - ref).max())
                assert torch.all(out[:, :2] == 7.0) and torch.all(out[:, 2 + n :] == 7.0)
                for r in range(m):
                    alone = torch.empty(1, n)
                    kernels.gemm_amx_exact(x[r : r + 1].contiguous(), w, wi, int(qtype), alone)
                    assert torch.equal(alone[0], got[r]), (n, k, m, r)
    finally:
        kernels.set_isa(prev)


@needs_amx
def test_qlinear_runs_few_rows_of_q4_layers_on_the_exact_tiles():
    """On an AMX path a bf16 layer of Q4 segments (Q4_1 + Q4_K, a float bias) runs 1 .. 16 rows
    on the exact kernel, bf16 out with the bias added before rounding (the float product plus
    bias rounded once), and 17 rows on the bf16-rounded tiles; a Q6_K segment beside them takes
    both kernels too with its six-bit copy (the exact one from 2 rows: one row stays on its bf16
    kernel), while its byte copy (no VBMI) sends the layer to per-segment products (the Q4 ones
    still exact). set_amx_exact_rows(0), a path below AMX,
    float32 activations: no exact product; more than 16 rows by hand: an error."""
    mod = kernels.load()
    k = 512
    if not kernels.q6k_six_bits():
        pytest.skip("Q6_K's tiles read its six-bit copies (AVX512-VBMI)")
    ws, types, wis = layer_segments(k, (Q.Q4_1, 32), (Q.Q4_K, 48), (Q.Q6_K, 16))
    bias = torch.randn(96)

    def qlinear(x, n_seg=2):
        n = [32, 80, 96][n_seg - 1]
        before = mod.bf16_calls()
        y = mod.qlinear(x, ws[:n_seg], types[:n_seg], [0, 32, 80][:n_seg], n, bias[:n], False, wis[:n_seg])
        after = mod.bf16_calls()
        return y, after[4] - before[4], after[3] - before[3]

    prev = amx_path()
    try:
        for m in (1, 5, 16):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
            y, exact, tiles = qlinear(x)
            out = torch.empty(m, 80)
            kernels.gemm_amx_exact(x, ws[0], wis[0], types[0], out, 0)
            kernels.gemm_amx_exact(x, ws[1], wis[1], types[1], out, 32)
            assert (exact, tiles) == (2, 0) and y.dtype == torch.bfloat16 and torch.equal(y, (out + bias[:80]).bfloat16())
        assert qlinear(torch.randn(17, k).bfloat16())[1:] == (0, 2)
        assert qlinear(torch.randn(16, k).bfloat16(), 3)[1:] == (3, 0)  # Q6_K's six-bit copy: exact too,
        assert qlinear(torch.randn(2, k).bfloat16(), 3)[1:] == (3, 0)
        assert qlinear(torch.randn(1, k).bfloat16(), 3)[1:] == (2, 0)  # but one row on its bf16 kernel
        assert qlinear(torch.randn(17, k).bfloat16(), 3)[1:] == (0, 3)
        six = kernels.set_q6k_six_bits(False)
        try:  # Q6_K's byte copy: neither tile kernel takes it, each Q4 segment stays exact
            wis[2] = kernels.interleave_rows16(ws[2], types[2], k)
            assert qlinear(torch.randn(16, k).bfloat16(), 3)[1:] == (2, 0)
            assert qlinear(torch.randn(3, k).bfloat16(), 3)[1:] == (2, 0)
        finally:
            kernels.set_q6k_six_bits(six)
        assert qlinear(torch.randn(3, k), 2)[1:] == (0, 0)  # a float32 model
        assert kernels.set_amx_exact_rows(0) == 16
        try:
            assert qlinear(torch.randn(3, k).bfloat16())[1:] == (0, 0)
        finally:
            kernels.set_amx_exact_rows(16)
        with pytest.raises(RuntimeError, match="1 .. 16 rows"):
            kernels.gemm_amx_exact(torch.randn(17, k).bfloat16(), ws[0], wis[0], types[0], torch.empty(17, 32))
        kernels.set_isa("avx512_bf16")
        assert qlinear(torch.randn(3, k).bfloat16())[1:] == (0, 0)
    finally:
        kernels.set_isa(prev)


def test_amx_refusal_falls_back_with_a_log_line(caplog):
    """Linux may refuse the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM): simulated here, the
    AMX levels are unavailable, the path stays below them and a warning says why."""
    mod = kernels.load()
    try:
        assert mod.request_amx_permission(simulate_refusal=True) != 0
        with caplog.at_level("WARNING", logger=kernels.__name__):
            assert kernels.check_amx(mod) is False
        assert "refused" in caplog.text
        assert not mod.isa_available(kernels.ISAS["amx_bf16"]) and not mod.isa_available(kernels.ISAS["amx_int8"])
        assert kernels.current_isa() not in ("amx_bf16", "amx_int8")
        with pytest.raises(RuntimeError, match="lacks"):
            kernels.set_isa("amx_bf16")
    finally:
        mod.request_amx_permission(again=True)  # the real answer again (no AMX here: unavailable)


# ---- the few-row kernels on row-interleaved copies (csrc/quant_rows16*.h) ----
HAVE_AVX512 = HAVE_KERNELS and "avx512" in kernels.available_isas()
HAVE_AVX2 = HAVE_KERNELS and "avx2" in kernels.available_isas()
needs_avx512 = pytest.mark.skipif(not HAVE_AVX512, reason="this CPU lacks avx512 (the interleaved kernel's ISA)")
needs_avx2 = pytest.mark.skipif(not HAVE_AVX2, reason="this CPU lacks avx2 (the AVX2 interleaved kernel's ISA)")
ROWS16_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
ROWS16_BF16_TYPES = [*ROWS16_TYPES, Q.Q4_K, Q.Q5_K, Q.Q6_K]  # every type, on every kernel
K_QUANT_COPIES = {Q.Q4_K: (144, 148), Q.Q5_K: (176, 180), Q.Q6_K: (210, 274)}  # a row's super-block -> its copy's bytes
Q6K_SIX_BITS_COPY = (210, 210)  # Q6_K's six-bit copy (CPUs with AVX512-VBMI): the packed size
def _cpu_has_vbmi() -> bool:
    """Whether six-bit Q6_K copies may be asked for (the CPU has AVX512-VBMI), whatever the
    default (PAGEDSERVE_CPU_ISA below avx512: the byte layout)."""
    prev = kernels.q6k_six_bits()
    try:
        kernels.set_q6k_six_bits(True)
    except RuntimeError:
        return False
    kernels.set_q6k_six_bits(prev)
    return True


HAVE_VBMI = HAVE_KERNELS and HAVE_AVX512 and _cpu_has_vbmi()


# the few-row kernels on interleaved copies: float activations on AVX-512 (quant_rows16.h) and
# on AVX2 (quant_rows16_avx2.h), bf16 ones on the bf16 units (quant_rows16_bf16.h)
ROWS16_KERNELS = [
    pytest.param("float", marks=needs_avx512),
    pytest.param("avx2", marks=needs_avx2),
    pytest.param(
        "bf16", marks=pytest.mark.skipif(not HAVE_BF16, reason="this CPU lacks avx512_bf16 (the bf16 few-row kernel's ISA)")
    ),
]


KERNEL_ISAS = {"float": "avx512", "avx2": "avx2", "bf16": "avx512_bf16"}


def rows16_product(kernel, x, w, qtype, out, col0, wi):
    """out[:, col0:] = x @ w.T on the interleaved copy wi, by the AVX-512 float, the AVX2 float or
    the bf16 kernel (on its ISA path, whatever PAGEDSERVE_CPU_ISA chose)."""
    prev = kernels.set_isa(KERNEL_ISAS[kernel])
    try:
        if kernel == "bf16":
            kernels.gemm_bf16(x, w, int(qtype), out, col0, interleaved=wi)
        else:
            before = kernels.load().rows16_calls()
            kernels.gemm(x, w, int(qtype), out, col0, interleaved=wi)
            assert kernels.load().rows16_calls() == before + 1, "the float kernel did not read the copy"
    finally:
        kernels.set_isa(prev)


@contextlib.contextmanager
def kernel_path(kernel):
    """`kernel`'s ISA path (whatever PAGEDSERVE_CPU_ISA chose), so that the copies made inside are
    the ones it reads: the AVX2 kernel's Q6_K copies in the byte layout (six bits need AVX512-VBMI)."""
    prev_isa = kernels.set_isa(KERNEL_ISAS[kernel])
    prev = kernels.set_q6k_six_bits(False) if kernel == "avx2" and kernels.q6k_six_bits() else None
    try:
        yield
    finally:
        if prev is not None:
            kernels.set_q6k_six_bits(prev)
        kernels.set_isa(prev_isa)


def kernel_types(types):
    """(kernel, qtype) params: every type on every kernel."""
    return [
        pytest.param(kp.values[0], t, marks=kp.marks, id=f"{kp.values[0]}-{t.name}")
        for kp in ROWS16_KERNELS
        for t in types
    ]


def copy_bytes(qtype, w):
    """An interleaved copy's size: the packed bytes, rearranged (Q4_K's and Q5_K's 6-bit scales
    and mins unpacked to a byte each: 2,368 bytes for 16 rows' super-blocks of 2,304, 2,880 for
    2,816; Q6_K's quants six bits each: the packed size, with AVX512-VBMI; else a byte each: 4,384
    for 3,360)."""
    if qtype in K_QUANT_COPIES:
        packed, copy = Q6K_SIX_BITS_COPY if qtype == Q.Q6_K and kernels.q6k_six_bits() else K_QUANT_COPIES[qtype]
        return w.numel() // packed * copy
    return w.numel()


@pytest.mark.parametrize(("kernel", "qtype"), kernel_types(ROWS16_BF16_TYPES))
@pytest.mark.parametrize("n", [16, 48, 160])  # one group; three (a pair and a single); ten
def test_interleaved_few_rows_match_the_dequantized_matmul(kernel, qtype, n):
    """Every few-row count (1-11: tiles of 1-8 rows, AVX2's of 1-4), into its output columns
    only, within float32 summation of the float64 reference (the bf16 kernel: of the bf16
    activations against the unrounded weights)."""
    with kernel_path(kernel):
        _interleaved_few_rows_match(kernel, qtype, n)


def _interleaved_few_rows_match(kernel, qtype, n):
    for k in (256, 768) if qtype in K_QUANT_COPIES else (96, 576):
        raw = random_packed(qtype, n, k, seed=n + k)
        w = torch.from_numpy(raw)
        wi = kernels.interleave_rows16(w, int(qtype), k)
        assert wi is not None and wi.numel() == copy_bytes(qtype, w)
        for m in (1, 2, 3, 4, 5, 8, 11):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m))
            if kernel == "bf16":
                x = x.bfloat16()
            ref, mag = bf16_reference(x, raw, qtype, k) if kernel == "bf16" else reference(x, raw, qtype, k)
            out = torch.full((m, n + 5), 7.0)
            rows16_product(kernel, x, w, qtype, out, 3, wi)
            got = out[:, 3 : 3 + n].numpy()
            assert np.all(np.abs(got - ref) <= 2e-6 * mag + 1e-6), (k, m, np.abs(got - ref).max())
            assert torch.all(out[:, :3] == 7.0) and torch.all(out[:, 3 + n :] == 7.0)


@pytest.mark.parametrize(("kernel", "qtype"), kernel_types(ROWS16_BF16_TYPES))
def test_an_interleaved_rows_bits_do_not_depend_on_the_other_rows(kernel, qtype):
    """A k-token verification (k + 1 rows) computes what 1-row decode steps compute: each row's
    sums are the same whatever the row count (tiles of 1-8 rows, AVX2's of 1-4 with both halves
    a walk for 1-2; up to the float kernels' 11 few rows, the bf16 kernel's 16)."""
    with kernel_path(kernel):
        _rows_bits_alone(kernel, qtype)


def _rows_bits_alone(kernel, qtype):
    n, k, rows = 48, 768 if qtype in K_QUANT_COPIES else 576, 16 if kernel == "bf16" else 11
    w = torch.from_numpy(random_packed(qtype, n, k, seed=3))
    wi = kernels.interleave_rows16(w, int(qtype), k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5))
    if kernel == "bf16":
        x = x.bfloat16()
    together = torch.zeros(rows, n)
    rows16_product(kernel, x, w, qtype, together, 0, wi)
    for r in (0, 4, 10, rows - 1):
        for lo in {0, max(0, r - 2), r}:  # the row alone, and inside tiles of 1-3 and 5-16 rows
            part = torch.zeros(r + 1 - lo, n)
            rows16_product(kernel, x[lo : r + 1].contiguous(), w, qtype, part, 0, wi)
            assert torch.equal(part[-1], together[r]), (r, lo)


@needs_avx512
@pytest.mark.parametrize("qtype", ROWS16_BF16_TYPES, ids=lambda t: t.name)
def test_avx2_interleaved_kernel_gives_the_avx512_kernels_bits(qtype):
    """The AVX2 kernel (quant_rows16_avx2.h: a group's two halves of 8 rows) sums each row as the
    AVX-512 float kernel does, so both give the same bits: every few-row count (1-11: its tiles
    of 1-4 rows, both halves a walk for 1-2), one to ten groups, K of one to three blocks' worth.
    On AVX-512 CPUs without AVX512-VBMI Q6_K's copy is the byte layout both read; with it, the
    byte copy read by both equals the six-bit copy read by AVX-512 (test_q6k_six_bit_copies...)."""
    with kernel_path("avx2"):
        for n, k in ((16, 256), (48, 768), (160, 512)):
            raw = random_packed(qtype, n, k, seed=n + k)
            w = torch.from_numpy(raw)
            wi = kernels.interleave_rows16(w, int(qtype), k)
            for m in range(1, 12):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                outs = [torch.zeros(m, n), torch.zeros(m, n)]
                rows16_product("float", x, w, qtype, outs[0], 0, wi)
                rows16_product("avx2", x, w, qtype, outs[1], 0, wi)
                assert torch.equal(outs[0], outs[1]), (n, k, m, (outs[0] - outs[1]).abs().max())


@pytest.mark.skipif(not HAVE_VBMI, reason="this CPU lacks avx512_vbmi (Q6_K's six-bit copies)")
@pytest.mark.parametrize("kernel", [p for p in ROWS16_KERNELS if p.values[0] != "avx2"])  # AVX2: byte copies
def test_q6k_six_bit_copies_give_the_byte_copies_bits(kernel):
    """Q6_K's six-bit copy (quant_rows16_q6k_vbmi*.h) holds the packed bytes' count and both
    kernels decode the words their byte-copy tiles build, summed in the same order: equal outputs
    for every few-row count (bf16: 1-16, float: 1-11; one to ten groups; K of one to three
    super-blocks, so the last run's masked load ends the copy). The bf16 kernel refuses a copy of
    the other layout; the float one falls back to the packed rows (no copy read)."""
    with kernel_path(kernel):
        _six_bit_copies_give_the_byte_copies_bits(kernel)


def _six_bit_copies_give_the_byte_copies_bits(kernel):
    qt = int(Q.Q6_K)
    prev = kernels.set_q6k_six_bits(True)
    try:
        for n, k in ((16, 256), (48, 768), (160, 512)):
            raw = random_packed(Q.Q6_K, n, k, seed=n + k)
            w = torch.from_numpy(raw)
            six = kernels.interleave_rows16(w, qt, k)
            kernels.set_q6k_six_bits(False)
            byte = kernels.interleave_rows16(w, qt, k)
            assert six.numel() == w.numel() and byte.numel() == w.numel() // 210 * 274
            for m in range(1, 17 if kernel == "bf16" else 12):  # the float kernel's few rows: 1-11
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                x = x.bfloat16() if kernel == "bf16" else x
                outs = []
                for on, wi in ((True, six), (False, byte)):
                    kernels.set_q6k_six_bits(on)
                    out = torch.zeros(m, n)
                    rows16_product(kernel, x, w, Q.Q6_K, out, 0, wi)
                    outs.append(out)
                assert torch.equal(outs[0], outs[1]), (n, k, m)
            kernels.set_q6k_six_bits(True)  # a byte copy under the six-bit setting
            if kernel == "bf16":
                with pytest.raises(RuntimeError, match="interleave_rows16 copy"):
                    rows16_product(kernel, x, w, Q.Q6_K, torch.zeros(m, n), 0, byte)
            else:
                with pytest.raises(AssertionError, match="did not read the copy"):
                    rows16_product(kernel, x, w, Q.Q6_K, torch.zeros(m, n), 0, byte)
    finally:
        kernels.set_q6k_six_bits(prev)


@pytest.mark.skipif(not HAVE_KERNELS or HAVE_VBMI, reason="this CPU has avx512_vbmi (six bits apply)")
def test_q6k_six_bits_refused_without_vbmi():
    """Without AVX512-VBMI, Q6_K's copies keep a byte a quant and six bits cannot be asked for."""
    assert not kernels.q6k_six_bits()
    with pytest.raises(RuntimeError, match="AVX512-VBMI"):
        kernels.set_q6k_six_bits(True)


@needs_bf16
def test_bf16_few_rows_take_the_interleaved_copy_on_the_bf16_units():
    """qlinear with bf16 activations below the bf16 row threshold: a segment with an
    interleaved copy runs the bf16 few-row kernel (the same bits as gemm_bf16 on the copy),
    or with set_rows16_bf16(False) the float kernel on widened activations; a segment
    without a copy the float kernel; float32 activations never the bf16 one; act_q8 (gguf_q8)
    its integer kernels. Below avx512_bf16 (PAGEDSERVE_CPU_ISA=avx512) the float kernel; on
    the AMX levels the exact tiles for Q4_1, and without them (set_amx_exact_rows(0)) the float
    kernel too (the rule), unless set_rows16_bf16(True)."""
    mod = kernels.load()
    k, m = 576, 5
    raws = [random_packed(Q.Q4_1, 32, k, seed=1), random_packed(Q.Q8_0, 24, k, seed=2)]
    ws = [torch.from_numpy(r) for r in raws]
    wis = [kernels.interleave_rows16(ws[0], int(Q.Q4_1), k), torch.empty(0, dtype=torch.uint8)]
    types, cols, n = [int(Q.Q4_1), int(Q.Q8_0)], [0, 32], 56
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(0)).bfloat16()

    def qlinear(x, act_q8=False):
        before = mod.bf16_calls()
        y = mod.qlinear(x, ws, types, cols, n, None, act_q8, wis)
        return y, [a - b for a, b in zip(mod.bf16_calls()[:3], before)]  # (no AMX tiles: avx512_bf16 below)

    def by_hand(bf16_copy):
        out = torch.empty(m, n)
        if bf16_copy:
            kernels.gemm_bf16(x, ws[0], types[0], out, 0, interleaved=wis[0])
        else:
            kernels.gemm(x.float(), ws[0], types[0], out, 0, interleaved=wis[0])
        kernels.gemm(x.float(), ws[1], types[1], out, 32)
        return out.bfloat16()

    prev = kernels.set_isa("avx512_bf16")
    try:
        y, calls = qlinear(x)
        assert calls == [0, 0, 1] and torch.equal(y, by_hand(True))
        y, calls = qlinear(x.float())
        assert calls == [0, 0, 0] and torch.equal(y.bfloat16(), by_hand(False))
        y, calls = qlinear(x, act_q8=True)
        int8 = torch.empty(m, n)
        for w, t, c in zip(ws, types, cols):
            kernels.gemm(x.float(), w, t, int8, c, act_q8=True)
        assert calls == [0, 0, 0] and torch.equal(y, int8.bfloat16())
        assert kernels.set_rows16_bf16(False) is True
        y, calls = qlinear(x)
        assert calls == [0, 0, 0] and torch.equal(y, by_hand(False))
        kernels.set_rows16_bf16(None)
        with pytest.raises(RuntimeError, match="interleave_rows16"):  # another weight's copy
            kernels.gemm_bf16(x, ws[1], types[1], torch.empty(m, n), 32, interleaved=wis[0])
        if HAVE_AMX:  # Q4_1's few rows on the exact tiles; without them the AMX levels' rule: the
            # float kernel; forced on, the bf16 one
            kernels.set_isa(kernels.available_isas()[-1])
            exact = mod.bf16_calls()[4]
            y, calls = qlinear(x)
            assert calls == [0, 0, 0] and mod.bf16_calls()[4] == exact + 1
            old_exact = kernels.set_amx_exact_rows(0)
            try:
                y, calls = qlinear(x)
                assert calls == [0, 0, 0] and torch.equal(y, by_hand(False))
                assert kernels.set_rows16_bf16(True) is False
                y, calls = qlinear(x)
                assert calls == [0, 0, 1] and torch.equal(y, by_hand(True))
            finally:
                kernels.set_amx_exact_rows(old_exact)
            kernels.set_rows16_bf16(None)
        kernels.set_isa("avx512")
        y, calls = qlinear(x)
        assert calls == [0, 0, 0] and torch.equal(y, by_hand(False))
    finally:
        kernels.set_rows16_bf16(None)
        kernels.set_isa(prev)


@needs_avx2
def test_interleaved_copies_only_where_they_apply():
    k = 64
    assert kernels.interleave_rows16(torch.from_numpy(random_packed(Q.Q4_1, 40, k)), int(Q.Q4_1), k) is None  # 40 rows
    f16_rows = torch.randn(32, k, generator=torch.Generator().manual_seed(0)).half().view(torch.uint8)
    assert kernels.interleave_rows16(f16_rows, int(Q.F16), k) is None  # type
    # on the scalar path the packed rows' kernel runs even when a copy is given: its own bits
    raw = torch.from_numpy(random_packed(Q.Q4_1, 32, k))
    wi = kernels.interleave_rows16(raw, int(Q.Q4_1), k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(1))
    prev = kernels.set_isa("scalar")
    try:
        assert kernels.interleave_rows16(raw, int(Q.Q4_1), k) is None
        a, b = torch.zeros(2, 32), torch.zeros(2, 32)
        kernels.gemm(x, raw, int(Q.Q4_1), a, 0)
        before = kernels.load().rows16_calls()
        kernels.gemm(x, raw, int(Q.Q4_1), b, 0, interleaved=wi)
        assert kernels.load().rows16_calls() == before and torch.equal(a, b)
    finally:
        kernels.set_isa(prev)


@pytest.mark.skipif(not HAVE_VBMI, reason="this CPU lacks avx512_vbmi (Q6_K's six-bit copies)")
def test_q6k_six_bit_copies_not_on_the_avx2_path():
    """The AVX2 kernel reads Q6_K's byte copies only: on the AVX2 path no six-bit copy is made,
    and one given falls back to the packed rows (their bits)."""
    k, qt = 256, int(Q.Q6_K)
    raw = torch.from_numpy(random_packed(Q.Q6_K, 32, k))
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(1))
    prev = kernels.set_isa("avx512")  # (whatever PAGEDSERVE_CPU_ISA chose)
    prev_six = kernels.set_q6k_six_bits(True)
    try:
        six = kernels.interleave_rows16(raw, qt, k)
        assert six is not None and six.numel() == raw.numel()
        kernels.set_isa("avx2")
        assert kernels.q6k_six_bits() and kernels.rows16_copy_size(raw, qt, k) == 0
        a, b = torch.zeros(2, 32), torch.zeros(2, 32)
        kernels.gemm(x, raw, qt, a, 0)
        before = kernels.load().rows16_calls()
        kernels.gemm(x, raw, qt, b, 0, interleaved=six)
        assert kernels.load().rows16_calls() == before and torch.equal(a, b)
    finally:
        kernels.set_q6k_six_bits(prev_six)
        kernels.set_isa(prev)


@pytest.mark.skipif(not HAVE_VBMI, reason="this CPU lacks avx512_vbmi (Q6_K's six-bit copies)")
def test_a_path_forced_below_avx512_writes_q6k_byte_copies():
    """PAGEDSERVE_CPU_ISA=avx2 on a CPU with AVX512-VBMI behaves as a CPU without it: Q6_K's
    copies in the byte layout (which the AVX2 kernel reads), not six bits (which it cannot)."""
    code = (
        "import torch; from pagedserve.executor.quant import kernels; "
        "from tests.executor.test_quant_kernels import random_packed, Q; "
        "w = torch.from_numpy(random_packed(Q.Q6_K, 16, 256)); "
        "wi = kernels.interleave_rows16(w, int(Q.Q6_K), 256); "
        "print(kernels.q6k_six_bits(), wi.numel(), w.numel())"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PAGEDSERVE_CPU_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    six, copy, packed = out.stdout.split()
    assert six == "False" and int(copy) == int(packed) // 210 * 274, out.stdout + out.stderr


@needs_avx2
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_interleaved_q4_copy_holds_the_documented_layout(qtype):
    """quant_rows16_layout.h's layout, byte for byte: per (group of 16 rows, block of 32) the rows'
    d, Q4_1's m, then 4 chunks of 64 bytes whose byte 16 L + 8 h + 2 i + s holds row 4 L + i's
    elements e = 4 c + 2 h + 16 s (low nibble) and e + 1 (high nibble)."""
    k, n = 64, 32
    raw = random_packed(qtype, n, k)
    wi = kernels.interleave_rows16(torch.from_numpy(raw), int(qtype), k).numpy()
    hdr, qoff = (64, 4) if qtype == Q.Q4_1 else (32, 2)
    bb = raw.shape[1] // (k // 32)  # a packed block's bytes
    bbi = 16 * bb  # an interleaved block's
    for g in range(n // 16):
        for blk in range(k // 32):
            p = wi[(g * (k // 32) + blk) * bbi : (g * (k // 32) + blk + 1) * bbi]
            for r in range(16):
                src = raw[g * 16 + r, blk * bb : (blk + 1) * bb]
                assert bytes(p[2 * r : 2 * r + 2]) == bytes(src[:2])  # d
                if qtype == Q.Q4_1:
                    assert bytes(p[32 + 2 * r : 34 + 2 * r]) == bytes(src[2:4])  # m
                qs = src[qoff:]
                elem = [qs[e] & 15 if e < 16 else qs[e - 16] >> 4 for e in range(32)]
                for c in range(4):
                    for h in range(2):
                        for s in range(2):
                            e = 4 * c + 2 * h + 16 * s
                            byte = p[hdr + 64 * c + 16 * (r // 4) + 8 * h + 2 * (r % 4) + s]
                            assert (byte & 15, byte >> 4) == (elem[e], elem[e + 1])
