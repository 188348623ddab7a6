"""End to end through LLM / LLMEngine, greedy, token-exact against transformers."""

import random

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.frontend.llm import LLM
from pagedserve.sampling_params import RequestOutputKind
from tests.checkpoints import load_hf


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


_ref_cache = {}


def hf_greedy(hf, prompt, n):
    key = (id(hf), tuple(prompt), n)
    if key not in _ref_cache:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        _ref_cache[key] = out[0, len(prompt) :].tolist()
    return _ref_cache[key]


def workload(seed=0, n=24, max_len=700):
    rng = random.Random(seed)
    lens = [1, max_len] + [rng.randint(1, max_len) for _ in range(n - 2)]
    prompts = [[rng.randrange(3, 1000) for _ in range(L)] for L in lens]
    max_tokens = [rng.randint(1, 24) for _ in range(n)]
    return prompts, max_tokens


def run_and_check(llm, hf, prompts, max_tokens):
    sps = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == hf_greedy(hf, p, m), f"prompt of {len(p)} tokens"
        assert o.outputs[0].finish_reason == "length"
    stats = llm.get_stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
    return stats


@pytest.mark.slow
def test_24_prompts_together(model_dir, hf):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=800)
    prompts, max_tokens = workload()
    stats = run_and_check(llm, hf, prompts, max_tokens)
    assert stats.num_preemptions == 0


@pytest.mark.slow
def test_tiny_cache_forces_many_preemptions(model_dir, hf):
    # 24 requests of up to 200 + 64 tokens in 40 usable blocks of 16 (640 tokens)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=41, enable_prefix_caching=False)
    prompts, _ = workload(seed=1, max_len=200)
    max_tokens = [random.Random(i).randint(32, 64) for i in range(len(prompts))]
    stats = run_and_check(llm, hf, prompts, max_tokens)
    assert stats.num_preemptions >= 5


@pytest.mark.slow
def test_small_budget_forces_chunked_prefill(model_dir, hf):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=800, max_num_batched_tokens=32)
    prompts, max_tokens = workload(seed=2, n=10, max_len=300)
    stats = run_and_check(llm, hf, prompts, max_tokens)
    assert stats.num_steps >= sum(len(p) for p in prompts) // 32


def test_late_request_joins_running_batch(model_dir, hf):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=200)
    eng = llm.engine
    early = [[5, 6, 7, 8], [9, 10, 11]]
    for i, p in enumerate(early):
        eng.add_request(
            f"early{i}",
            {"prompt_token_ids": p},
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        )
    done = {}
    for _ in range(5):
        for o in eng.step():
            done.setdefault(o.request_id, o)
    late = [100, 200, 300, 400, 500]
    eng.add_request(
        "late", {"prompt_token_ids": late}, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    joined = False
    while eng.has_unfinished_requests():
        outs = eng.step()
        ids = eng.engine_core.running_request_ids()
        if "late" in ids and {"early0", "early1"} <= ids:
            joined = True  # the late request runs in the same batch as the earlier ones
        for o in outs:
            if o.finished:
                done[o.request_id] = o
    assert joined
    assert done["late"].outputs[0].token_ids == hf_greedy(hf, late, 5)
    for i, p in enumerate(early):
        assert done[f"early{i}"].outputs[0].token_ids == hf_greedy(hf, p, 30)
    # the late one finished first although it came last
    assert done["late"].metrics.finished_time <= done["early0"].metrics.finished_time


def test_abort_mid_generation_frees_blocks(model_dir):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=100)
    eng = llm.engine
    for i in range(3):
        eng.add_request(
            f"r{i}", {"prompt_token_ids": list(range(3, 60))}, SamplingParams(max_tokens=50, ignore_eos=True)
        )
    for _ in range(4):
        eng.step()
    assert eng.get_stats().kv_blocks_used > 0
    eng.abort_request(["r0", "r1", "r2"])
    s = eng.get_stats()
    assert s.kv_blocks_used == 0 and s.num_running == 0 and not eng.has_unfinished_requests()


def test_text_prompts_eos_and_stop_strings(model_dir, hf):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=100)
    tok = llm.get_tokenizer()
    prompt = "The quick brown fox"
    ids = tok.encode(prompt)
    ref = hf_greedy(hf, ids, 20)
    full_text = tok.decode(ref, skip_special_tokens=True)
    out = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)[
        0
    ]
    assert out.prompt == prompt and out.prompt_token_ids == ids
    assert out.outputs[0].text == full_text
    # a stop string that spans tokens: pick characters from the middle of the text
    if len(full_text) >= 8:
        stop = full_text[3:7]
        o = llm.generate(
            prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]), use_tqdm=False
        )[0].outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason == stop
        assert o.text == full_text[: full_text.index(stop)]
        o2 = llm.generate(
            prompt,
            SamplingParams(
                max_tokens=20, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
            ),
            use_tqdm=False,
        )[0].outputs[0]
        assert o2.text == full_text[: full_text.index(stop) + len(stop)]
    assert llm.get_stats().kv_blocks_used == 0


def test_streaming_deltas_concatenate_to_final_text(model_dir):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=100)
    eng = llm.engine
    sp = SamplingParams(
        max_tokens=30, temperature=0.8, seed=3, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    eng.add_request("s", "你好，世界！🚀", sp)
    pieces, toks = [], []
    while eng.has_unfinished_requests():
        for o in eng.step():
            pieces.append(o.outputs[0].text)
            toks += o.outputs[0].token_ids
    tok = llm.get_tokenizer()
    assert "".join(pieces) == tok.decode(toks, skip_special_tokens=True)
    assert len(toks) == 30


def test_invalid_requests_raise_and_leak_nothing(model_dir):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=10, max_model_len=256)  # 144 KV tokens
    with pytest.raises(ValueError, match="max_model_len|maximum context length"):
        llm.generate({"prompt_token_ids": list(range(3, 250))}, SamplingParams(max_tokens=20), use_tqdm=False)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate({"prompt_token_ids": list(range(3, 200))}, SamplingParams(max_tokens=50), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [1, 5000]}, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    # a bad request in a batch: nothing of the batch stays queued
    with pytest.raises(ValueError):
        llm.generate(
            [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": list(range(3, 250))}],
            SamplingParams(max_tokens=20),
            use_tqdm=False,
        )
    assert isinstance(llm.engine, LLMEngine) and not llm.engine.has_unfinished_requests()
    assert llm.get_stats().kv_blocks_used == 0
    assert llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs


def test_bf16_logits_reach_the_sampler_without_a_float32_pass_and_sample_the_same_tokens(model_dir, monkeypatch):
    """A bf16 engine's greedy and plain-temperature steps hand the sampler bf16 logits (no
    [rows, V] float32 conversion); seeded temperature sampling and greedy rows give the tokens
    of the float32 path. Logprobs need float32 logits and get them."""
    from pagedserve.executor.model_runner import ModelRunner

    llm = LLM(model_dir, dtype="bfloat16", max_model_len=256, num_kv_blocks=200)
    prompts = [{"prompt_token_ids": [5 + i, 9, 13 + 2 * i, 4]} for i in range(5)]
    sps = [SamplingParams(max_tokens=12, temperature=t, seed=11 + i, ignore_eos=True) for i, t in enumerate((0, 1, 0.7, 0, 1.2))]
    asked = []
    real = ModelRunner._samples_model_dtype

    def spy(self, so, constrained, batch):
        asked.append(real(self, so, constrained, batch))
        return asked[-1]

    monkeypatch.setattr(ModelRunner, "_samples_model_dtype", spy)
    raw = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
    assert asked and all(asked)
    monkeypatch.setattr(ModelRunner, "_samples_model_dtype", lambda self, so, constrained, batch: False)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)] == raw
    asked.clear()
    monkeypatch.setattr(ModelRunner, "_samples_model_dtype", spy)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=1.0, logprobs=2), use_tqdm=False)
    assert asked and not any(asked)
