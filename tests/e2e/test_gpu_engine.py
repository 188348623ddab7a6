"""The engine's features on the GPU (CUDA graphs, Triton kernels), token for token against
transformers on the same device (float32, tiny checkpoints): preemption with chunked prefill
and prefix hits, n-gram and draft-model speculation, LoRA adapters against PEFT, seeded
sampling, logprobs; other families (MoE, Gemma 2, Phi-3) and embeddings. benchmarks/
gpu_check.sh runs them on a lent GPU; elsewhere they run on the CPU with the same assertions,
so they stay right between GPU runs. The MoE, Gemma 2, Phi-3 and embedding tests were added
after the last GPU run (2026-12-04) and have not run on one yet."""

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.lora import LoRARequest
from tests.checkpoints import load_hf

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KW = dict(dtype="float32", device=DEV, max_model_len=512)


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir).to(DEV)


@torch.inference_mode()
def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt], device=DEV)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def shared_prefix_prompts(seed, n, shared=48, tail=150):
    rng = random.Random(seed)
    head = [rng.randrange(3, 1000) for _ in range(shared)]
    return [head + [rng.randrange(3, 1000) for _ in range(rng.randint(1, tail))] for _ in range(n)]


def test_preemption_chunked_prefill_prefix_hits_with_graphs(model_dir, hf):
    # 12 prompts of 49-198 tokens + 24-40 outputs in 40 usable blocks of 16: preempts; a token
    # budget of 64 chunks every prefill; the 48-token head is shared (3 full blocks)
    llm = LLM(model_dir, num_kv_blocks=41, max_num_batched_tokens=64, max_num_seqs=16, **KW)
    assert (llm.engine.engine_core.executor.runner.graph_runner is not None) == (DEV == "cuda")
    prompts = shared_prefix_prompts(0, 12)
    max_tokens = [random.Random(i).randint(24, 40) for i in range(len(prompts))]
    sps = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, m), f"prompt of {len(p)} tokens"
    st = llm.get_stats()
    assert st.num_preemptions > 0 and st.prefix_cache_hits > 0
    assert st.kv_blocks_used == 0 and st.num_running == 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_gives_the_same_greedy_tokens(model_dir, method):
    prompts = [{"prompt_token_ids": ([7, 8, 9, 10 + i, 11] * 6)[: 20 + i]} for i in range(4)]
    spec = (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3}
    )
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = LLM(model_dir, num_kv_blocks=200, **KW).generate(prompts, sp, use_tqdm=False)
    llm = LLM(model_dir, num_kv_blocks=200, speculative_config=spec, **KW)
    out = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in base]
    st = llm.get_stats()
    assert st.spec_num_accepted_tokens > 0 and st.kv_blocks_used == 0


def test_lora_adapters_match_peft(model_dir, tmp_path_factory):
    from peft import PeftModel

    from tests.executor.test_lora import make_adapters

    dirs = make_adapters(model_dir, tmp_path_factory, names=("qv", "all"))
    llm = LLM(model_dir, num_kv_blocks=200, enable_lora=True, max_loras=2, max_lora_rank=16, **KW)
    prompts = shared_prefix_prompts(1, 6, shared=20, tail=30)
    loras = [LoRARequest(n, i + 1, d) for i, (n, d) in enumerate(dirs.items())]
    per_prompt = [[*loras, None][i % 3] for i in range(len(prompts))]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=per_prompt, use_tqdm=False)
    peft = PeftModel.from_pretrained(load_hf(model_dir), dirs["qv"], adapter_name="qv")
    peft.load_adapter(dirs["all"], adapter_name="all")
    peft = peft.to(DEV).eval()
    for p, lora, o in zip(prompts, per_prompt, outs):
        if lora is None:
            with peft.disable_adapter():
                ref = hf_greedy(peft, p, 12)
        else:
            peft.set_adapter(lora.lora_name)
            ref = hf_greedy(peft, p, 12)
        assert o.outputs[0].token_ids == ref, lora and lora.lora_name
    assert llm.get_stats().kv_blocks_used == 0


def test_seeded_sampling_repeats_and_logprobs_match(model_dir, hf):
    llm = LLM(model_dir, num_kv_blocks=200, **KW)
    prompt = {"prompt_token_ids": [(5 * j + 2) % 1000 for j in range(30)]}
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, n=2, logprobs=3)
    a, b = (llm.generate(prompt, sp, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=5), use_tqdm=False)
    with torch.inference_mode():
        ids = torch.tensor([prompt["prompt_token_ids"]], device=DEV)
        ref = torch.log_softmax(hf(ids).logits[0, -1].float(), -1)
    for tid, lp in greedy[0].outputs[0].logprobs[0].items():
        assert abs(lp.logprob - ref[tid].item()) < 1e-3


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "gemma2", "phi3"])
def test_other_families_give_transformers_greedy_tokens(checkpoint, arch):
    """MoE blocks (routing, shared experts), Gemma 2's sliding window and soft cap, Phi-3's
    fused projections, with CUDA graphs: greedy tokens equal transformers' on the same GPU."""
    path = checkpoint(arch)
    ref_model = load_hf(path).to(DEV)
    llm = LLM(path, num_kv_blocks=300, max_num_seqs=8, **KW)
    # prompt + output stay under Phi-3's original 48 positions: transformers' LongRoPE switches
    # factors for the whole sequence when it crosses them (tests/executor/test_phi3.py)
    prompts = [[(11 * i + 3 * j) % 900 + 5 for j in range(6 + 13 * i)] for i in range(3)]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(ref_model, p, 12), f"{arch}, prompt of {len(p)} tokens"


def test_embeddings_match_transformers_hidden_states(model_dir):
    import torch.nn.functional as F
    import transformers

    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).to(DEV).eval()
    llm = LLM(model_dir, runner="pooling", pooling_type="mean", num_kv_blocks=200, **KW)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate([5, 40, 90])]
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            h = model(torch.tensor([p], device=DEV)).last_hidden_state[0]
        want = F.normalize(h.mean(0), dim=-1).cpu()
        got = torch.tensor(o.outputs.embedding)
        assert 1 - F.cosine_similarity(got, want, dim=0).item() < 1e-5
