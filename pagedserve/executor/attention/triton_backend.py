"""Triton attention backend (the GPU path), same contract as the PyTorch backend.

Kernels:
  * write_kv: scatter the step's K/V rows into their cache slots (slot_mapping).
  * decode: one query token per sequence, split-K over the context (flash-decoding): grid
    (sequence, kv head, partition); each program walks its partition's tokens through the
    block table, keeps an online softmax for the `group` query heads that share the KV
    head (GQA: each K/V row is read once), and writes a partial (max, sum, acc); a second
    kernel merges the partitions. Both products are tl.dot on the tensor cores, the group
    padded to 16 rows (tl.dot's smallest side; the padding rows are zeros, never stored):
    the earlier broadcast-and-sum in registers took 8.7x its K/V bytes' time on an H200 at
    batch 256, this 1.45x (BENCHMARKS section 7). Partitions past a sequence's length exit
    at once, so the grid can be fixed (CUDA graphs).
  * prefill: chunks over a cached prefix, flash-attention style with tl.dot (tensor
    cores): grid (query block, query head, sequence); keys come from the paged cache (the
    chunk's own K/V were written first), with the causal mask offset by the context length.
A sliding window (runtime `window`, 0: none) starts each program's key loop at the first
tile a query can see and masks the rest; a soft cap (`softcap`, 0: none) caps the scaled
scores as cap * tanh(s / cap) (tanh from exp: the interpreter and every GPU have it). A
running maximum that is still -inf (a row with no visible key yet) is taken as 0, so a
masked tile adds nothing instead of NaN.
Any head dimension works: the kernels take it as a tile of DP lanes (a power of two, at least
16, the compiled kernels' rule; the interpreter does not enforce it) with the lanes past it
masked. Keys are addressed per token (block_table[pos // bs] * bs + pos % bs), so any block
size works with any tile size. Checked on the CPU under TRITON_INTERPRET=1 against the
PyTorch backend (tests/executor/test_triton_backend.py).
Integer arguments that change from step to step (block-table width, partition count, first
request) are `do_not_specialize`: Triton otherwise compiles a variant per value class (1,
multiple of 16, other), each a compile of a second or more the first time a server's step
meets it (a served burst on an H200 ran 24% slower cold than warm; not yet measured apart
from the other warm-up costs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from pagedserve.executor.attention.backend import AttentionBackend, AttentionMetadata

PARTITION = 256  # context tokens per decode program


@triton.jit
def _kv_row_offsets(table_ptr, pos, mask, kvh, KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):
    """Element offsets of the K/V rows (one per token position) of KV head `kvh`, found
    through a sequence's block table: block_table[pos // BS] * BS + pos % BS is the slot."""
    blk = tl.load(table_ptr + pos // BS, mask=mask, other=0)
    return ((blk * BS + pos % BS) * KVH + kvh) * D


@triton.jit
def _softcap(s, cap):
    """cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1) (exact at +-inf)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    offs = tl.arange(0, BLOCK)
    m = offs < ROW
    tl.store(kc_ptr + slot * ROW + offs, tl.load(k_ptr + t * ROW + offs, mask=m), mask=m)
    tl.store(vc_ptr + slot * ROW + offs, tl.load(v_ptr + t * ROW + offs, mask=m), mask=m)


@triton.jit(do_not_specialize=["max_blocks", "num_parts"])  # per-step values: no recompile per value class
def _decode_partial_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    seq_lens_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    scale,
    max_blocks,
    num_parts,
    window,
    softcap,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    DP: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PART: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)  # int64: the scratch offsets pass 2^31 at long contexts
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PART
    if start < seq_len:
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, DP)
        gm = g < G
        dm = d < D
        qm = gm[:, None] & dm[None, :]
        q = tl.load(q_ptr + (seq * H + kvh * G + g)[:, None] * D + d[None, :], mask=qm, other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, DP], tl.float32)
        end = tl.minimum(start + PART, seq_len)
        lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # one type in both cases
        n_first = tl.maximum(start, lo // BLOCK_N * BLOCK_N)  # a partition before the window: no tile
        for n0 in range(n_first, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pm = (pos < end) & (pos >= lo)
            row = _kv_row_offsets(bt_ptr + seq * max_blocks, pos, pm, kvh, KVH, D, BS)
            kvm = pm[:, None] & dm[None, :]
            k = tl.load(kc_ptr + row[:, None] + d[None, :], mask=kvm, other=0.0)
            if IEEE:  # exact float32 (no tf32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N]
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            if softcap > 0:
                s = _softcap(s, softcap)
            s = tl.where(pm[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(vc_ptr + row[:, None] + d[None, :], mask=kvm, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        base = (seq * H + kvh * G + g) * num_parts + part
        tl.store(m_ptr + base, m_i, mask=gm)
        tl.store(l_ptr + base, l_i, mask=gm)
        tl.store(acc_ptr + base[:, None] * D + d[None, :], acc, mask=qm)


@triton.jit(do_not_specialize=["num_parts"])  # per-step values: no recompile per value class
def _decode_reduce_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    seq_lens_ptr,
    out_ptr,
    num_parts,
    H: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    PART: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    used = tl.cdiv(tl.load(seq_lens_ptr + seq), PART)
    p = tl.arange(0, BLOCK_P)
    pm = p < used
    base = (seq * H + h) * num_parts + p
    m = tl.load(m_ptr + base, mask=pm, other=float("-inf"))
    l = tl.load(l_ptr + base, mask=pm, other=0.0)
    d = tl.arange(0, DP)
    dm = d < D
    acc = tl.load(acc_ptr + base[:, None] * D + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(pm, tl.exp(m - m_all), 0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + (seq * H + h) * D + d, out.to(out_ptr.dtype.element_ty), mask=dm)


@triton.jit(do_not_specialize=["max_blocks", "first_req"])  # per-step values: no recompile per value class
def _prefill_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    out_ptr,
    bt_ptr,
    qsl_ptr,
    seq_lens_ptr,
    scale,
    max_blocks,
    first_req,
    window,
    softcap,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    mblk = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.program_id(2) + first_req
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    if mblk * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + r)
        ctx = seq_len - q_len
        kvh = h // (H // KVH)
        i = mblk * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the chunk
        im = i < q_len
        d = tl.arange(0, DP)
        dm = d < D
        q = tl.load(
            q_ptr + ((q_start + i) * H + h)[:, None] * D + d[None, :], mask=im[:, None] & dm[None, :], other=0.0
        )
        qpos = ctx + i
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DP], tl.float32)
        hi = tl.minimum(seq_len, ctx + (mblk + 1) * BLOCK_M)  # causal: no key after the last query
        # no key before the first query's window (tl.where: one type in both cases)
        lo = tl.where(window > 0, tl.maximum(ctx + mblk * BLOCK_M - window + 1, 0), 0)
        for n0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pm = pos < hi
            row = _kv_row_offsets(bt_ptr + r * max_blocks, pos, pm, kvh, KVH, D, BS)
            kvm = pm[:, None] & dm[None, :]
            k = tl.load(kc_ptr + row[:, None] + d[None, :], mask=kvm, other=0.0)
            if IEEE:  # exact float32 (no tf32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N]
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            if softcap > 0:
                s = _softcap(s, softcap)
            ok = pm[None, :] & (pos[None, :] <= qpos[:, None])
            if window > 0:
                ok = ok & (pos[None, :] > qpos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            v = tl.load(vc_ptr + row[:, None] + d[None, :], mask=kvm, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + ((q_start + i) * H + h)[:, None] * D + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=im[:, None] & dm[None, :],
        )


def _dim_tile(head_dim: int) -> int:
    """The head dimension's tile: a power of two (tl.arange's rule) and at least 16 (tl.dot's
    smallest operand side on the GPU); lanes past the head dimension are masked off."""
    return max(16, triton.next_power_of_2(head_dim))


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_sliding_window = True
    supports_softcap = True

    def __init__(self, block_m: int = 16, block_n: int = 32, decode_block_n: int = 64) -> None:
        # a decode key tile must not straddle partitions: a tile wholly before a sliding window
        # would then leave a row's running maximum at -inf (NaN in the merge)
        if not (16 <= decode_block_n <= PARTITION and PARTITION % decode_block_n == 0):
            raise ValueError(f"decode_block_n={decode_block_n}: a power of two from 16 to {PARTITION}")
        self.block_m, self.block_n, self.decode_block_n = block_m, block_n, decode_block_n
        self._decode_tiles: dict = {}  # (dtype, head_dim, group) -> the tile that fit this GPU

    def decode_tile(self, dtype: torch.dtype, head_dim: int) -> int:
        """The decode kernel's first key tile: float32 tiles of heads over 128 wide at 64 tokens
        need ~150 KB of shared memory, past sm86 / sm89's ~100 KB (an H100 / H200 has 228 KB).
        A launch that still runs out of shared memory (float32 with a large query group)
        halves the tile down to 16 and remembers what fit (decode)."""
        return min(32, self.decode_block_n) if dtype == torch.float32 and head_dim > 128 else self.decode_block_n

    def write_kv(self, k, v, k_cache, v_cache, slots) -> None:
        t, kvh, d = k.shape
        _write_kv_kernel[(t,)](
            k.contiguous(), v.contiguous(), k_cache, v_cache, slots, ROW=kvh * d, BLOCK=triton.next_power_of_2(kvh * d)
        )

    def decode(
        self, q, k_cache, v_cache, block_tables, seq_lens, max_seq_len: int, scale: float, window=0, softcap=0.0
    ) -> torch.Tensor:
        """q [n, h, d] -> [n, h, d]. The grid depends only on n and max_seq_len (fixed for a
        captured CUDA graph: pass the largest length the graph serves)."""
        n, h, d = q.shape
        _, bs, kvh, _ = k_cache.shape
        g = h // kvh
        parts = max(1, triton.cdiv(max_seq_len, PARTITION))
        m = torch.empty(n, h, parts, device=q.device, dtype=torch.float32)
        l = torch.empty_like(m)
        acc = torch.empty(n, h, parts, d, device=q.device, dtype=torch.float32)
        args = (q.contiguous(), k_cache, v_cache, block_tables, seq_lens, m, l, acc, scale,
                block_tables.shape[1], parts, window or 0, float(softcap or 0.0))
        consts = dict(H=h, KVH=kvh, D=d, DP=_dim_tile(d), BS=bs, G=g, BLOCK_G=max(16, triton.next_power_of_2(g)),
                      PART=PARTITION, IEEE=q.dtype == torch.float32)
        key = (q.dtype, d, g)
        tile = self._decode_tiles.get(key) or self.decode_tile(q.dtype, d)
        while True:
            try:
                _decode_partial_kernel[(n, kvh, parts)](*args, BLOCK_N=tile, **consts)
                break
            except OutOfResources:  # this GPU's shared memory (float32 with a large query group)
                if tile <= 16:
                    raise
                tile //= 2
        self._decode_tiles[key] = tile
        out = torch.empty_like(q)
        _decode_reduce_kernel[(n, h)](
            m, l, acc, seq_lens, out, parts, H=h, D=d, DP=consts["DP"], PART=PARTITION,
            BLOCK_P=max(2, triton.next_power_of_2(parts)),
        )
        return out

    def forward(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, kv_written=False, window=None, softcap=None
    ) -> torch.Tensor:
        if not kv_written:
            self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decodes
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.decode(
                q[:nd],
                k_cache,
                v_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                meta.max_decode_seq_len,
                scale,
                window,
                softcap,
            )
        n_pre = meta.num_reqs - nd
        if n_pre:
            h, d = q.shape[1], q.shape[2]
            _, bs, kvh, _ = k_cache.shape
            grid = (triton.cdiv(meta.max_query_len, self.block_m), h, n_pre)
            _prefill_kernel[grid](
                q.contiguous(),
                k_cache,
                v_cache,
                out,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                scale,
                meta.block_tables.shape[1],
                nd,
                window or 0,
                float(softcap or 0.0),
                H=h,
                KVH=kvh,
                D=d,
                DP=_dim_tile(d),
                BS=bs,
                BLOCK_M=self.block_m,
                BLOCK_N=self.block_n,
                IEEE=q.dtype == torch.float32,
            )
        return out
