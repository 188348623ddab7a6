"""Paged attention in plain PyTorch (the CPU path and the reference for GPU kernels).

Decodes are batched: their blocks are gathered (one index_select, ~3x faster than advanced
indexing) into a padded [n, L, kv_heads, d] tensor and attended with one masked SDPA call
with GQA (the CPU flash kernel reads the transposed view without copying it again).
Prefill chunks go one request at a time through SDPA (a step holds few of them): with
no cached prefix they attend to their own K/V causally; otherwise over the gathered
context with an offset causal mask. No loop over tokens.

Sliding windows mask positions before the window and read no block wholly before it;
logit soft-capping (Gemma 2) replaces SDPA by transformers' eager order of operations.

With the C++ kernels, a step's prefill chunks (fresh or after cached context, K/V read from
the cache) go through one call: in bf16 on an AMX CPU the tile kernel (csrc/prefill_amx.h),
on an AVX512-BF16 CPU the vdpbf16ps kernel (csrc/prefill_bf16.h), else the float32-arithmetic
kernel (csrc/prefill_paged.h); SDPA only for fresh bf16 prompts on an AMX CPU whose module
lacks the tiles. Requests with a few query tokens over a cached context (speculative verification:
the last token and k guesses) go through the decode kernel, each query token as its own
row that sees the context up to itself: the kernel reads K/V in place, where SDPA would
need the context gathered into a copy and a mask, per request and layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.executor.attention import cpu_kernels
from pagedserve.executor.attention.backend import AttentionBackend, AttentionMetadata


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
):
    """Scatter the step's K/V [T, kvh, d] into their slots of the paged cache (rounded to
    the cache's dtype where it is narrower: kv_cache_dtype). float8 caches are written
    through byte views (index_copy_ has no float8 kernels)."""
    nb, bs, kvh, d = k_cache.shape
    for src, cache in ((k, k_cache), (v, v_cache)):
        src = src.to(cache.dtype)
        if cache.dtype.itemsize == 1:
            cache, src = cache.view(torch.uint8), src.view(torch.uint8)
        cache.view(nb * bs, kvh, d).index_copy_(0, slots, src)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, nblk] block ids -> [n, nblk * bs, kvh, d] in `dtype` (a copy, in token order)."""
    n, nblk = block_tables.shape
    _, bs, kvh, d = cache.shape
    return cache.index_select(0, block_tables.reshape(-1)).view(n, nblk * bs, kvh, d).to(dtype)


# Requests with at most this many query tokens use the decode kernel (one row per token).
SHORT_QUERY_MAX = 16


def short_query_rows(
    meta: AttentionMetadata,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, list[int]]:
    """The non-decode requests with 2..SHORT_QUERY_MAX query tokens, as decode rows
    (token indices [R], their block-table rows [R, max_blocks], their causal context
    lengths [R]; None when there are none), and the other non-decode requests. Token j of a
    request with q query tokens and seq_len L sees L - q + 1 + j tokens."""
    qsl, sl = meta.query_start_loc_list, meta.seq_lens_list
    reqs, rest = [], []
    for r in range(meta.num_decodes, meta.num_reqs):
        (reqs if qsl[r + 1] - qsl[r] <= SHORT_QUERY_MAX else rest).append(r)
    if not reqs:
        return None, rest
    toks, rows, lens = [], [], []
    for r in reqs:
        q = qsl[r + 1] - qsl[r]
        toks.extend(range(qsl[r], qsl[r + 1]))
        rows.extend([r] * q)
        lens.extend(range(sl[r] - q + 1, sl[r] + 1))
    dev = meta.block_tables.device
    tok = torch.tensor(toks, dtype=torch.int64, device=dev)
    bt = meta.block_tables.index_select(0, torch.tensor(rows, dtype=torch.int64, device=dev))
    return (tok, bt, torch.tensor(lens, dtype=torch.int64, device=dev)), rest


def _amx_in_use() -> bool:
    from pagedserve.executor.quant import kernels as quant_kernels

    return quant_kernels.amx_in_use()


def _paged_prefill_ok(q, k_cache) -> bool:
    """The C++ prefill kernel's preconditions: head_dim 64 or 128, rows of contiguous heads,
    K/V cached in the model's dtype (a narrower cache attends to K/V as stored: the SDPA path)."""
    d = q.shape[-1]
    return (
        d in (64, 128)
        and k_cache.dtype == q.dtype
        and q.dtype in (torch.float32, torch.bfloat16)
        and q.stride(-1) == 1
        and q.stride(-2) == d
        and k_cache.is_contiguous()
    )


class TorchAttentionBackend(AttentionBackend):
    """`use_cpp_decode`: decode through the C++ kernel (cpu_kernels.py) when it builds; it
    reads K/V in place through the block table instead of gathering a copy (2-3x faster)."""

    name = "torch"
    supports_prewritten_kv = True
    supports_narrow_kv_cache = True
    supports_sliding_window = True
    supports_softcap = True

    def __init__(self, use_cpp_decode: bool = False) -> None:
        self._cpp = None
        if use_cpp_decode:
            from pagedserve.executor.attention import cpu_kernels

            self._cpp = cpu_kernels.load()
            if self._cpp is not None:
                self.name = "torch+cpp-decode"

    @property
    def decode_from_qkv(self):
        """The C++ kernel that attends a decode-only step straight from fused QKV rows
        (qkv [T, >= h*d], h, k_cache, v_cache, block_tables, seq_lens, scale) -> [T, h*d],
        K/V already written; None without the C++ kernels."""
        return self._cpp.paged_decode_qkv if self._cpp is not None else None

    def decode_rows(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per query token (block-table row [T, max_blocks], causal context length [T]) when
        every token of the step can go through `decode_from_qkv` exactly as `forward` would
        send it through the decode kernel: a decode-only step (one call for all rows), or a
        step of short queries only (speculative verification, tiny prompts; no decodes
        beside them, which `forward` would attend in a call of their own). Else None."""
        if self._cpp is None or meta.num_reqs == 0:
            return None
        if meta.num_decodes == meta.num_reqs:
            return meta.block_tables, meta.seq_lens
        if meta.num_decodes or meta.max_query_len > SHORT_QUERY_MAX:
            return None
        if "short" not in meta.backend_cache:
            meta.backend_cache["short"] = short_query_rows(meta)
        (_, tables, lens), _ = meta.backend_cache["short"]  # tokens in order: 0 .. T-1
        return tables, lens

    def forward(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if not kv_written:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decodes
        cpp = self._cpp if q.device.type == "cpu" else None
        w, c = window or 0, softcap or 0.0
        if nd == meta.num_reqs and cpp is not None:
            # a decode-only step (batch-1 latency): the kernel reads q in place (rows of the
            # fused QKV output) and its output is the answer: no scratch, slices or copies
            return cpp.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, w, c)
        out = torch.empty_like(q)
        if nd:
            if cpp is not None:
                out[:nd] = cpp.paged_decode(
                    q[:nd].contiguous(), k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, w, c
                )
            else:
                out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, window, softcap)
        qsl, sl = meta.query_start_loc_list, meta.seq_lens_list
        rest = range(nd, meta.num_reqs)
        if cpp is not None and meta.num_reqs > nd:
            if "short" not in meta.backend_cache:  # once per step, for every layer
                meta.backend_cache["short"] = short_query_rows(meta)
            short, rest = meta.backend_cache["short"]
            if short is not None:
                tok, bt, lens = short
                out.index_copy_(0, tok, cpp.paged_decode(q.index_select(0, tok), k_cache, v_cache, bt, lens, scale, w, c))
        if cpp is not None and rest and not w and not c:
            if "amx_ok" not in meta.backend_cache:  # the module's answers, once per step
                meta.backend_cache["amx_ok"] = cpu_kernels.amx_prefill_usable(cpp)
                meta.backend_cache["bf16_ok"] = cpu_kernels.bf16_prefill_usable(cpp)
                meta.backend_cache["amx_cpu"] = _amx_in_use()
            bf16_fits = cpu_kernels.bf16_prefill_fits(q, k_cache)
            if bf16_fits and not meta.backend_cache["amx_ok"] and meta.backend_cache["amx_cpu"]:
                rest = self._fresh_sdpa_prefills(q, k, v, out, meta, rest, scale)  # the tiles through torch
            if meta.backend_cache["amx_ok"] and bf16_fits:
                rest = self._cpp_prefills("prefill_amx", q, k_cache, v_cache, out, meta, rest, scale)
            elif meta.backend_cache["bf16_ok"] and bf16_fits:
                rest = self._cpp_prefills("prefill_bf16", q, k_cache, v_cache, out, meta, rest, scale)
            elif _paged_prefill_ok(q, k_cache):
                rest = self._cpp_prefills("prefill_paged", q, k_cache, v_cache, out, meta, rest, scale)
        for r in rest:
            s, e = qsl[r], qsl[r + 1]
            out[s:e] = self._prefill(
                q[s:e], k[s:e], v[s:e], k_cache, v_cache, meta.block_tables[r], sl[r], scale, window, softcap
            )
        return out

    @staticmethod
    def _chunk_args(meta: AttentionMetadata, rest) -> tuple:
        """The C++ prefill kernels' per-request arguments for the requests of `rest`: query
        row starts, query counts, sequence lengths (int64) and their block-table rows."""
        qsl, sl = meta.query_start_loc_list, meta.seq_lens_list
        rows = torch.tensor(list(rest), dtype=torch.int64, device=meta.block_tables.device)
        return (
            torch.tensor([qsl[r] for r in rest], dtype=torch.int64),
            torch.tensor([qsl[r + 1] - qsl[r] for r in rest], dtype=torch.int64),
            torch.tensor([sl[r] for r in rest], dtype=torch.int64),
            meta.block_tables.index_select(0, rows).long(),
        )

    def _cpp_prefills(self, kernel: str, q, k_cache, v_cache, out, meta: AttentionMetadata, rest, scale) -> list[int]:
        """The requests of `rest` (prefill chunks, fresh or after cached context) attended in
        one call of C++ kernel `kernel` (prefill_amx, prefill_bf16 or prefill_paged: csrc/),
        K/V read from the cache, into `out`; returns none left. The requests' rows are worked
        out once per step (every layer calls the same kernel on the same requests)."""
        if not rest:
            return []
        if "chunks" not in meta.backend_cache:
            meta.backend_cache["chunks"] = self._chunk_args(meta, rest)
        getattr(self._cpp, kernel)(q, k_cache, v_cache, out, *meta.backend_cache["chunks"], scale)
        return []

    def _fresh_sdpa_prefills(self, q, k, v, out, meta: AttentionMetadata, rest, scale: float) -> list[int]:
        """On an AMX CPU whose module lacks the tile kernel (a compiler without AMX-BF16), in
        bf16: the requests of `rest` with no cached context (causal over their own rows) by
        torch's flash attention, which runs on the tiles at 2-3.5x the float32 kernel
        (BENCHMARKS section 33), into `out`; returns the others."""
        qsl, sl = meta.query_start_loc_list, meta.seq_lens_list
        others = []
        for r in rest:
            s, n = qsl[r], qsl[r + 1] - qsl[r]
            if sl[r] != n:
                others.append(r)
                continue
            heads = [x[s : s + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]  # [1, heads, n, d]
            o = F.scaled_dot_product_attention(*heads, is_causal=True, scale=scale, enable_gqa=True)
            out[s : s + n] = o[0].transpose(0, 1)
        return others

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window=None, softcap=None) -> torch.Tensor:
        n = q.shape[0]
        bs = k_cache.shape[1]
        nblk = -(-meta.max_decode_seq_len // bs)
        bt = meta.block_tables[:n, :nblk]
        if window:  # entries before the window may be stale (given back): read the null block
            first = (meta.seq_lens[:n] - window).clamp(min=0) // bs
            bt = bt.masked_fill(torch.arange(nblk, device=bt.device)[None, :] < first[:, None], 0)
        keys = gather_kv(k_cache, bt, q.dtype).transpose(1, 2)  # [n, kvh, L, d]
        vals = gather_kv(v_cache, bt, q.dtype).transpose(1, 2)
        L = keys.shape[2]
        pos = torch.arange(L, device=q.device)[None, :]
        valid = pos < meta.seq_lens[:n, None]  # [n, L]
        if window:
            valid &= pos >= meta.seq_lens[:n, None] - window
        o = attend(q.unsqueeze(2), keys, vals, valid[:, None, None, :], scale, softcap)
        return o.squeeze(2)  # [n, h, d]

    @staticmethod
    def _prefill(
        q, k, v, k_cache, v_cache, block_table, seq_len: int, scale: float, window=None, softcap=None
    ) -> torch.Tensor:
        ql = q.shape[0]
        ctx = seq_len - ql
        qt = q.transpose(0, 1).unsqueeze(0)  # [1, h, ql, d]
        if ctx == 0:
            if k_cache.dtype != q.dtype:  # a narrower cache: attend to K/V as stored, so a
                # prompt gives the same numbers whether or not a prefix of it was cached
                k, v = k.to(k_cache.dtype).to(q.dtype), v.to(v_cache.dtype).to(q.dtype)
            kt, vt = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            first = 0
        else:
            # the context from the first block the chunk's first query can see
            bs = k_cache.shape[1]
            first = max(0, ctx - window + 1) // bs * bs if window else 0
            bt = block_table[first // bs : -(-seq_len // bs)].unsqueeze(0)
            kt = gather_kv(k_cache, bt, q.dtype)[:, : seq_len - first].transpose(1, 2)  # [1, kvh, seq, d]
            vt = gather_kv(v_cache, bt, q.dtype)[:, : seq_len - first].transpose(1, 2)
        if ctx == 0 and not window:
            mask = None  # causal
        else:
            qpos = torch.arange(ctx, seq_len, device=q.device)[:, None]
            kpos = torch.arange(first, seq_len, device=q.device)[None, :]
            mask = kpos <= qpos  # [ql, seq]
            if window:
                mask &= kpos > qpos - window
        o = attend(qt, kt, vt, mask, scale, softcap)
        return o[0].transpose(0, 1)  # [ql, h, d]


def attend(q, k, v, mask, scale: float, softcap: float | None = None) -> torch.Tensor:
    """q [n, h, lq, d], k / v [n, kvh, L, d], mask (True = attend) broadcast to [n, h, lq, L],
    None for causal. SDPA; with `softcap` transformers' eager order (scores * scale, soft
    cap, mask, float32 softmax, P.V), which SDPA cannot do."""
    if softcap is None:
        causal = mask is None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if mask is None:
        lq, L = s.shape[-2:]
        mask = torch.ones(lq, L, dtype=torch.bool, device=q.device).tril(L - lq)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)
