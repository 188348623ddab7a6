"""MoE experts on the matrix units (executor/ops/moe_gemm.py): every expert's rows against its
packed weight in one call, equal to per-expert products within bf16 rounding, a row's bits
independent of the other rows, on both kernels (the AMX tile kernel's 16-column blocks where
it runs, PyTorch's brgemm on 64-column blocks), the two giving the same bits; a bf16 MoE
model on it stays close to transformers' bf16. Skipped where PyTorch's brgemm cannot pack
bf16 (no AVX512-BF16 / AMX); the tile kernel's tests where it does not run (no AMX)."""

import pytest
import torch

from pagedserve.executor.models.moe import FusedExperts
from pagedserve.executor.ops import moe_gemm
from tests.checkpoints import load_hf
from tests.executor.test_model_parity import drive, make_runner

pytestmark = pytest.mark.skipif(
    not moe_gemm.available(), reason="PyTorch's brgemm does not pack bf16 on this CPU (needs AVX512-BF16 or AMX)"
)
needs_amx = pytest.mark.skipif(
    not moe_gemm.available() or not moe_gemm.amx(),
    reason="the tile kernel runs where the CPU has AMX-BF16 and Linux grants the tiles",
)
BLOCKS = [moe_gemm.BLOCK_N, pytest.param(moe_gemm.AMX_BLOCK_N, marks=needs_amx)]


def _reference(x, offsets, w):
    """Per expert x_e @ w_e.T in float32, rounded to bf16 once."""
    parts = [x[offsets[e] : offsets[e + 1]].float() @ w[e].float().T for e in range(w.shape[0])]
    return torch.cat(parts).bfloat16()


@pytest.mark.parametrize("counts", [[3, 0, 40, 1, 7], [1, 0, 0, 0, 0], [0, 33, 0, 64, 2], [600, 3], [1100, 17]])
@pytest.mark.parametrize("n,k", [(128, 96), (64, 256)])
@pytest.mark.parametrize("bn", BLOCKS)
def test_grouped_product_equals_per_expert_products(counts, n, k, bn):
    """600 rows: two brgemm chunks; 1,100: two tile-kernel chunks; 17: a 16 + 1 row block."""
    torch.manual_seed(sum(counts) + n)
    w = torch.randn(len(counts), n, k).bfloat16()
    x = torch.randn(sum(counts), k).bfloat16()
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    got = moe_gemm.experts_mm(x, offsets, moe_gemm.pack(w, bn))
    want = _reference(x, offsets, w)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2 * scale)


@needs_amx
@pytest.mark.parametrize("n,k", [(4096, 1024), (96, 64), (320, 2048)])  # 320 x 2048: 256 + 64 columns an item
def test_the_tile_kernel_gives_brgemms_bits(n, k):
    """Both sum each row's products over K in the same order on the same units: bit-equal,
    whatever the rows (1-16-row blocks use two C tiles, 17-32 four)."""
    torch.manual_seed(n + k)
    counts = [1, 0, 7, 33, 16, 17, 100]
    w = (torch.randn(len(counts), n, k) * 0.05).bfloat16()
    x = torch.randn(sum(counts), k).bfloat16()
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    tiles = moe_gemm.experts_mm(x, offsets, moe_gemm.pack(w, moe_gemm.AMX_BLOCK_N))
    if n % moe_gemm.BLOCK_N == 0:
        assert torch.equal(tiles, moe_gemm.experts_mm(x, offsets, moe_gemm.pack(w, moe_gemm.BLOCK_N)))
    else:  # 96 columns: brgemm on 32-column blocks
        assert torch.equal(tiles, moe_gemm.experts_mm(x, offsets, moe_gemm.pack(w, 32)))


@needs_amx
def test_a_path_below_amx_packs_for_brgemm():
    """PAGEDSERVE_CPU_ISA (here set_isa) below AMX: the weights go to brgemm's blocks."""
    from pagedserve.executor.quant import kernels as quant_kernels

    w = torch.randn(2, 128, 64).bfloat16()
    assert moe_gemm.block_n(w) == moe_gemm.AMX_BLOCK_N
    prev = quant_kernels.set_isa("avx512_bf16")
    try:
        assert moe_gemm.block_n(w) == moe_gemm.BLOCK_N
    finally:
        quant_kernels.set_isa(prev)
    assert moe_gemm.block_n(torch.randn(2, 96, 64).bfloat16()) == moe_gemm.AMX_BLOCK_N  # 96: no 64-column blocks
    assert moe_gemm.block_n(torch.randn(2, 80, 64).bfloat16()) is None  # neither kernel's blocks


@pytest.mark.parametrize("bn", BLOCKS)
def test_a_rows_result_does_not_depend_on_the_other_rows(bn):
    torch.manual_seed(0)
    w = torch.randn(2, 128, 96).bfloat16()
    x = torch.randn(45, 96).bfloat16()
    packed = moe_gemm.pack(w, bn)
    together = moe_gemm.experts_mm(x, torch.tensor([0, 40, 45]), packed)  # 32 + 8 rows, then 5
    for r in (0, 31, 33, 39):
        alone = moe_gemm.experts_mm(x[r : r + 1], torch.tensor([0, 1, 1]), packed)
        assert torch.equal(alone[0], together[r])
    assert torch.equal(moe_gemm.experts_mm(x[40:], torch.tensor([0, 0, 5]), packed), together[40:])


@pytest.mark.parametrize("t,k,wdtype", [(300, 2, torch.float32), (7, 4, torch.bfloat16), (1, 1, torch.float32)])
def test_combine_equals_the_unfused_gather_weighting_and_sum(t, k, wdtype):
    """Each token's k expert outputs weighted and summed in one pass: the same bits as the
    gather + `_weighted_sum` it replaces (products rounded to bf16, the sum once)."""
    torch.manual_seed(t * k)
    ys = torch.randn(t * k, 96).bfloat16()
    inv = torch.argsort(torch.randperm(t * k))
    w = torch.rand(t, k).to(wdtype)
    want = FusedExperts._weighted_sum(ys.index_select(0, inv).view(t, k, -1), w, torch.bfloat16)
    assert torch.equal(moe_gemm.combine(ys, inv, w), want)
    with pytest.raises(RuntimeError, match="inv"):
        moe_gemm.combine(ys, torch.full_like(inv, t * k), w)


def test_bad_offsets_are_refused():
    packed = moe_gemm.pack(torch.randn(2, 64, 32).bfloat16())
    x = torch.randn(4, 32).bfloat16()
    with pytest.raises(RuntimeError, match="offsets"):
        moe_gemm.experts_mm(x, torch.tensor([0, 3, 2]), packed)
    with pytest.raises(RuntimeError, match="offsets"):
        moe_gemm.experts_mm(x, torch.tensor([0, 1, 5]), packed)


def test_a_bf16_moe_model_on_the_kernel_stays_close_to_transformers(checkpoint):
    path = checkpoint("mixtral_wide")
    runner = make_runner(path, 16, dtype="bfloat16")
    experts = [m for m in runner.model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(m.b13 is not None and m.w13.numel() == 0 for m in experts)
    hf = load_hf(path, dtype=torch.bfloat16)
    prompts = [[(5 * i + 1) % 1000 for i in range(30)], [7, 8, 9, 10]]
    reqs, logits_at, _ = drive(runner, prompts, 6, 16, budget=16)  # chunked prefill beside decode
    checked = 0
    with torch.inference_mode():
        for rid, req in reqs.items():
            ref = hf(torch.tensor([req.all_token_ids])).logits[0].float()
            for (r, p), ours in logits_at.items():
                if r == rid:
                    assert (ours - ref[p]).abs().max().item() < 0.1  # bf16: the MoE tests' tolerance
                    checked += 1
    assert checked >= 2 * 6
