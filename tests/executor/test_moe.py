"""Mixture-of-experts families against transformers (logits within 1e-4 in float32, the same
greedy tokens): Mixtral (softmax, top-2, renormalised, float32 weights), Qwen2-MoE (top-1,
not renormalised, a shared expert under a sigmoid gate, a dense layer among sparse ones),
Qwen3-MoE (norm_topk_prob, q/k norms, tied embeddings), OLMoE (top-3, full-width q/k norms,
clip_qkv), through the real scheduler: batched, chunked prefill, prefix hits, preemption.
Plus the grouping (one product pair per active expert per step) and the refusals."""

import pytest
import torch

from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.models import moe
from pagedserve.executor.models.moe import FusedExperts, MoeForCausalLM, SparseMoeBlock
from tests.checkpoints import load_hf
from tests.executor.test_model_parity import check_against_hf, drive, make_runner

MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.mark.parametrize("arch,block_size", [("mixtral", 8), ("qwen2_moe", 16), ("qwen3_moe", 32), ("olmoe", 16)])
def test_moe_prefill_and_decode_match_transformers(checkpoint, arch, block_size):
    path = checkpoint(arch)
    hf = load_hf(path)
    runner = make_runner(path, block_size)
    assert isinstance(runner.model, MoeForCausalLM)
    prompt = [(7 * i + 3) % 1000 for i in range(37)]
    reqs, logits_at, _ = drive(runner, [prompt, prompt[:11]], 12, block_size)
    check_against_hf(hf, reqs, logits_at)
    with torch.inference_mode():
        hf_gen = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert reqs["r0"].output_token_ids == hf_gen


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_mixed_batch_chunked_prefill_and_prefix_hits(checkpoint, arch):
    path = checkpoint(arch)
    hf = load_hf(path)
    runner = make_runner(path, 16)
    shared = [(11 * i + 5) % 1000 for i in range(40)]
    prompts = [shared + [1, 2, 3], [9] * 3, list(range(100, 171)), [42]]
    late = {3: [("late0", shared + [6, 7, 8, 9], 5)]}
    reqs, logits_at, sched = drive(runner, prompts, 6, 16, budget=24, late=late)
    assert sched.kv.prefix_cache_hits >= 32
    check_against_hf(hf, reqs, logits_at)


def test_moe_preemption_recompute_matches(checkpoint):
    path = checkpoint("qwen2_moe")
    hf = load_hf(path)
    runner = make_runner(path, 8, num_blocks=14)
    prompts = [[(3 * i + j) % 1000 for j in range(20)] for i in range(4)]
    reqs, logits_at, sched = drive(runner, prompts, 12, 8, num_blocks=14, caching=False)
    assert sched.num_preemptions > 0
    check_against_hf(hf, reqs, logits_at)


def test_moe_bfloat16_close_to_transformers_bf16(checkpoint):
    path = checkpoint("mixtral")
    hf = load_hf(path, dtype=torch.bfloat16)
    runner = make_runner(path, 16, dtype="bfloat16")
    reqs, logits_at, _ = drive(runner, [[(5 * i + 1) % 1000 for i in range(30)]], 6, 16)
    with torch.inference_mode():
        ref = hf(torch.tensor([reqs["r0"].all_token_ids])).logits[0].float()
    for (_, p), ours in logits_at.items():
        assert (ours - ref[p]).abs().max().item() < 0.1  # bf16: a looser, stated tolerance


def test_moe_int8_at_load_packs_the_experts(checkpoint):
    """quantization="int8": every expert packed (Q8_0 blocks, executor/quant's kernels), the
    router left float; logits close to float32 (int8 weights: a stated tolerance)."""
    path = checkpoint("mixtral")
    prompt = [[(5 * i + 1) % 1000 for i in range(30)]]
    ref = drive(make_runner(path, 16), prompt, 4, 16)[1]
    runner = make_runner(path, 16)
    runner.model = None
    from pagedserve.executor.model_runner import ModelRunner

    runner = ModelRunner(path, runner.model_config, dtype="float32", quantization="int8")
    runner.initialize_kv_cache(200, 16)
    block = runner.model.layers[0].mlp
    assert block.experts.q13 is not None and block.experts.w13.numel() == 0
    assert type(block.gate).__name__ == "Router"
    got = drive(runner, prompt, 4, 16)[1]
    first = min(ref)
    rel = ((got[first] - ref[first]).norm() / ref[first].norm()).item()
    assert 0 < rel < 0.05, rel


def test_experts_run_once_per_step_over_their_tokens(monkeypatch):
    """Tokens are grouped by expert: one (gate_up, down) product pair per expert chosen by
    any token of the step, each over exactly the rows that chose it; equal to the per-token
    sum of the chosen experts' outputs."""
    torch.manual_seed(0)
    e, h, inter, t, k = 5, 16, 8, 9, 2
    experts = FusedExperts(e, h, inter)
    with torch.no_grad():
        experts.w13.normal_()
        experts.w2.normal_()
    x = torch.randn(t, h)
    ids = torch.tensor([[0, 2]] * 4 + [[2, 4]] * 5)  # experts 1 and 3 idle
    weights = torch.rand(t, k)
    calls = []
    real = torch.nn.functional.linear

    def spy(inp, w, *a):
        calls.append((inp.shape[0], w.data_ptr()))
        return real(inp, w, *a)

    monkeypatch.setattr(moe.F, "linear", spy)
    out = experts.forward(x, weights, ids)
    monkeypatch.undo()
    ptr = {experts.w13[i].data_ptr(): i for i in range(e)} | {experts.w2[i].data_ptr(): i for i in range(e)}
    assert sorted((ptr[p], n) for n, p in calls) == [(0, 4), (0, 4), (2, 9), (2, 9), (4, 5), (4, 5)]
    ref = torch.zeros(t, h)
    for i in range(t):
        for j in range(k):
            ex = int(ids[i, j])
            gate, up = (x[i] @ experts.w13[ex].T).chunk(2)
            ref[i] += weights[i, j] * ((torch.nn.functional.silu(gate) * up) @ experts.w2[ex].T)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for i in (0, 8):  # one token (batch-1 decode's path, no sort): the same sums
        torch.testing.assert_close(experts.forward(x[i : i + 1], weights[i : i + 1], ids[i : i + 1]), ref[i : i + 1],
                                   rtol=1e-5, atol=1e-5)


def _moe_config(**extra):
    base = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 300,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    return ModelConfig.from_hf_dict({**base, **extra})


@pytest.mark.parametrize(
    "field,value",
    [("scoring_func", "sigmoid"), ("topk_method", "group_limited_greedy"), ("n_group", 4),
     ("routed_scaling_factor", 2.5), ("n_shared_experts", 2), ("first_k_dense_replace", 1)],
)
def test_unsupported_router_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        _moe_config(**{field: value})


def test_moe_config_reads_sparse_layers_and_top_k():
    cfg = _moe_config(decoder_sparse_step=2, mlp_only_layers=[], num_hidden_layers=4)
    assert cfg.moe_layers == [1, 3] and cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        _moe_config(num_experts_per_tok=5)
    assert SparseMoeBlock.__name__ == "SparseMoeBlock"


def test_tensor_parallel_layout_of_experts():
    """Experts split within (moe_intermediate_size by the ranks); OLMoE's full-width q/k
    norms do not split and are refused, naming them."""
    from pagedserve.executor.distributed.sharding import check_divisible

    check_divisible(_moe_config(moe_intermediate_size=32), 2)
    with pytest.raises(ValueError, match="moe_intermediate_size=33"):
        check_divisible(_moe_config(moe_intermediate_size=33), 2)
    olmoe = ModelConfig.from_hf_dict({"architectures": ["OlmoeForCausalLM"], "hidden_size": 64, "intermediate_size": 32,
                                      "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 10,
                                      "num_experts": 4, "num_experts_per_tok": 1})
    with pytest.raises(ValueError, match="OLMoE"):
        check_divisible(olmoe, 2)
