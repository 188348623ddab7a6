"""The Triton MoE products (ops/triton_moe.py) under TRITON_INTERPRET=1 on the CPU and
compiled on a GPU (benchmarks/gpu_check.sh), against models/moe.py's CPU path: the layout
`align` makes, then the experts' outputs on odd shapes (K and N not multiples of the tiles,
one token, more tokens than a block, experts no token chose)."""

import pytest
import torch

from tests.executor import triton_setup  # first: TRITON_INTERPRET before triton decorates kernels

DEV = triton_setup.DEV

from pagedserve.executor.models.llama import act_and_mul  # noqa: E402
from pagedserve.executor.models.moe import FusedExperts  # noqa: E402
from pagedserve.executor.ops import triton_moe  # noqa: E402


@pytest.mark.parametrize("t,k,e,bm", [(1, 2, 8, 16), (7, 2, 5, 16), (40, 3, 4, 16), (300, 2, 8, 64), (3, 1, 1, 16)])
def test_align_lays_pairs_out_by_expert_in_padded_blocks(t, k, e, bm):
    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEV)
    pairs, block_expert, used = triton_moe.align(ids, e, bm)
    n, pairs, block_expert, used = t * k, pairs.cpu(), block_expert.cpu(), int(used)
    assert pairs.numel() % bm == 0 and pairs.numel() == -(-(n + min(e, n) * (bm - 1)) // bm) * bm
    assert used % bm == 0 and used <= pairs.numel() and (pairs[used:] == n).all()
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n))  # every pair once
    flat = ids.reshape(-1).cpu()
    for b in range(used // bm):  # each block: one expert's pairs (then padding), in pair order
        blk = pairs[b * bm : (b + 1) * bm]
        mine = blk[blk < n]
        assert (flat[mine] == block_expert[b]).all() and mine.tolist() == sorted(mine.tolist())
        assert (blk[: len(mine)] < n).all()  # padding only at a run's end
    assert block_expert[: used // bm].tolist() == sorted(block_expert[: used // bm].tolist())


def reference(x, w13, w2, ids):
    """models/moe.py's CPU path (sort by expert, each expert's rows), before the weighted sum."""
    fe = FusedExperts(w13.shape[0], w13.shape[2], w2.shape[2])
    fe.w13.data, fe.w2.data = w13.cpu(), w2.cpu()
    ones = torch.zeros(ids.shape, dtype=torch.float32)
    out = []
    for j in range(ids.shape[1]):  # each choice alone with weight 1: the expert outputs themselves
        w = ones.clone()
        w[:, j] = 1.0
        out.append(fe.forward(x.cpu(), w, ids.cpu()))
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("t,k,e,h,i", [(1, 2, 8, 40, 24), (3, 2, 5, 96, 48), (17, 2, 4, 64, 80), (64, 4, 6, 40, 20)])
def test_experts_match_the_cpu_path(t, k, e, h, i):
    g = torch.Generator().manual_seed(t * 31 + e)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if t > 3:
        ids[ids == e - 1] = 0  # expert e-1 idle (and a topk never repeats an expert in a row)
        ids[:, 1:][ids[:, 1:] == 0] = 1 if e > 2 else 0
    got = triton_moe.experts(x.to(DEV), w13.to(DEV), w2.to(DEV), ids.to(DEV), lambda gu: act_and_mul(gu))
    torch.testing.assert_close(got.cpu(), reference(x, w13, w2, ids), rtol=1e-5, atol=1e-5)


def test_no_rows_give_no_outputs():
    w13, w2 = torch.randn(4, 32, 16, device=DEV), torch.randn(4, 16, 16, device=DEV)
    ids = torch.empty((0, 2), dtype=torch.long, device=DEV)
    assert triton_moe.experts(torch.empty((0, 16), device=DEV), w13, w2, ids, act_and_mul).shape == (0, 2, 16)


@pytest.mark.skipif(triton_setup.INTERPRETED, reason="the interpreter's bf16 tl.dot is wrong (bf16 checked on a GPU)")
def test_experts_in_bfloat16_round_like_f_linear():
    g = torch.Generator().manual_seed(5)
    t, k, e, h, i = 33, 2, 8, 256, 128
    x = torch.randn(t, h, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    got = triton_moe.experts(x.to(DEV), w13.to(DEV), w2.to(DEV), ids.to(DEV), lambda gu: act_and_mul(gu)).cpu()
    ref = torch.stack([torch.stack([F_mlp(x[r], w13[ids[r, j]], w2[ids[r, j]]) for j in range(k)]) for r in range(t)])
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


def F_mlp(x, w13, w2):
    import torch.nn.functional as F

    h = act_and_mul(F.linear(x[None].float(), w13.float()).bfloat16())  # each product rounded once
    return F.linear(h.float(), w2.float()).bfloat16()[0]
