"""The executor against transformers: logits within 1e-4 (float32) and identical greedy tokens,
for each architecture, block size, chunked prefill, prefix hits and mixed batches."""

import pytest
import torch

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.executor.loader import load_hf_config_dict
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.messages import ModelRunnerOutput
from pagedserve.sampling_params import SamplingParams
from tests.checkpoints import load_hf

ARCHS = ["llama", "llama_tied_llama3rope", "mistral", "qwen2", "qwen3"]
TOL = 1e-4


def make_runner(path, block_size, num_blocks=200, dtype="float32", kv_cache_dtype="auto"):
    cfg = ModelConfig.from_hf_dict(load_hf_config_dict(path))
    runner = ModelRunner(path, cfg, dtype=dtype, device="cpu", kv_cache_dtype=kv_cache_dtype)
    runner.initialize_kv_cache(num_blocks, block_size)
    return runner


@torch.inference_mode()
def drive(runner, prompts, max_tokens, block_size, num_blocks=200, budget=4096, caching=True, late=None):
    """Run requests through the real scheduler and runner, greedy, recording our logits at
    every sampled position. late: {step: [(rid, prompt, max_tokens)]} added mid-run."""
    windows = runner.kv_layout.windows  # sliding-window models: the hybrid KV cache manager
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_model_len=2048),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
        kv_cache_groups=windows if windows != (None,) else None,
    )
    reqs = {}

    def add(rid, prompt, mt):
        p = SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True)
        r = Request(rid, list(prompt), p, max_tokens=mt)
        reqs[rid] = r
        sched.add_request(r)

    for i, p in enumerate(prompts):
        add(f"r{i}", p, max_tokens)
    logits_at = {}  # (rid, position) -> our logits row
    step = 0
    while sched.has_unfinished_requests() or (late and step in late):
        for rid, p, mt in (late or {}).get(step, []):
            add(rid, p, mt)
        so = sched.schedule()
        runner.input_batch.update(so)
        inp = runner.input_batch.prepare(so)
        hidden = runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)
        sampled = {}
        for i, sr in enumerate(inp.order):
            if not sr.sample:
                continue
            row = runner.model.compute_logits(hidden[int(inp.cu[i + 1]) - 1 : int(inp.cu[i + 1])])[0]
            pos = sr.num_computed_tokens + len(sr.token_ids) - 1
            logits_at[(sr.req_id, pos)] = row
            sampled[sr.req_id] = int(row.argmax())
        sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled))
        step += 1
    assert sched.kv.num_used_blocks == 0
    return reqs, logits_at, sched


def drive_mixed(runner, block_size):
    """A mixed batch: a small budget forces chunked prefill; later arrivals join while others
    decode and hit the shared prefix in the cache. (requests, logits at sampled positions)."""
    shared = [(11 * i + 5) % 1000 for i in range(40)]
    prompts = [shared + [1, 2, 3], [9] * 3, shared + [4, 5], list(range(100, 171)), [42]]
    late = {3: [("late0", shared + [6, 7, 8, 9], 6)], 6: [("late1", list(range(300, 390)), 5)]}
    reqs, logits_at, sched = drive(runner, prompts, 8, block_size, budget=24, late=late)
    assert sched.kv.prefix_cache_hits >= 32  # shared prefix blocks were reused
    return reqs, logits_at


def check_against_hf(hf, reqs, logits_at, tol=TOL, tie=0.0):
    """Every sampled position's logits within `tol` of transformers' on the same tokens, and
    its greedy token transformers' argmax, except at a near-tie (top-two gap within `tie`:
    rounding may pick either; the reference follows our tokens, so later positions still compare)."""
    for rid, r in reqs.items():
        seq = torch.tensor([r.all_token_ids])
        ref = hf(seq).logits[0].float()
        positions = sorted(p for (q, p) in logits_at if q == rid)
        assert len(positions) == r.num_output_tokens
        for p in positions:
            ours = logits_at[(rid, p)]
            diff = (ours - ref[p]).abs().max().item()
            assert diff <= tol, f"{rid} position {p}: max |logit diff| {diff:.2e}"
            top2 = ref[p].topk(2).values
            if top2[0] - top2[1] > tie:
                assert int(ref[p].argmax()) == r.all_token_ids[p + 1]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_and_greedy_decode_match_transformers(checkpoint, arch, block_size):
    path = checkpoint(arch)
    hf = load_hf(path)
    runner = make_runner(path, block_size)
    prompt = [(7 * i + 3) % 1000 for i in range(37)]
    reqs, logits_at, _ = drive(runner, [prompt], 20, block_size)
    check_against_hf(hf, reqs, logits_at)
    # and the whole-prompt logits of a prefill
    with torch.inference_mode():
        hf_gen = hf.generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert reqs["r0"].output_token_ids == hf_gen


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_chunked_prefill_and_prefix_hits(checkpoint, arch):
    path = checkpoint(arch)
    hf = load_hf(path)
    block_size = 16
    runner = make_runner(path, block_size)
    reqs, logits_at = drive_mixed(runner, block_size)
    check_against_hf(hf, reqs, logits_at)


def test_preemption_recompute_matches(checkpoint):
    path = checkpoint("llama")
    hf = load_hf(path)
    runner = make_runner(path, 8, num_blocks=14)
    prompts = [[(3 * i + j) % 1000 for j in range(20)] for i in range(4)]
    reqs, logits_at, sched = drive(runner, prompts, 24, 8, num_blocks=14, caching=False)
    assert sched.num_preemptions > 0
    check_against_hf(hf, reqs, logits_at)


def test_bfloat16_greedy_matches_transformers_bf16(checkpoint):
    path = checkpoint("llama")
    hf = load_hf(path, dtype=torch.bfloat16)
    runner = make_runner(path, 16, dtype="bfloat16")
    prompt = [(5 * i + 1) % 1000 for i in range(30)]
    reqs, logits_at, _ = drive(runner, [prompt], 12, 16)
    with torch.inference_mode():
        ref = hf(torch.tensor([reqs["r0"].all_token_ids])).logits[0].float()
    for (_, p), ours in logits_at.items():
        assert (ours - ref[p]).abs().max().item() < 0.1  # bf16: a looser, stated tolerance


def test_bfloat16_chunked_prefill_and_prefix_hits_match_transformers_bf16(checkpoint, monkeypatch):
    """bf16 through the step's bf16 prefill kernel (the AMX tiles or vdpbf16ps, whichever this
    CPU runs; none below AVX512-BF16) with chunks after cached context, prefix-cache hits and
    decodes in one step: logits within 0.1 of transformers' bf16 on the same tokens, greedy
    tokens its argmax except at near-ties (top-two gap within 0.1)."""
    from pagedserve.executor.attention import cpu_kernels
    from pagedserve.executor.attention.torch_backend import TorchAttentionBackend

    used, real = set(), TorchAttentionBackend._cpp_prefills
    monkeypatch.setattr(TorchAttentionBackend, "_cpp_prefills", lambda self, kernel, *a: used.add(kernel) or real(self, kernel, *a))
    path = checkpoint("llama")
    hf = load_hf(path, dtype=torch.bfloat16)
    runner = make_runner(path, 16, dtype="bfloat16")
    reqs, logits_at = drive_mixed(runner, 16)
    with torch.inference_mode():
        check_against_hf(hf, reqs, logits_at, tol=0.1, tie=0.1)
    mod = cpu_kernels.load()  # the kernel this CPU's bf16 chunks take (routing: test_attention_backends)
    if mod is not None and cpu_kernels.amx_prefill_usable(mod):
        assert used == {"prefill_amx"}
    elif mod is not None and cpu_kernels.bf16_prefill_usable(mod):
        assert used == {"prefill_bf16"}


@pytest.mark.parametrize(
    "kv_cache_dtype,tol", [("float16", 2e-3), ("bfloat16", 2e-2), ("fp8_e4m3", 0.25), ("fp8_e5m2", 0.8)]
)
def test_narrow_kv_cache_stays_close_to_transformers(checkpoint, kv_cache_dtype, tol):
    """kv_cache_dtype float16 / bfloat16 with a float32 model: K/V rounded once as written,
    read back through every attention path (decode kernel, chunked prefill and prefix hits
    over the gathered cache); logits within a stated tolerance of transformers' float32
    (float16's 11-bit mantissa: ~1e-3; bfloat16's 8: ~1e-2; float8 e4m3fn's 4: ~0.1, e5m2's
    3: ~0.4, measured 0.11 and 0.39 here), half (a quarter) of the bytes per block."""
    path = checkpoint("llama")
    hf = load_hf(path)
    runner = make_runner(path, 16, kv_cache_dtype=kv_cache_dtype)
    kv_dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(kv_cache_dtype)
    kv_dtype = kv_dtype or getattr(torch, kv_cache_dtype)
    assert runner.kv_caches[0][0].dtype == kv_dtype
    assert runner.kv_bytes_per_block(16) * (4 // kv_dtype.itemsize) == make_runner(path, 16).kv_bytes_per_block(16)
    shared = [(11 * i + 5) % 1000 for i in range(40)]
    prompts = [shared + [1, 2, 3], [9] * 3, list(range(100, 171))]
    late = {3: [("late0", shared + [6, 7, 8, 9], 6)]}
    reqs, logits_at, sched = drive(runner, prompts, 8, 16, budget=24, late=late)
    assert sched.kv.prefix_cache_hits >= 32
    worst = 0.0
    for rid, r in reqs.items():
        with torch.inference_mode():
            ref = hf(torch.tensor([r.all_token_ids])).logits[0].float()
        for (q, p), ours in logits_at.items():
            if q == rid:
                worst = max(worst, (ours - ref[p]).abs().max().item())
    assert 0 < worst < tol  # rounded (not float32 after all), and close


def test_narrow_kv_cache_same_numbers_with_or_without_a_prefix_hit(checkpoint):
    """With a float16 cache a fresh prefill attends to its K/V as stored (rounded), like a
    later request that finds the prompt's blocks cached: the same logits either way."""
    path = checkpoint("llama")
    runner = make_runner(path, 16, kv_cache_dtype="float16")
    prompt = [(13 * i + 2) % 1000 for i in range(40)]
    late = {4: [("again", prompt, 4)]}
    reqs, logits_at, sched = drive(runner, [prompt], 4, 16, late=late)
    assert sched.kv.prefix_cache_hits >= 32
    for p in range(len(prompt) - 1, len(prompt) + 3):
        torch.testing.assert_close(logits_at[("again", p)], logits_at[("r0", p)], atol=2e-5, rtol=0)
