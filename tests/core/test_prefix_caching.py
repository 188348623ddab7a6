"""Shared KV pages end to end: prefix caching, n > 1 sampling, salts."""

import random

import pytest

from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("llama")


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_same_outputs_with_and_without_caching_under_preemption(model_dir):
    rng = random.Random(0)
    shared = [rng.randrange(3, 1000) for _ in range(100)]
    prompts = [
        {
            "prompt_token_ids": shared[: rng.randint(20, 100)]
            + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 30))]
        }
        for _ in range(16)
    ]
    results, stats = {}, {}
    for caching in (True, False):
        llm = LLM(model_dir, dtype="float32", num_kv_blocks=30, enable_prefix_caching=caching)
        outs = llm.generate(prompts, greedy(40), use_tqdm=False)
        results[caching] = [o.outputs[0].token_ids for o in outs]
        stats[caching] = llm.get_stats()
        assert stats[caching].kv_blocks_used == 0
    assert results[True] == results[False]
    assert stats[True].num_preemptions > 0 and stats[False].num_preemptions > 0
    assert stats[True].prefix_cache_hits > 0 and stats[False].prefix_cache_hits == 0


def test_preempted_request_reuses_its_cached_blocks(model_dir):
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(60)]} for _ in range(6)]
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=20)
    llm.generate(prompts, greedy(60), use_tqdm=False)
    s = llm.get_stats()
    # distinct prompts share nothing: every hit is a resumed request finding its own blocks
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0


def test_prompt_logprobs_cover_every_position_after_a_cache_hit(model_dir):
    """A request that wants prompt logprobs computes its whole prompt, cached or not (vLLM
    skips the prefix cache for it): one entry per prompt position, equal to an uncached run."""
    rng = random.Random(3)
    prompt = {"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(40)]}
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=60)
    llm.generate(prompt, greedy(2), use_tqdm=False)  # its blocks are now cached
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    (out,) = llm.generate(prompt, sp, use_tqdm=False)
    (ref,) = LLM(model_dir, dtype="float32", num_kv_blocks=60, enable_prefix_caching=False).generate(
        prompt, sp, use_tqdm=False
    )
    assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) == 40
    for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert llm.get_stats().kv_blocks_used == 0


def test_shared_system_prompt_is_computed_once(model_dir):
    rng = random.Random(2)
    system = [rng.randrange(3, 1000) for _ in range(600)]
    prompts = [
        {"prompt_token_ids": system + [rng.randrange(3, 1000) for _ in range(rng.randint(4, 12))]}
        for _ in range(32)
    ]
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=400)
    outs = llm.generate(prompts, greedy(4), use_tqdm=False)
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 592 for o in outs[1:])  # 37 full blocks of 16
    s = llm.get_stats()
    assert s.prefix_cache_hits == 31 * 592
    # the same outputs as computing everything
    ref = LLM(model_dir, dtype="float32", num_kv_blocks=400, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in ref.generate(prompts, greedy(4), use_tqdm=False)
    ]


def test_n8_samples_hold_the_prompt_blocks_once(model_dir):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=200, seed=0)
    eng = llm.engine
    prompt = {"prompt_token_ids": list(range(10, 50))}  # 40 tokens: 2 full blocks + 8
    sp = SamplingParams(n=8, max_tokens=5, temperature=1.0, seed=123, ignore_eos=True)
    eng.add_request("p", prompt, sp)
    eng.step()  # all 8 children admitted in one step
    kv = eng.engine_core.scheduler.kv
    tables = [kv.req_to_blocks[f"p#{i}"] for i in range(8)]
    shared = tables[0][:2]
    assert all(t[:2] == shared for t in tables)
    assert all(b.ref_cnt == 8 for b in shared)
    # 2 shared full blocks + one partial block per child
    assert kv.num_used_blocks == 2 + 8
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    first = [c.token_ids for c in outs[0].outputs]
    assert len(first) == 8 and len({tuple(t) for t in first}) > 1  # the samples differ
    again = llm.generate(prompt, sp, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == first  # a fixed seed reproduces them
    assert [c.index for c in again.outputs] == list(range(8))


def test_salts_isolate_tenants(model_dir):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=200)
    p = list(range(100, 180))
    a = llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-a"}, greedy(3), use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-b"}, greedy(3), use_tqdm=False)[0]
    plain = llm.generate({"prompt_token_ids": p}, greedy(3), use_tqdm=False)[0]
    a2 = llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-a"}, greedy(3), use_tqdm=False)[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert a2.num_cached_tokens == 64
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == a2.outputs[0].token_ids
    llm.reset_prefix_cache()
    a3 = llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-a"}, greedy(3), use_tqdm=False)[0]
    assert a3.num_cached_tokens == 0
