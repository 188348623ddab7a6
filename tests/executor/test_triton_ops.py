"""The Triton fused layer ops (executor/ops/triton_ops.py) against the PyTorch references, under
TRITON_INTERPRET=1 on the CPU and compiled on a GPU (benchmarks/gpu_check.sh): odd widths,
strided rows, float32 and bfloat16, the in-place contracts; and the dispatch that hands them
to the model on CUDA."""

import pytest
import torch

from tests.executor import triton_setup  # first: TRITON_INTERPRET before triton decorates kernels

DEV, INTERPRETED = triton_setup.DEV, triton_setup.INTERPRETED

from pagedserve.executor import ops  # noqa: E402
from pagedserve.executor.ops import triton_ops  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


# Triton's interpreter casts float32 to bfloat16 by truncation (compiled Triton rounds to
# nearest even, as PyTorch): there each rounded intermediate may sit a step lower.


def check(out, ref, dtype):
    """float32: within float32 rounding (the reduction order differs). 16-bit types compiled:
    within one step of the type and nearly every element equal to the bit; interpreted: within
    two steps (the truncating casts)."""
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-5, atol=1e-6)
        return
    step = 2**-7 if dtype == torch.bfloat16 else 2**-10
    o, r = out.float().cpu(), ref.float().cpu()
    # interpreted, a truncated sum of two truncated products can be a step of the products off
    torch.testing.assert_close(o, r, rtol=2 * step if INTERPRETED else step, atol=2e-2 if INTERPRETED else 1e-5)
    if not INTERPRETED:
        assert (o == r).float().mean().item() > 0.97


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 8), (3, 576), (17, 1000)])
def test_rms_norm_and_add_rms_norm(dtype, rows, n):
    x = rand(rows, n + 5, dtype=dtype, seed=n)[:, :n]  # rows with a stride past their width
    w = rand(n, dtype=dtype, seed=1)
    check(triton_ops.rms_norm(x, w, 1e-6), ops.rms_norm_ref(x, w, 1e-6), dtype)
    x = rand(rows, n, dtype=dtype, seed=2)
    res = rand(rows, n, dtype=dtype, seed=3)
    ref_out, ref_res = ops.add_rms_norm_ref(x, res, w, 1e-5)
    triton_ops.add_rms_norm_(x, res, w, 1e-5)  # in place: x <- norm, res <- the sum
    if dtype != torch.bfloat16 or not INTERPRETED:
        assert torch.equal(res.cpu(), ref_res.cpu())  # the sum is one rounding either way
    else:
        check(res, ref_res, dtype)
    check(x, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nq,nkv,d", [(4, 2, 64), (3, 1, 40), (8, 8, 16)])
def test_rotary_on_the_q_and_k_heads_only(dtype, nq, nkv, d):
    t = 5
    width = (nq + 2 * nkv) * d
    qkv = rand(t, width + 7, dtype=dtype, seed=d)[:, :width]  # strided rows, as a fused projection's view
    pos = torch.arange(t, dtype=torch.float32)[:, None] * 0.37
    freq = pos * torch.arange(d // 2, dtype=torch.float32)[None, :].neg().mul(0.1).exp()
    ang = torch.cat([freq, freq], -1)
    cos, sin = ang.cos().to(dtype).to(DEV), ang.sin().to(dtype).to(DEV)
    heads = qkv.clone().view(t, nq + 2 * nkv, d)
    ref_qk = ops.rotate_ref(heads[:, : nq + nkv], cos[:, None, :], sin[:, None, :])
    triton_ops.rotary_(qkv, cos, sin, nq, nkv, d)
    out = qkv.reshape(t, nq + 2 * nkv, d)
    # An H200 gave 2-3% of these outputs a step of the products off with Triton's multiply-add
    # fusion on (likely a product's rounding fused away, fma.rn.bf16): the launches turn it off.
    check(out[:, : nq + nkv], ref_qk, dtype)
    assert torch.equal(out[:, nq + nkv :].cpu(), heads[:, nq + nkv :].cpu())  # V untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 24), (3, 1000), (2, 2500)])  # one block, one partial, three
def test_silu_and_mul(dtype, rows, inter):
    gu = rand(rows, 2 * inter, dtype=dtype, seed=inter) * 4
    check(triton_ops.silu_and_mul(gu), ops.silu_and_mul_ref(gu), dtype)


def test_bad_shapes_are_refused():
    x = rand(3, 16, dtype=torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="weight"):
        triton_ops.rms_norm(x, rand(15, dtype=torch.float32, seed=1), 1e-6)
    with pytest.raises(RuntimeError, match="unit inner stride"):
        triton_ops.silu_and_mul(x.t())
    with pytest.raises(RuntimeError, match="too short"):
        triton_ops.rotary_(x, x, x, 1, 1, 16)


def test_dispatch_hands_the_triton_ops_to_cuda_tensors_only():
    cpu = torch.zeros(2, 8)
    assert ops.layer_kernels_for(cpu) is ops.kernels_for(cpu)
    if torch.cuda.is_available():
        assert ops.layer_kernels_for(cpu.cuda()) is triton_ops
        assert ops.layer_kernels_for(cpu.cuda().long()) is None


@pytest.mark.skipif(not INTERPRETED, reason="on a GPU the engine tests run these ops for real")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_model_with_these_ops_gives_transformers_greedy_tokens(checkpoint, arch, monkeypatch):
    """The model's `kern` contract as on CUDA (norms, rotary on the fused QKV row, SiLU), on
    the CPU: the Triton ops interpreted. The torch backend here would take K/V written with
    the rotary (rotary_cache_, which only the C++ module has): the model must see that this
    module lacks it, rotate in place and let the backend write them (and skip the lean loop)."""
    from pagedserve import LLM, SamplingParams
    from tests.checkpoints import load_hf

    used = set()

    class Recording:
        def __getattr__(self, name):
            used.add(name)
            return getattr(triton_ops, name)

    monkeypatch.setattr(ops, "layer_kernels_for", lambda t: Recording())
    path = checkpoint(arch)
    hf = load_hf(path)
    llm = LLM(path, dtype="float32", num_kv_blocks=100)
    prompts = [[(7 * i + j) % 1000 for j in range(5 + 9 * i)] for i in range(3)]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p])
        with torch.inference_mode():
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
        assert o.outputs[0].token_ids == ref
    assert {"rms_norm", "add_rms_norm_", "silu_and_mul"} <= used
    assert ("rotary_" in used) == (arch == "llama")  # Qwen3's q/k norms take the reference path
    assert "rotary_cache_" in used and not ops.writes_kv_cache(Recording())  # asked, and absent
