"""The C++ decode kernel against the PyTorch reference backend."""

import collections
import contextlib

import pytest
import torch

from pagedserve.executor.attention import cpu_kernels
from pagedserve.executor.attention.backend import AttentionMetadata
from pagedserve.executor.attention.torch_backend import TorchAttentionBackend

kernels = cpu_kernels.load()


@pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize(
    "heads,kv_heads,d", [(4, 4, 64), (8, 2, 64), (8, 1, 128), (9, 3, 64), (6, 2, 40), (2, 1, 12)]
)  # d 40: the AVX2 path's 8-wide tail; d 12: the portable path (not a multiple of 8)
def test_cpp_decode_matches_reference(dtype, tol, bs, heads, kv_heads, d):
    g = torch.Generator().manual_seed(bs * 100 + heads)
    n, nb = 7, 64
    kc = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    lens = torch.tensor([1, bs - 1, bs, bs + 1, 3 * bs + 5, 5 * bs, 2])  # across block boundaries
    nblk = int((lens.max() + bs - 1) // bs)
    bt = torch.stack([torch.randperm(nb - 1, generator=g)[:nblk] + 1 for _ in range(n)])
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    meta = AttentionMetadata(n, n, None, lens, bt, None, 1, int(lens.max()), int(lens.max()), None, None)
    ref = TorchAttentionBackend._decode(q, kc, vc, meta, d**-0.5)
    out = kernels.paged_decode(q, kc, vc, bt, lens, d**-0.5)
    assert (out.float() - ref.float()).abs().max().item() < tol


@pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("q_dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("lens", [[1, 17, 3 * 16 + 5, 160], [9 * 16 + 3]])  # many rows; one split context
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (6, 2, 40), (2, 1, 12)])
def test_cpp_decode_narrow_kv_cache(kv_dtype, q_dtype, tol, lens, heads, kv_heads, d):
    """kv_cache_dtype float16 / bfloat16 / fp8: the kernel converts K/V as it reads them
    (16-wide on AVX-512, else AVX2 + F16C, else the portable path) and matches the reference
    over the same stored values (gathered, converted to q's dtype, SDPA). V at a small scale
    puts float8 subnormals among the values."""
    g = torch.Generator().manual_seed(len(lens) + heads + d)
    bs, nb, n = 16, 64, len(lens)
    kc = (torch.randn(nb, bs, kv_heads, d, generator=g) * 3).to(kv_dtype)
    vc = (torch.randn(nb, bs, kv_heads, d, generator=g) * 0.05).to(kv_dtype)
    lens_t = torch.tensor(lens)
    nblk = int((lens_t.max() + bs - 1) // bs)
    bt = torch.stack([torch.randperm(nb - 1, generator=g)[:nblk] + 1 for _ in range(n)])
    q = torch.randn(n, heads, d, generator=g).to(q_dtype)
    meta = AttentionMetadata(n, n, None, lens_t, bt, None, 1, max(lens), max(lens), None, None)
    ref = TorchAttentionBackend._decode(q, kc, vc, meta, d**-0.5)
    out = kernels.paged_decode(q, kc, vc, bt, lens_t, d**-0.5)
    assert out.dtype == q_dtype
    assert (out.float() - ref.float()).abs().max().item() < tol


@pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])  # every vector path's conversion
def test_cpp_decode_reads_every_float8_value_exactly(kv_dtype, q_dtype):
    """One token of context: the output is its V row, so it must equal torch's conversion of
    every float8 byte (subnormals, zeros of both signs, the largest values) to the bit. NaN
    bytes are left out: a write saturates (e4m3fn) and never stores them."""
    values = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(kv_dtype)
    values = values[~values.float().isnan()]
    d, n = 64, -(-values.numel() // 64)
    vrows = torch.cat([values, torch.zeros(n * d - values.numel(), dtype=torch.uint8).view(kv_dtype)])
    kc = torch.zeros(n + 1, 16, 1, d, dtype=kv_dtype)
    vc = torch.zeros(n + 1, 16, 1, d, dtype=kv_dtype)
    vc[1:, 0, 0] = vrows.view(n, d)
    bt = torch.arange(1, n + 1).view(n, 1)
    out = kernels.paged_decode(torch.randn(n, 2, d).to(q_dtype), kc, vc, bt, torch.ones(n, dtype=torch.int64), 0.125)
    want = vrows.view(n, 1, d).float().expand(n, 2, d).to(q_dtype)
    assert torch.equal(out, want)


@pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("lens", [[9 * 16 + 3], [16 * 16, 12 * 16 + 1], [5]])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 1, 64), (6, 2, 40)])
def test_cpp_decode_split_context_and_strided_q(threads, lens, heads, kv_heads, d):
    """Few sequences (a batch-1 step): each context is cut into parts over the threads and
    merged by the parts' softmax maxima and sums; q is read in place from a fused-QKV-like
    row (strided), as the decode-only path passes it."""
    g = torch.Generator().manual_seed(len(lens) * 10 + heads + threads)
    bs, nb, n = 16, 64, len(lens)
    kc = torch.randn(nb, bs, kv_heads, d, generator=g)
    vc = torch.randn(nb, bs, kv_heads, d, generator=g)
    lens_t = torch.tensor(lens)
    nblk = int((lens_t.max() + bs - 1) // bs)
    bt = torch.stack([torch.randperm(nb - 1, generator=g)[:nblk] + 1 for _ in range(n)])
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g)
    q = qkv[:, : heads * d].view(n, heads, d)  # strided rows, as split() leaves them
    meta = AttentionMetadata(n, n, None, lens_t, bt, None, 1, max(lens), max(lens), None, None)
    ref = TorchAttentionBackend._decode(q.contiguous(), kc, vc, meta, d**-0.5)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.paged_decode(q, kc, vc, bt, lens_t, d**-0.5)
    finally:
        torch.set_num_threads(prev)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def _mixed_meta(reqs, bs, nb, g):
    """reqs: (cached tokens, query tokens) per request, decodes (query 1) first."""
    qlens = [q for _, q in reqs]
    seq = [c + q for c, q in reqs]
    cu = [0]
    for q in qlens:
        cu.append(cu[-1] + q)
    nblk = max(-(-s // bs) for s in seq)
    perm = torch.randperm(nb - 1, generator=g) + 1
    bt = perm[: len(reqs) * nblk].view(len(reqs), nblk)
    slots = []
    for r, (c, q) in enumerate(reqs):
        slots += [int(bt[r, p // bs]) * bs + p % bs for p in range(c, c + q)]
    nd = sum(1 for q in qlens if q == 1)
    return AttentionMetadata(
        len(reqs), nd, torch.tensor(cu), torch.tensor(seq), bt, torch.tensor(slots), max(qlens), max(seq),
        max(seq[:nd], default=0), cu, seq,
    )

def _sdpa_vs_cpp_step(reqs, heads, kv_heads, d, seed, bs=16, nb=96):
    """One mixed step (_mixed_meta's (cached, new) requests, random float32 q/k/v and caches)
    through the SDPA reference backend and the C++ path: (reference, C++ output, the C++ run's
    meta, its prefill kernels' calls by name)."""
    g = torch.Generator().manual_seed(seed)
    meta = _mixed_meta(reqs, bs, nb, g)
    t = meta.num_tokens
    q = torch.randn(t, heads, d, generator=g)
    k, v = torch.randn(t, kv_heads, d, generator=g), torch.randn(t, kv_heads, d, generator=g)
    kc0 = torch.randn(nb, bs, kv_heads, d, generator=g)
    vc0 = torch.randn(nb, bs, kv_heads, d, generator=g)
    ref = TorchAttentionBackend().forward(q, k, v, kc0.clone(), vc0.clone(), meta, d**-0.5)
    meta2 = _mixed_meta(reqs, bs, nb, torch.Generator().manual_seed(seed))
    backend = TorchAttentionBackend(use_cpp_decode=True)
    backend._cpp = counting = _Counting(backend._cpp)
    out = backend.forward(q, k, v, kc0.clone(), vc0.clone(), meta2, d**-0.5)
    return ref, out, meta2, dict(counting.calls)



@pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_short_queries_through_decode_kernel_match_sdpa(heads, kv_heads):
    """Speculative verification rows (a few query tokens over a cached context), a short fresh
    prompt and a long chunk, beside decodes: the C++ path equals the SDPA path."""
    reqs = [(40, 1), (3, 1), (37, 5), (16, 2), (0, 4), (20, 16), (9, 40)]
    ref, out, meta2, _ = _sdpa_vs_cpp_step(reqs, heads, kv_heads, 32, seed=heads)
    assert meta2.backend_cache["short"][0] is not None  # the short requests took the kernel
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [5, 16, 40])  # inside a block, one block, several blocks
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("heads,kv_heads,d", [(6, 2, 64), (12, 4, 128), (2, 1, 12)])  # vector paths; portable
def test_cpp_decode_sliding_window_and_softcap(dtype, tol, window, softcap, heads, kv_heads, d):
    """A window: each row attends to its last `window` positions, reading no block wholly
    before them (their table entries here point at NaN blocks, as a block handed back to the
    pool may hold anything); a soft cap: tanh-capped scores. Against the reference's masks,
    one row per length (batch-1 rows take the split-context path)."""
    g = torch.Generator().manual_seed(window + heads)
    bs, nb = 8, 96
    kc = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype) * 2
    vc = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    kc[1], vc[1] = float("nan"), float("nan")  # the stale block
    for lens in ([1, 4, 5, 6, 16, 17, 41, 100], [150]):
        n = len(lens)
        lens_t = torch.tensor(lens)
        nblk = -(-max(lens) // bs)
        bt = torch.stack([torch.randperm(nb - 2, generator=g)[:nblk] + 2 for _ in range(n)])
        for i, L in enumerate(lens):  # blocks before the window: the NaN block
            bt[i, : max(0, L - window) // bs] = 1
        q = torch.randn(n, heads, d, generator=g).to(dtype)
        meta = AttentionMetadata(n, n, None, lens_t, bt, None, 1, max(lens), max(lens), None, None)
        clean = bt.masked_fill(bt == 1, 2)  # the reference gathers every block: give it finite ones
        # the reference in float64: torch's float32 products on an AMX CPU were off by 1e-4 in
        # about one run in ten (the kernel's output was the same every time)
        ref = TorchAttentionBackend._decode(q.double(), kc.double(), vc.double(),
                                            meta.__class__(**{**meta.__dict__, "block_tables": clean}), d**-0.5,
                                            window, softcap)
        out = kernels.paged_decode(q, kc, vc, bt, lens_t, d**-0.5, window, softcap or 0.0)
        assert torch.isfinite(out.float()).all()
        assert (out.float() - ref.float()).abs().max().item() < tol
        full = kernels.paged_decode(q, kc, vc, clean, lens_t, d**-0.5, 0, softcap or 0.0)
        if max(lens) > window:
            assert (full.float() - ref.float()).abs().max().item() > tol  # the window matters


def _paged_case(reqs, heads, kv_heads, d, bs, dtype, g):
    """Random inputs for a paged prefill kernel: q as strided views of fused QKV rows with
    gaps between the requests' rows, K/V caches with each request's blocks scattered:
    (q, kc, vc, starts, block table, blocks per request, T)."""
    starts, t = [], 2
    for _, n in reqs:
        starts.append(t)
        t += n + 3  # gaps: rows the kernel must leave alone
    blocks = [-(-(c + n) // bs) for c, n in reqs]
    nb = sum(blocks) + 1
    kc = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    perm = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    bt = torch.zeros(len(reqs), max(blocks), dtype=torch.int64)
    for r, n in enumerate(blocks):
        bt[r, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    return qkv[:, : heads * d].view(t, heads, d), kc, vc, starts, bt, blocks, t


def _errors_against_float64_sdpa(out, q, kc, vc, reqs, starts, bt, blocks):
    """Per (cached, new) request of a paged prefill kernel's output `out`: (cached, new, its
    error against masked SDPA in float64, SDPA's own error in q's dtype, the reference's
    largest magnitude). Also checks that rows outside the requests kept their 7.0 fill."""
    kv_heads, d = kc.shape[2], kc.shape[3]
    touched = torch.zeros(q.shape[0], dtype=torch.bool)
    res = []
    for r, ((c, n), s) in enumerate(zip(reqs, starts)):
        touched[s : s + n] = True
        keys = [x[bt[r, : blocks[r]]].reshape(-1, kv_heads, d)[: c + n].transpose(0, 1)[None] for x in (kc, vc)]
        mask = torch.arange(c + n)[None, :] <= torch.arange(c, c + n)[:, None]
        qs = q[s : s + n].transpose(0, 1)[None]

        def sdpa(*xs, mask=mask):
            return torch.nn.functional.scaled_dot_product_attention(
                *xs, attn_mask=mask, scale=d**-0.5, enable_gqa=True
            )[0].transpose(0, 1)

        ref = sdpa(qs.double(), *(x.double() for x in keys))
        bound = (sdpa(qs, *keys).double() - ref).abs().max().item()
        res.append((c, n, (out[s : s + n].double() - ref).abs().max().item(), bound, ref.abs().max().item()))
    assert torch.equal(out[~touched], torch.full_like(out[~touched], 7.0))
    return res


@pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 128), (8, 1, 64)])
@pytest.mark.parametrize("bs", [16, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_paged_kernel_matches_float64_sdpa(dtype, heads, kv_heads, d, bs, threads):
    """Prefill chunks through csrc/prefill_paged.h: fresh prompts and chunks after cached
    context (query and key counts around the kernel's 16-row and 16-key blocks), K/V read
    from a paged cache with scattered blocks of any size: each within the error of SDPA in
    the same dtype, against SDPA in float64; rows outside the listed requests untouched."""
    g = torch.Generator().manual_seed(heads * d + bs + threads)
    reqs = [(0, 1), (0, 15), (0, 16), (0, 17), (0, 70), (5, 40), (37, 1), (31, 2), (100, 33), (16, 16)]
    q, kc, vc, starts, bt, blocks, t = _paged_case(reqs, heads, kv_heads, d, bs, dtype, g)
    out = torch.full((t, heads, d), 7.0, dtype=dtype)
    args = [torch.tensor(x) for x in (starts, [n for _, n in reqs], [c + n for c, n in reqs])]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels.prefill_paged(q, kc, vc, out, *args, bt, d**-0.5)
    finally:
        torch.set_num_threads(prev)
    for c, n, err, bound, _ in _errors_against_float64_sdpa(out, q, kc, vc, reqs, starts, bt, blocks):
        assert err <= max(bound * 1.5, 2e-6), (c, n, err, bound)


@pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")
def test_prefill_paged_kernel_checks_its_arguments():
    """A block id outside the cache, a request outside q's rows or a block table too short
    for it: a clear error, nothing read out of bounds."""
    g = torch.Generator().manual_seed(1)
    q, kc, vc, starts, bt, blocks, t = _paged_case([(20, 10)], 4, 2, 64, 16, torch.float32, g)
    out = torch.empty_like(q)
    args = [torch.tensor(x) for x in (starts, [10], [30])]
    kernels.prefill_paged(q, kc, vc, out, *args, bt, 0.125)
    with pytest.raises(RuntimeError, match="block id outside"):
        kernels.prefill_paged(q, kc, vc, out, *args, bt + kc.shape[0], 0.125)
    with pytest.raises(RuntimeError, match="outside q's rows"):
        kernels.prefill_paged(q, kc, vc, out, torch.tensor([t - 5]), *args[1:], bt, 0.125)
    with pytest.raises(RuntimeError, match="block table shorter"):
        kernels.prefill_paged(q, kc, vc, out, *args[:2], torch.tensor([60]), bt, 0.125)


@pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")
def test_prefill_chunks_take_the_kernel_beside_decodes_and_short_queries():
    """A step of decodes, a short query, chunks over a cached prefix and fresh prompts: every
    prefill chunk, fresh or not, goes through one prefill_paged call (float32: the bf16 kernels
    take bf16 only), the rest as before, and the whole equals the SDPA reference backend."""
    reqs = [(40, 1), (3, 1), (37, 5), (0, 30), (20, 33), (0, 17), (0, 64)]
    ref, out, meta2, calls = _sdpa_vs_cpp_step(reqs, 8, 2, 64, seed=5)
    assert calls == {"prefill_paged": 1}
    starts, qlens, seq_lens, _ = meta2.backend_cache["chunks"]
    assert qlens.tolist() == [30, 33, 17, 64] and seq_lens.tolist() == [30, 53, 17, 64]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def _amx() -> bool:
    from pagedserve.executor.quant import kernels as quant_kernels

    return quant_kernels.amx_in_use()


_NO_AMX = "needs the C++ kernels built with AMX-BF16 (a CPU with the tiles) and the tiles granted"


def _amx_kernel() -> bool:
    return kernels is not None and hasattr(kernels, "prefill_amx") and _amx()


_NO_BF16 = "needs the C++ kernels built for a CPU with AVX512-BF16 (vdpbf16ps)"


def _bf16_kernel() -> bool:
    return kernels is not None and hasattr(kernels, "prefill_bf16")


_BF16_KERNELS = [
    pytest.param("prefill_bf16", marks=pytest.mark.skipif(not _bf16_kernel(), reason=_NO_BF16)),
    pytest.param("prefill_amx", marks=pytest.mark.skipif(not _amx_kernel(), reason=_NO_AMX)),
]


@pytest.mark.parametrize("kernel", _BF16_KERNELS)
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 128), (8, 2, 32), (6, 1, 256), (4, 2, 96)])
@pytest.mark.parametrize("bs", [16, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_prefill_kernels_match_float64_sdpa(kernel, heads, kv_heads, d, bs, threads):
    """Prefill chunks in bf16 on vdpbf16ps (csrc/prefill_bf16.h) and on the AMX tiles
    (csrc/prefill_amx.h): fresh prompts and chunks after cached context (query and key counts
    around the kernels' 4-, 8-, 16- and 32-row and 32-key blocks), q as a strided view of fused
    QKV rows, K/V read from a paged cache with scattered blocks of any size: against SDPA in
    float64, each within 1.5x the error of SDPA in bf16 or 2^-8 of its largest output (P is
    rounded to bf16 for the products, as in torch's flash attention); rows outside the listed
    requests untouched."""
    g = torch.Generator().manual_seed(heads * d + bs + threads)
    reqs = [(0, 1), (0, 15), (0, 16), (0, 17), (0, 33), (5, 40), (37, 1), (31, 2), (100, 70), (0, 150), (0, 9), (3, 7)]
    q, kc, vc, starts, bt, blocks, t = _paged_case(reqs, heads, kv_heads, d, bs, torch.bfloat16, g)
    out = torch.full((t, heads, d), 7.0, dtype=torch.bfloat16)
    args = [torch.tensor(x) for x in (starts, [n for _, n in reqs], [c + n for c, n in reqs])]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        getattr(kernels, kernel)(q, kc, vc, out, *args, bt, d**-0.5)
    finally:
        torch.set_num_threads(prev)
    for c, n, err, bound, ref_max in _errors_against_float64_sdpa(out, q, kc, vc, reqs, starts, bt, blocks):
        assert err <= max(bound * 1.5, ref_max * 2**-8), (c, n, err, bound)


@pytest.mark.skipif(not _bf16_kernel(), reason=_NO_BF16)
def test_bf16_prefill_kernel_checks_its_arguments():
    """Wrong dtypes, head sizes or block tables are errors naming the kernel, not bad reads."""
    g = torch.Generator().manual_seed(2)
    q, kc, vc, starts, bt, blocks, t = _paged_case([(3, 5)], 4, 2, 64, 16, torch.bfloat16, g)
    out = torch.empty(t, 4, 64, dtype=torch.bfloat16)
    args = [torch.tensor(x) for x in (starts, [5], [8])]
    kernels.prefill_bf16(q, kc, vc, out, *args, bt, 0.125)
    with pytest.raises(RuntimeError, match="prefill_bf16: bf16"):
        kernels.prefill_bf16(q.float(), kc.float(), vc.float(), out.float(), *args, bt, 0.125)
    with pytest.raises(RuntimeError, match="head_dim a multiple of 32"):
        q2, kc2, vc2, *_ = _paged_case([(3, 5)], 4, 2, 40, 16, torch.bfloat16, g)
        kernels.prefill_bf16(q2, kc2, vc2, torch.empty(t, 4, 40, dtype=torch.bfloat16), *args, bt, 0.125)
    with pytest.raises(RuntimeError, match="block id outside the cache"):
        kernels.prefill_bf16(q, kc, vc, out, *args, bt + kc.shape[0], 0.125)


class _Counting:
    """A kernel module that counts its prefill kernels' calls, by name."""

    def __init__(self, mod):
        self.mod, self.calls = mod, collections.Counter()

    def __getattr__(self, name):
        fn = getattr(self.mod, name)
        if not name.startswith("prefill_"):
            return fn

        def counted(*a):
            self.calls[name] += 1
            return fn(*a)

        return counted


def _bf16_step(isa=None):
    """A bf16 step (decodes, short queries, chunks over a cached prefix, fresh prompts) through
    the C++ backend on kernel path `isa` (None: the one in use): its prefill kernels' calls by
    name and the chunks' query counts; and its output equals the reference backend's within
    bf16's rounding."""
    from pagedserve.executor.quant import kernels as quant_kernels

    reqs = [(40, 1), (37, 5), (0, 30), (20, 33), (0, 17), (0, 64)]
    g = torch.Generator().manual_seed(3)
    meta = _mixed_meta(reqs, 16, 96, g)
    t, bf = meta.num_tokens, torch.bfloat16
    q = torch.randn(t, 8, 64, generator=g).to(bf)
    k, v = torch.randn(t, 2, 64, generator=g).to(bf), torch.randn(t, 2, 64, generator=g).to(bf)
    kc0, vc0 = torch.randn(96, 16, 2, 64, generator=g).to(bf), torch.randn(96, 16, 2, 64, generator=g).to(bf)
    prev = quant_kernels.set_isa(isa) if isa else None
    try:
        backend = TorchAttentionBackend(use_cpp_decode=True)
        backend._cpp = counting = _Counting(backend._cpp)
        out = backend.forward(q, k, v, kc0.clone(), vc0.clone(), meta, 0.125)
    finally:
        if prev:
            quant_kernels.set_isa(prev)
    ref_meta = _mixed_meta(reqs, 16, 96, torch.Generator().manual_seed(3))
    ref = TorchAttentionBackend().forward(q, k, v, kc0.clone(), vc0.clone(), ref_meta, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    return dict(counting.calls), meta.backend_cache["chunks"][1].tolist()


@pytest.mark.skipif(not _amx_kernel(), reason=_NO_AMX)
def test_bf16_prefills_go_to_the_amx_kernel():
    """On an AMX CPU a bf16 step's prefill chunks (fresh, and over a cached prefix) are
    attended in one call of the tile kernel, decodes and short queries as before; the step
    equals the reference backend within bf16's rounding. A kernel path below AMX keeps the
    other kernels."""
    assert _bf16_step() == ({"prefill_amx": 1}, [30, 33, 17, 64])
    assert _bf16_step("avx512_bf16") == ({"prefill_bf16": 1}, [30, 33, 17, 64])


@pytest.mark.skipif(not _bf16_kernel(), reason=_NO_BF16)
def test_bf16_prefills_go_to_the_vdpbf16ps_kernel():
    """On the avx512_bf16 path (an AVX512-BF16 CPU without AMX, or one with AMX forced below
    it) a bf16 step's prefill chunks are attended in one call of the vdpbf16ps kernel; on a
    path below (PAGEDSERVE_CPU_ISA=avx512) in one call of the float32-arithmetic kernel; both
    equal the reference backend within bf16's rounding."""
    assert _bf16_step("avx512_bf16") == ({"prefill_bf16": 1}, [30, 33, 17, 64])
    assert _bf16_step("avx512") == ({"prefill_paged": 1}, [30, 33, 17, 64])


class _WithoutAmx:
    """A kernel module built without the tile kernel (a compiler without AMX-BF16)."""

    def __init__(self, mod):
        self.mod = mod

    def __getattr__(self, name):
        if name == "prefill_amx":
            raise AttributeError(name)
        return getattr(self.mod, name)


@pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")
def test_amx_route_conditions_and_the_sdpa_fallback(monkeypatch):
    """Any CPU: the bf16 kernels' preconditions (bf16 queries and contiguous cache, head_dim a
    multiple of 32 up to 256, contiguous heads) and the module's answer (the kernel built, an
    AMX path);
    an AMX CPU whose module lacks the kernel sends bf16 fresh prompts to SDPA, one call each,
    float32 ones to the C++ paged kernel, both equal to the reference backend."""
    from pagedserve.executor.attention import torch_backend
    from pagedserve.executor.quant import kernels as quant_kernels

    bf = torch.bfloat16
    q, kc = torch.zeros(4, 8, 64, dtype=bf), torch.zeros(3, 16, 2, 64, dtype=bf)
    assert cpu_kernels.bf16_prefill_fits(q, kc)
    assert not cpu_kernels.bf16_prefill_fits(q.float(), kc.float())
    assert not cpu_kernels.bf16_prefill_fits(q, kc.half())
    assert not cpu_kernels.bf16_prefill_fits(torch.zeros(4, 8, 40, dtype=bf), torch.zeros(3, 16, 2, 40, dtype=bf))
    assert not cpu_kernels.bf16_prefill_fits(torch.zeros(4, 64, 8, dtype=bf).transpose(1, 2), kc)
    assert not cpu_kernels.bf16_prefill_fits(q, torch.zeros(3, 2, 16, 64, dtype=bf).transpose(1, 2))
    assert not cpu_kernels.amx_prefill_usable(_WithoutAmx(kernels))
    monkeypatch.setattr(quant_kernels, "amx_in_use", lambda: False)
    assert not cpu_kernels.amx_prefill_usable(kernels)
    monkeypatch.setattr(torch_backend, "_amx_in_use", lambda: True)
    calls = []
    real = torch_backend.F.scaled_dot_product_attention
    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    reqs = [(40, 1), (0, 30), (0, 17), (0, 64)]
    # (q's dtype, the cache's, SDPA calls or None): a float8 cache attends to K/V as stored (the
    # reference's per-request path), never SDPA on the unrounded K/V of its fresh prompts
    for dtype, kv_dtype, sdpa_calls, tol in (
        (bf, bf, 3, 2e-2),
        (torch.float32, torch.float32, 0, 2e-5),
        (bf, torch.float8_e4m3fn, None, 2e-2),
    ):
        g = torch.Generator().manual_seed(4)
        meta = _mixed_meta(reqs, 16, 96, g)
        t = meta.num_tokens
        q = torch.randn(t, 8, 64, generator=g).to(dtype)
        k, v = torch.randn(t, 2, 64, generator=g).to(dtype), torch.randn(t, 2, 64, generator=g).to(dtype)
        kc0, vc0 = (torch.randn(96, 16, 2, 64, generator=g).to(kv_dtype) for _ in range(2))
        backend = TorchAttentionBackend(use_cpp_decode=True)
        backend._cpp = _WithoutAmx(backend._cpp)
        calls.clear()
        out = backend.forward(q, k, v, kc0.clone(), vc0.clone(), meta, 0.125)
        assert sdpa_calls is None or len(calls) == sdpa_calls
        assert meta.backend_cache["amx_ok"] is False
        ref_meta = _mixed_meta(reqs, 16, 96, torch.Generator().manual_seed(4))
        ref = TorchAttentionBackend().forward(q, k, v, kc0.clone(), vc0.clone(), ref_meta, 0.125)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("L", [300, 1100])  # 1,100: past the bf16 kernel's PART, in parts
def test_bf16_decode_row_same_bits_alone_or_among_others(kv_dtype, L):
    """bfloat16 queries: a row's attention is the same bits whether it is a batch-1 step (a
    single row, which float32 splits over the threads) or one of many rows (speculative
    verification, batches): greedy speculation relies on it."""
    g = torch.Generator().manual_seed(11)
    h, kvh, d, bs = 9, 3, 64, 16
    nb = 5 * (L // bs + 1)
    kc, vc = (torch.randn(nb, bs, kvh, d, generator=g).to(kv_dtype) for _ in range(2))
    bt = torch.randperm(nb, generator=g).view(5, -1)
    lens = torch.tensor([L, L - 1, L - 2, L - 40, L - 3])
    q = torch.randn(5, h, d, generator=g).bfloat16()
    many = kernels.paged_decode(q, kc, vc, bt, lens, 0.125, 0, 0.0)
    for i in range(5):
        one = kernels.paged_decode(q[i : i + 1], kc, vc, bt[i : i + 1], lens[i : i + 1], 0.125, 0, 0.0)
        assert torch.equal(one[0], many[i]), i


def _bf16_decode_kernel() -> bool:
    return kernels is not None and hasattr(kernels, "set_decode_bf16")


@contextlib.contextmanager
def _isa(name):
    """The kernels on path `name` (quant.kernels.set_isa; the attention module follows it),
    whatever PAGEDSERVE_CPU_ISA chose, then back."""
    from pagedserve.executor.quant import kernels as quant_kernels

    prev = quant_kernels.set_isa(name)
    try:
        yield
    finally:
        quant_kernels.set_isa(prev)


@pytest.mark.skipif(not _bf16_decode_kernel(), reason=_NO_BF16)
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 128), (8, 2, 64), (10, 2, 192), (6, 1, 256)])
@pytest.mark.parametrize("bs", [16, 5])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[1, 2, 7, 8, 9, 31, 32, 33, 64, 65, 300], [65, 300]])
def test_bf16_decode_kernel_matches_float64_sdpa(heads, kv_heads, d, bs, threads, lens):
    """bf16 decode rows over a bf16 cache on vdpbf16ps (csrc/decode_bf16.h): context lengths
    around its 8-token score groups, 32-token chunks and odd token pairs, query heads per KV
    head from 1 to 5 (groups of 3), q as strided fused-QKV rows, one job per sequence or (few
    rows) per (sequence, KV head): against SDPA in float64, each row within 1.5x the error of
    SDPA in bf16 or 2^-8 of its largest output (P is rounded to bf16, as in the prefill kernels).
    The float kernel (the switch off) gives other bits: the rows did take the bf16 kernel."""
    g = torch.Generator().manual_seed(heads * d + bs + threads + len(lens))
    reqs = [(n - 1, 1) for n in lens]  # a decode row: its last position's query over the rest
    q, kc, vc, starts, bt, blocks, t = _paged_case(reqs, heads, kv_heads, d, bs, torch.bfloat16, g)
    qkv = torch.randn(len(reqs), (heads + 2 * kv_heads) * d, generator=g).bfloat16()
    qkv[:, : heads * d] = q[starts].reshape(len(reqs), -1)
    rows = qkv[:, : heads * d].view(-1, heads, d)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with _isa("avx512_bf16"):
            dec = kernels.paged_decode(rows, kc, vc, bt, torch.tensor(lens), d**-0.5)
            kernels.set_decode_bf16(False)
            widened = kernels.paged_decode(rows, kc, vc, bt, torch.tensor(lens), d**-0.5)
    finally:
        torch.set_num_threads(prev)
    assert not torch.equal(dec, widened)
    out = torch.full((t, heads, d), 7.0, dtype=torch.bfloat16)
    out[starts] = dec
    for c, n, err, bound, ref_max in _errors_against_float64_sdpa(out, q, kc, vc, reqs, starts, bt, blocks):
        assert err <= max(bound * 1.5, ref_max * 2**-8), (c, n, err, bound)


@pytest.mark.skipif(not _bf16_decode_kernel(), reason=_NO_BF16)
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 128), (6, 1, 256)])
@pytest.mark.parametrize("bs", [16, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_decode_long_contexts_in_parts_match_float64_sdpa(heads, kv_heads, d, bs, threads):
    """Contexts past csrc/decode_bf16.h's PART (512) are attended in near-equal parts whose
    softmax sums are merged (513: 2 parts, 1,100: 3, 2,000: 4), beside whole short ones: each
    row within the bound of test_bf16_decode_kernel_matches_float64_sdpa."""
    lens = [513, 40, 1100, 700, 2000]
    g = torch.Generator().manual_seed(heads * d + bs + threads)
    reqs = [(n - 1, 1) for n in lens]
    q, kc, vc, starts, bt, blocks, t = _paged_case(reqs, heads, kv_heads, d, bs, torch.bfloat16, g)
    rows = q[starts]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with _isa("avx512_bf16"):
            dec = kernels.paged_decode(rows, kc, vc, bt, torch.tensor(lens), d**-0.5)
    finally:
        torch.set_num_threads(prev)
    out = torch.full((t, heads, d), 7.0, dtype=torch.bfloat16)
    out[starts] = dec
    for c, n, err, bound, ref_max in _errors_against_float64_sdpa(out, q, kc, vc, reqs, starts, bt, blocks):
        assert err <= max(bound * 1.5, ref_max * 2**-8), (c, n, err, bound)


@pytest.mark.skipif(not _bf16_decode_kernel(), reason=_NO_BF16)
@pytest.mark.parametrize("window", [600, 1300])  # 600: the window's 600 positions in 2 parts
def test_bf16_decode_parts_of_a_sliding_window(window):
    """A window's parts start at the window's first position: blocks wholly before it (NaN
    here, as a block handed back may hold anything) are never read; against the float64
    reference with the window's mask."""
    g = torch.Generator().manual_seed(window)
    h, kvh, d, bs, nb = 9, 3, 64, 16, 200
    lens = [1500, 900, 1501]
    kc = torch.randn(nb, bs, kvh, d, generator=g).bfloat16()
    vc = torch.randn(nb, bs, kvh, d, generator=g).bfloat16()
    kc[1], vc[1] = float("nan"), float("nan")
    bt = torch.stack([torch.randperm(nb - 2, generator=g)[: -(-max(lens) // bs)] + 2 for _ in lens])
    for i, L in enumerate(lens):
        bt[i, : max(0, L - window) // bs] = 1
    q = torch.randn(len(lens), h, d, generator=g).bfloat16()
    lens_t = torch.tensor(lens)
    meta = AttentionMetadata(len(lens), len(lens), None, lens_t, bt.masked_fill(bt == 1, 2), None, 1, max(lens),
                             max(lens), None, None)
    ref = TorchAttentionBackend._decode(q.double(), kc.double(), vc.double(), meta, d**-0.5, window, None)
    with _isa("avx512_bf16"):
        out = kernels.paged_decode(q, kc, vc, bt, lens_t, d**-0.5, window, 0.0)
    assert torch.isfinite(out.float()).all()
    assert (out.double() - ref).abs().max().item() < 2e-2


@pytest.mark.skipif(not _bf16_decode_kernel(), reason=_NO_BF16)
def test_bf16_decode_kernel_follows_the_isa_and_its_switch():
    """The vdpbf16ps decode kernel runs only while the kernels run on a path with native bf16:
    with the path set below it (set_isa, as PAGEDSERVE_CPU_ISA=avx512 at load) or the switch
    off, bf16 rows take the float kernel (queries widened, output rounded once), which gives
    exactly what float32 queries over the same cache give, rounded; the bf16 kernel's rounding
    of P differs from that in some bits. Setting the path back turns it on again."""
    g = torch.Generator().manual_seed(21)
    kc, vc = (torch.randn(40, 16, 3, 64, generator=g).bfloat16() for _ in range(2))
    bt = torch.randperm(40, generator=g).view(5, 8)
    lens = torch.tensor([120, 77, 128, 3, 50])
    q = torch.randn(5, 9, 64, generator=g).bfloat16()
    widened = kernels.paged_decode(q.float(), kc, vc, bt, lens, 0.125).bfloat16()
    with _isa("avx512_bf16"):
        assert not torch.equal(kernels.paged_decode(q, kc, vc, bt, lens, 0.125), widened)
        with _isa("avx512"):
            assert torch.equal(kernels.paged_decode(q, kc, vc, bt, lens, 0.125), widened)
        assert not torch.equal(kernels.paged_decode(q, kc, vc, bt, lens, 0.125), widened)
        assert kernels.set_decode_bf16(False) is True
        try:
            assert torch.equal(kernels.paged_decode(q, kc, vc, bt, lens, 0.125), widened)
        finally:
            kernels.set_decode_bf16(True)
