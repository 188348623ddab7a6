"""Triton kernels under TRITON_INTERPRET=1 (on the CPU) against the PyTorch reference backend."""

import pytest
import torch

from tests.executor import triton_setup  # first: TRITON_INTERPRET before triton decorates kernels

DEV = triton_setup.DEV

from pagedserve.executor.attention.backend import AttentionMetadata  # noqa: E402
from pagedserve.executor.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pagedserve.executor.attention.triton_backend import TritonAttentionBackend  # noqa: E402


def make_batch(q_lens, ctx_lens, bs, heads, kv_heads, d, dtype, seed=0):
    """A flattened step: requests with q_len 1 first (decodes), then prefill chunks."""
    g = torch.Generator().manual_seed(seed)
    n = len(q_lens)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    nblk = max(-(-s // bs) for s in seq_lens)
    num_blocks = n * nblk + 1
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # scattered physical blocks
    bt = perm[: n * nblk].view(n, nblk)
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    T = qsl[-1]
    pos = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx_lens, q_lens)])
    req = torch.repeat_interleave(torch.arange(n), torch.tensor(q_lens))
    slots = bt[req, pos // bs] * bs + pos % bs
    kc = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    q = torch.randn(T, heads, d, generator=g).to(dtype)
    k = torch.randn(T, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(T, kv_heads, d, generator=g).to(dtype)
    nd = sum(1 for ql in q_lens if ql == 1)
    meta = AttentionMetadata(
        num_reqs=n,
        num_decodes=nd,
        query_start_loc=torch.tensor(qsl),
        seq_lens=torch.tensor(seq_lens),
        block_tables=bt,
        slot_mapping=slots,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        max_decode_seq_len=max(seq_lens[:nd]) if nd else 0,
        query_start_loc_list=qsl,
        seq_lens_list=seq_lens,
    )
    return q, k, v, kc, vc, meta


def to_dev(*ts):
    return [t.to(DEV) if isinstance(t, torch.Tensor) else t for t in ts]


def run_both(q, k, v, kc, vc, meta, d, **extra):
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_kc, ref_vc, meta, d**-0.5, **extra)
    dm = AttentionMetadata(
        **{
            f: (getattr(meta, f).to(DEV) if isinstance(getattr(meta, f), torch.Tensor) else getattr(meta, f))
            for f in meta.__dataclass_fields__
        }
    )
    qd, kd, vd, kcd, vcd = to_dev(q, k, v, kc.clone(), vc.clone())
    out = TritonAttentionBackend().forward(qd, kd, vd, kcd, vcd, dm, d**-0.5, **extra)
    return ref, out.cpu(), (ref_kc, kcd.cpu()), (ref_vc, vcd.cpu())


@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("d", [64, 128])
def test_mixed_batch_matches_reference(bs, heads, kv_heads, d):
    # decodes with contexts across block boundaries (and past one 256-token partition),
    # a fresh prefill, and a chunk over a cached prefix
    q_lens = [1, 1, 1, 1, 19, 7]
    ctx = [0, bs - 1, bs + 2, 300, 0, 2 * bs + 3]
    q, k, v, kc, vc, meta = make_batch(
        q_lens, ctx, bs, heads, kv_heads, d, torch.float32, seed=bs + heads + d
    )
    ref, out, (rk, ok), (rv, ov) = run_both(q, k, v, kc, vc, meta, d)
    assert torch.equal(rk, ok) and torch.equal(rv, ov)  # the write kernel
    assert (ref - out).abs().max().item() < 1e-4


@pytest.mark.parametrize("window", [5, 40, 300])  # inside a tile, several blocks, past a partition
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_sliding_window_and_softcap_match_reference(window, softcap):
    """Decodes (one past a 256-token partition, so whole partitions fall before the window),
    a fresh prefill longer than the window and a chunk over a cached prefix, with a window
    and a soft cap, against the PyTorch backend's masks."""
    q_lens, ctx = [1, 1, 1, 45, 20], [3, 30, 600, 0, 70]
    q, k, v, kc, vc, meta = make_batch(q_lens, ctx, 16, 4, 2, 32, torch.float32, seed=window)
    extra = {"window": window, "softcap": softcap}
    ref, out, _, _ = run_both(q, k, v, kc, vc, meta, 32, **extra)
    assert torch.isfinite(out).all()
    assert (ref - out).abs().max().item() < 1e-4
    full, _, _, _ = run_both(q, k, v, kc, vc, meta, 32, softcap=softcap)
    assert (full - ref).abs().max().item() > 1e-3  # the window mattered


@pytest.mark.parametrize("d", [8, 40, 80, 96, 256])
def test_head_dims_that_are_not_a_power_of_two_or_are_small(d):
    """The compiled kernels tile the head dimension in a power of two of at least 16 lanes
    (tl.arange, tl.dot) and mask the rest: Qwen3's tiny checkpoint has 40, Phi-2 80; 256
    (Gemma) takes 32-token decode tiles in float32 (shared memory)."""
    q, k, v, kc, vc, meta = make_batch([1, 1, 13, 6], [5, 290, 0, 21], 16, 4, 2, d, torch.float32, seed=d)
    ref, out, (rk, ok), _ = run_both(q, k, v, kc, vc, meta, d)
    assert torch.equal(rk, ok)
    assert (ref - out).abs().max().item() < 1e-4


def test_decode_only_long_context_split_k():
    q, k, v, kc, vc, meta = make_batch([1, 1, 1], [700, 5, 513], 16, 8, 2, 64, torch.float32, seed=3)
    ref, out, _, _ = run_both(q, k, v, kc, vc, meta, 64)
    assert (ref - out).abs().max().item() < 1e-4


# Triton 3.9's interpreter computes bfloat16 tl.dot wrongly (float32 is exact), and both the
# decode and the prefill kernels take their products with tl.dot: their bf16 paths are checked
# on a GPU (benchmarks/gpu_check.sh), float32 here.
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="bf16 tl.dot needs a GPU (the interpreter gets it wrong)"
)
def test_bfloat16_decode_gpu():
    q, k, v, kc, vc, meta = make_batch([1, 1, 1], [40, 3, 300], 16, 4, 2, 64, torch.bfloat16, seed=4)
    ref, out, _, _ = run_both(q, k, v, kc, vc, meta, 64)
    assert (ref.float() - out.float()).abs().max().item() < 3e-2


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="bf16 tl.dot needs a GPU (the interpreter gets it wrong)"
)
def test_bfloat16_prefill_gpu():
    q, k, v, kc, vc, meta = make_batch([1, 1, 12, 40], [40, 3, 20, 0], 16, 8, 2, 128, torch.bfloat16, seed=5)
    ref, out, _, _ = run_both(q, k, v, kc, vc, meta, 128)
    assert (ref.float() - out.float()).abs().max().item() < 3e-2


def test_decode_tiles_must_divide_the_partition():
    """A key tile straddling partitions could lie wholly before a sliding window: NaN."""
    for bad in (8, 48, 512):
        with pytest.raises(ValueError, match="decode_block_n"):
            TritonAttentionBackend(decode_block_n=bad)
    q, k, v, kc, vc, meta = make_batch([1, 1], [300, 40], 16, 4, 2, 32, torch.float32, seed=11)
    for bn in (16, 128, 256):
        qd, kd, vd, kcd, vcd = to_dev(q, k, v, kc.clone(), vc.clone())
        dm = AttentionMetadata(**{f: to_dev(getattr(meta, f))[0] if torch.is_tensor(getattr(meta, f)) else getattr(meta, f)
                                  for f in meta.__dataclass_fields__})
        out = TritonAttentionBackend(decode_block_n=bn).forward(qd, kd, vd, kcd, vcd, dm, 32**-0.5, window=100)
        ref = TorchAttentionBackend().forward(q, k, v, kc.clone(), vc.clone(), meta, 32**-0.5, window=100)
        assert torch.isfinite(out).all() and (out.cpu() - ref).abs().max().item() < 1e-4


def test_a_decode_tile_past_the_shared_memory_is_halved_and_remembered(monkeypatch):
    """A GPU whose shared memory a tile overflows (Triton's OutOfResources at launch, as on an
    sm86 card for float32 with a large query group): the tile halves until it fits, the
    result is the same, and the next call starts from the tile that fit."""
    from triton.runtime.errors import OutOfResources

    from pagedserve.executor.attention import triton_backend as tb

    tried = []

    class TooBig:  # stands in for the kernel: refuses tiles over 16 tokens
        def __getitem__(self, grid):
            def launch(*args, BLOCK_N, **kw):
                tried.append(BLOCK_N)
                if BLOCK_N > 16:
                    raise OutOfResources(BLOCK_N * 1000, 16000, "shared memory")
                return real[grid](*args, BLOCK_N=BLOCK_N, **kw)

            return launch

    q, _, _, kc, vc, meta = make_batch([1, 1], [300, 40], 16, 4, 2, 32, torch.float32, seed=12)
    args = (*to_dev(q, kc, vc, meta.block_tables, meta.seq_lens), 340, 32**-0.5)
    ref = TritonAttentionBackend().decode(*args).cpu()  # the default tile, launched as usual
    real = tb._decode_partial_kernel
    monkeypatch.setattr(tb, "_decode_partial_kernel", TooBig())
    be = TritonAttentionBackend()
    for _ in range(2):
        assert (be.decode(*args).cpu() - ref).abs().max().item() < 1e-5
    assert tried == [64, 32, 16, 16]  # halved twice, then remembered
