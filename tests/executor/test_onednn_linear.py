"""oneDNN's pre-packed float linears: the same products as F.linear, weights held once,
and whole models (dense and MoE) still equal to transformers with every layer packed."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor import onednn_linear as od
from pagedserve.executor.models.moe import FusedExperts
from tests.checkpoints import load_hf
from tests.executor.test_model_parity import check_against_hf, drive, make_runner

DTYPES = [d for d in (torch.float32, torch.bfloat16) if od.available(d)]
pytestmark = pytest.mark.skipif(not DTYPES, reason="this PyTorch build's oneDNN packs no float dtype here")


def tol(dtype):
    """float32: the same products summed in another order; bf16: assert_close's own bound."""
    return {"atol": 2e-4, "rtol": 1e-4} if dtype == torch.float32 else {}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(100, 72), (513, 640)])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_product_equals_f_linear(dtype, n, k, rows):
    torch.manual_seed(n + rows)
    w, b = torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype)
    x = torch.randn(2, rows, k, dtype=dtype)  # a leading batch dimension too
    got = od.packed_linear(x, od.pack_weight(w), b)
    assert got.shape == (2, rows, n)
    torch.testing.assert_close(got, F.linear(x, w, b), **tol(dtype))


def test_rows_bucket_bounds_the_shapes_onednn_sees():
    assert [od.rows_bucket(m) for m in range(1, od.EXACT_ROWS + 1)] == list(range(1, od.EXACT_ROWS + 1))
    buckets = [od.rows_bucket(m) for m in range(1, 8193)]
    assert all(m <= b <= m * 1.125 for m, b in zip(range(1, 8193), buckets))
    assert buckets == sorted(buckets) and all(od.rows_bucket(b) == b for b in buckets)
    assert len(set(buckets)) <= 16 + 8 * 9  # exact rows, then 8 a power of two


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [17, 100, 300])
def test_padded_rows_give_the_unpadded_product(dtype, rows):
    torch.manual_seed(rows)
    w, x = torch.randn(576, 576, dtype=dtype), torch.randn(rows, 576, dtype=dtype)
    p = od.pack_weight(w)
    assert od.rows_bucket(rows) > rows
    got = od.packed_linear(x, p, None)
    assert got.shape == (rows, 576) and got.is_contiguous()
    torch.testing.assert_close(got, torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), **tol(dtype))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1024, 512)
        self.head = nn.Linear(512, 1024, bias=False)
        self.head.weight = self.embed.weight
        self.proj = nn.Linear(512, 512)
        self.small = nn.Linear(64, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_linears_holds_each_weight_once(dtype):
    m = Tied().to(dtype)
    x = torch.randn(3, 512, dtype=dtype)
    want_head, want_proj = m.head(x), m.proj(x)
    assert od.pack_linears(m) == 2
    assert type(m.small) is nn.Linear  # under MIN_ELEMENTS: F.linear stays
    assert m.proj.weight.numel() == 0  # its own weight: dropped once packed
    assert m.head.weight is m.embed.weight and m.embed.weight.numel() == 1024 * 512  # shared: kept
    torch.testing.assert_close(m.head(x), want_head, **tol(dtype))
    torch.testing.assert_close(m.proj(x), want_proj, **tol(dtype))
    torch.testing.assert_close(m.proj(x.float()), want_proj.float(), atol=0.05, rtol=0.02)  # other dtype in


class TwoOfAShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(512, 512), nn.Linear(512, 512)  # one shape: one set of primitives
        self.lm_head = nn.Linear(512, 1024, bias=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_warm_up_runs_each_shape_at_each_bucket_once(dtype, monkeypatch):
    """warm_up: every row count rows_bucket can produce up to the budget, once per distinct
    weight shape (not per layer), the LM head only up to its own bound; each shape's largest
    first (ascending outputs never fit the hole the last one left: the heap grew by their sum)."""
    m = TwoOfAShape().to(dtype)
    assert od.pack_linears(m) == 3
    assert od.bucket_sizes(1, 40) == [*range(1, 17), 18, 20, 22, 24, 26, 28, 30, 32, 36, 40]
    calls = []
    real = od.packed_linear
    monkeypatch.setattr(od, "packed_linear", lambda x, p, b: calls.append((x.shape[0], p.shape)) or real(x, p, b))
    assert od.warm_up(m, 40, 6) == len(calls) == 26 + 6
    assert [r for r, s in calls if s[0] == 512] == od.bucket_sizes(1, 40)[::-1]
    assert [r for r, s in calls if s[0] == 1024] == list(range(6, 0, -1))


def test_the_variable_turns_it_off(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_NO_ONEDNN_PACK", "1")
    assert od.pack_linears(Tied()) == 0


@pytest.mark.skipif(torch.float32 not in DTYPES, reason="oneDNN does not pack float32 here")
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_a_model_with_every_layer_packed_matches_transformers(checkpoint, arch, monkeypatch):
    monkeypatch.setattr(od, "MIN_ELEMENTS", 0)  # the tiny checkpoint's layers too
    monkeypatch.setattr("pagedserve.executor.quant.kernels.has_many_rows_kernel", lambda: False)  # no FloatLinear
    path = checkpoint(arch)
    runner = make_runner(path, 16)
    mods = list(runner.model.modules())
    assert sum(type(m) is od.OneDNNLinear for m in mods) >= 2 * len(runner.model.layers)
    assert all(m.p13 is not None for m in mods if isinstance(m, FusedExperts))
    prompts = [[(7 * i + 3) % 1000 for i in range(37)], [5, 6, 7]]
    reqs, logits_at, _ = drive(runner, prompts, 8, 16, budget=16)  # chunked prefill beside decode
    check_against_hf(load_hf(path), reqs, logits_at)


def _amx_tiles() -> bool:
    from pagedserve.executor.ops import moe_gemm

    return torch.bfloat16 in DTYPES and moe_gemm.amx()


class Budget:
    """A CopyBudget's take(): room for `left` bytes."""

    def __init__(self, left):
        self.left, self.kinds = left, []

    def take(self, kind, nbytes, transient=0):
        if nbytes > self.left:
            return False
        self.left -= nbytes
        self.kinds.append(kind)
        return True


@pytest.mark.skipif(not _amx_tiles(), reason="no AMX tile kernel here (AMX-BF16 CPU, Linux granting the tiles, an AMX path)")
def test_amx_tile_copies_serve_products_up_to_their_bound():
    """On AMX a bf16 layer without bias keeps, within the budget, a tile copy: its products
    of 1 .. TILE_MAX_ROWS rows run on the tile kernel (the bf16 product of F.linear up to the
    order of float32 sums), more rows on oneDNN; a layer with a bias, or no room left, none.
    The warm-up builds oneDNN's primitives past the tiles' rows only."""
    torch.manual_seed(0)
    m = Tied().bfloat16()  # head [1024, 512] tied, proj [512, 512] with a bias
    m.proj2 = nn.Linear(512, 512, bias=False).bfloat16()
    w_head, w2 = m.head.weight.detach().clone(), m.proj2.weight.detach().clone()
    budget = Budget(1024 * 512 * 2 + 10)  # room for the head's copy only
    assert od.pack_linears(m, budget) == 3 and budget.kinds == ["AMX tile"]
    assert m.head.tiles is not None and m.proj.tiles is None and m.proj2.tiles is None
    calls = []
    from pagedserve.executor.ops import moe_gemm

    real = moe_gemm.experts_mm
    try:
        moe_gemm.experts_mm = lambda *a: calls.append(a[0].shape[0]) or real(*a)
        for rows in (1, 9, 64, 300, od.TILE_MAX_ROWS, od.TILE_MAX_ROWS + 1):
            x = torch.randn(rows, 512).bfloat16()
            torch.testing.assert_close(m.head(x), F.linear(x, w_head))
    finally:
        moe_gemm.experts_mm = real
    assert calls == [1, 9, 64, 300, od.TILE_MAX_ROWS]  # the largest on oneDNN
    assert m.head.packed_products()[0][2] == od.TILE_MAX_ROWS + 1 and m.proj.packed_products()[0][2] == 1
    m2 = nn.Sequential(nn.Linear(512, 512, bias=False)).bfloat16()
    assert od.pack_linears(m2, Budget(1 << 30)) == 1 and m2[0].tiles is not None
    x = torch.randn(7, 512).bfloat16()
    torch.testing.assert_close(m.proj2(x), F.linear(x, w2))


@pytest.mark.skipif(torch.bfloat16 not in DTYPES, reason="oneDNN does not pack bfloat16 here")
@pytest.mark.parametrize("rows", [1, 17, 300])
@pytest.mark.parametrize("inter,k", [(96, 64), (520, 200)])
def test_fused_silu_mul_on_the_halves(rows, inter, k):
    """packed_silu_mul: silu(x Wg^T) * (x Wu^T) from the split halves of a gate_up weight, SiLU
    on the float32 sums (oneDNN's swish post-op) and the product in the up GEMM's binary
    post-op: within bf16's rounding of the float64 result, no further from it than the
    unfused path (gate_up product, rounded; SiLU, rounded; product, rounded) on average over
    the output, the halves' plain product equal to the whole weight's."""
    torch.manual_seed(rows + inter)
    w = (torch.randn(2 * inter, k) / k**0.5).bfloat16()
    x = torch.randn(rows, k).bfloat16()
    halves = od.split_gate_up(w)
    fused = od.packed_silu_mul(x, *halves)
    gu = od.packed_linear(x, od.pack_weight(w), None)
    torch.testing.assert_close(od.halves_linear(x, halves), gu)
    unfused = (F.silu(gu[:, :inter]) * gu[:, inter:]).bfloat16()
    g, u = (x.double() @ w.double().T).split(inter, dim=-1)
    ref = F.silu(g) * u
    err = (fused.double() - ref).abs()
    assert fused.shape == (rows, inter) and fused.dtype == torch.bfloat16
    assert err.max().item() <= 2**-7 * ref.abs().max().item()
    assert err.mean().item() <= (unfused.double() - ref).abs().mean().item()


class GateUpMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Linear(512, 1024, bias=False)


@pytest.mark.skipif(not _amx_tiles(), reason="no AMX tile kernel here (AMX-BF16 CPU, Linux granting the tiles, an AMX path)")
def test_a_marked_gate_up_layer_keeps_halves_past_its_tile_rows(monkeypatch):
    """A gate_up layer marked act_halves with a tile copy keeps its oneDNN weight as halves:
    silu_mul serves products past the tiles' rows (None below, where the tiles run the whole
    gate_up), forward is the plain product on either; warm_up builds the fused primitives.
    With SPLIT_GATE_UP off it keeps the one packed weight."""
    torch.manual_seed(1)
    m = GateUpMLP().bfloat16()
    w = m.gate_up_proj.weight.detach().clone()
    m.gate_up_proj.act_halves = True
    assert od.pack_linears(m, Budget(1 << 30)) == 1
    lin = m.gate_up_proj
    assert lin.packed is None and lin.silu_halves is not None and lin.tiles is not None
    small, big = torch.randn(9, 512).bfloat16(), torch.randn(od.TILE_MAX_ROWS + 5, 512).bfloat16()
    assert lin.silu_mul(small) is None
    torch.testing.assert_close(lin.silu_mul(big), od.packed_silu_mul(big, *lin.silu_halves))
    for x in (small, big):
        torch.testing.assert_close(lin(x), F.linear(x, w))
    calls = []
    real = od.packed_silu_mul
    monkeypatch.setattr(od, "packed_silu_mul", lambda x, g, u: calls.append(x.shape[0]) or real(x, g, u))
    od.warm_up(m, od.TILE_MAX_ROWS + 40, 1)
    assert calls == od.bucket_sizes(od.TILE_MAX_ROWS + 1, od.TILE_MAX_ROWS + 40)[::-1]
    monkeypatch.setattr(od, "SPLIT_GATE_UP", False)
    m2 = GateUpMLP().bfloat16()
    m2.gate_up_proj.act_halves = True
    od.pack_linears(m2, Budget(1 << 30))
    assert m2.gate_up_proj.packed is not None and m2.gate_up_proj.silu_halves is None
