"""On a GPU only (skipped elsewhere): the Triton backend with and without CUDA graphs against
transformers on the tiny checkpoints. Run by benchmarks/gpu_check.sh."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from pagedserve import LLM, SamplingParams  # noqa: E402
from tests.checkpoints import load_hf  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_greedy_matches_transformers_fp32(checkpoint, arch, enforce_eager):
    path = checkpoint(arch)
    hf = load_hf(path).cuda()
    llm = LLM(
        path, dtype="float32", device="cuda", num_kv_blocks=300, max_num_seqs=16, enforce_eager=enforce_eager
    )
    assert llm.engine.engine_core.executor.runner.backend.name == "triton"
    assert (llm.engine.engine_core.executor.runner.graph_runner is None) == enforce_eager
    prompts = [[(7 * i + j) % 1000 for j in range(5 + 9 * i)] for i in range(6)]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    for p, o in zip(prompts, outs):
        with torch.inference_mode():
            ids = torch.tensor([p], device="cuda")
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),  # token 0 is also pad_token_id: never masked
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
        assert o.outputs[0].token_ids == ref


def test_bf16_logprobs_close_to_transformers(checkpoint):
    path = checkpoint("llama")
    hf = load_hf(path, dtype=torch.bfloat16).cuda()
    llm = LLM(path, dtype="bfloat16", device="cuda", num_kv_blocks=300, max_num_seqs=8)
    p = [(5 * j + 2) % 1000 for j in range(30)]
    o = llm.generate(
        {"prompt_token_ids": p}, SamplingParams(max_tokens=1, temperature=0, logprobs=5), use_tqdm=False
    )[0].outputs[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([p], device="cuda")).logits[0, -1].float(), -1)
    for tid, lp in o.logprobs[0].items():
        assert abs(lp.logprob - ref[tid].item()) < 0.05


def test_memory_profiling_sizes_the_cache(checkpoint):
    llm = LLM(checkpoint("llama"), dtype="float32", device="cuda", gpu_memory_utilization=0.3, max_num_seqs=4)
    s = llm.get_stats()
    assert s.kv_blocks_total > 100
