"""LoRA adapters (issue 33) against transformers + PEFT: random PEFT adapters (non-zero B)
made at test time on the tiny Llama, several target-module sets, alpha scaling and rsLoRA;
one batch mixing 3 adapters and the base model, with chunked prefill, prefix hits and
preemption; logits within 1e-4 in float32 and identical greedy tokens. Also the batched
grouping against a per-token loop, a packed (int8) base layer, and the refusals."""

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.config import CacheConfig, LoRAConfig, SchedulerConfig
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.executor.loader import load_hf_config_dict
from pagedserve.executor.lora import LoRABatch, LoRALinear, LoRAManager, _StepRef
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.lora import BaseDims, LoRAChecker, LoRARequest, load_peft_adapter
from pagedserve.messages import ModelRunnerOutput
from pagedserve.sampling_params import SamplingParams
from tests.checkpoints import load_hf

TOL = 1e-4
ADAPTERS = {  # name -> (targets, r, alpha, rslora)
    "qv": (["q_proj", "v_proj"], 8, 16, False),
    "all": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 16, 8, True),
    "mlp": (["o_proj", "gate_proj", "up_proj", "down_proj"], 4, 12, False),
}


def make_adapters(path, tmp_path_factory, names=tuple(ADAPTERS)):
    """{name: adapter dir} of PEFT adapters on the checkpoint at `path`, random A and B
    (init_lora_weights=False: B is not zero)."""
    from peft import LoraConfig, get_peft_model

    out = {}
    for i, name in enumerate(names):
        targets, r, alpha, rs = ADAPTERS[name]
        torch.manual_seed(100 + i)
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rs, init_lora_weights=False,
                         lora_dropout=0.0)
        model = get_peft_model(load_hf(path), cfg)
        d = str(tmp_path_factory.mktemp(f"lora_{name}"))
        model.save_pretrained(d)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """(base path, {name: adapter dir})."""
    path = checkpoint("llama")
    return path, make_adapters(path, tmp_path_factory)


def hf_with_adapters(path, dirs):
    from peft import PeftModel

    names = list(dirs)
    model = PeftModel.from_pretrained(load_hf(path), dirs[names[0]], adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(dirs[n], adapter_name=n)
    return model.eval()


def hf_logits(model, name, ids):
    with torch.inference_mode():
        if name is None:
            with model.disable_adapter():
                return model(torch.tensor([ids])).logits[0].float()
        model.set_adapter(name)
        return model(torch.tensor([ids])).logits[0].float()


def lora_runner(path, max_loras=3, quantization=None, block_size=16, num_blocks=200):
    cfg = ModelConfig.from_hf_dict(load_hf_config_dict(path))
    lc = LoRAConfig(enable_lora=True, max_loras=max_loras, max_lora_rank=16)
    runner = ModelRunner(path, cfg, dtype="float32", device="cpu", quantization=quantization, lora=lc)
    runner.initialize_kv_cache(num_blocks, block_size)
    return runner


@torch.inference_mode()
def drive(runner, jobs, block_size=16, num_blocks=200, budget=24, max_loras=3):
    """jobs: [(rid, prompt, max_tokens, LoRARequest | None, arrival step)] through the real
    scheduler (max_loras adapters per step) and runner; our logits at every sampled position."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=512),
                      CacheConfig(block_size=block_size), num_blocks)
    sched.max_loras = max_loras
    reqs, logits_at, step, most = {}, {}, 0, 0
    while sched.has_unfinished_requests() or any(j[4] >= step for j in jobs):
        for rid, prompt, mt, lora, at in jobs:
            if at == step:
                if lora is not None:
                    runner.lora.add_lora(lora)
                p = SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True)
                reqs[rid] = Request(rid, list(prompt), p, max_tokens=mt, lora_request=lora)
                sched.add_request(reqs[rid])
        so = sched.schedule()
        most = max(most, len({sr.req_id.split("-")[0] for sr in so.scheduled if reqs[sr.req_id].lora_request}))
        runner.input_batch.update(so)
        inp = runner.input_batch.prepare(so)
        hidden = runner._forward(inp) if so.scheduled else None
        sampled = {}
        for i, sr in enumerate(inp.order if so.scheduled else []):
            if sr.sample:
                row = runner.model.compute_logits(hidden[int(inp.cu[i + 1]) - 1 : int(inp.cu[i + 1])])[0]
                logits_at[(sr.req_id, sr.num_computed_tokens + len(sr.token_ids) - 1)] = row
                sampled[sr.req_id] = int(row.argmax())
        sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled))
        step += 1
    assert sched.kv.num_used_blocks == 0
    assert most <= max_loras
    return reqs, logits_at, sched


def check(model, reqs, logits_at):
    for rid, r in reqs.items():
        name = r.lora_request.lora_name if r.lora_request else None
        ref = hf_logits(model, name, r.all_token_ids)
        positions = sorted(p for (q, p) in logits_at if q == rid)
        assert len(positions) == r.num_output_tokens
        for p in positions:
            diff = (logits_at[(rid, p)] - ref[p]).abs().max().item()
            assert diff <= TOL, f"{rid} ({name}) position {p}: max |logit diff| {diff:.2e}"
            assert int(ref[p].argmax()) == r.all_token_ids[p + 1], f"{rid} ({name}) greedy token at {p}"


def _jobs(dirs, shared, max_tokens=6):
    loras = {n: LoRARequest(n, i + 1, d) for i, (n, d) in enumerate(dirs.items())}
    names = [*loras, None]
    jobs = []
    for k in range(8):  # every adapter twice (prefix hits within an adapter), the base twice
        name = names[k % 4]
        prompt = shared + [(13 * k + j) % 1000 for j in range(3 + k)]
        jobs.append((f"{name}-{k}", prompt, max_tokens, loras.get(name), k // 3))
    return jobs


def test_mixed_adapters_chunked_prefill_prefix_hits_match_peft(adapters):
    path, dirs = adapters
    model = hf_with_adapters(path, dirs)
    runner = lora_runner(path)
    shared = [(11 * i + 5) % 1000 for i in range(40)]
    reqs, logits_at, sched = drive(runner, _jobs(dirs, shared))
    assert sched.kv.prefix_cache_hits >= 32  # the same adapter's (and the base's) shared prefix
    check(model, reqs, logits_at)
    # adapters change the outputs (non-zero B): the base model's tokens differ somewhere
    base = [r.output_token_ids for r in reqs.values() if r.lora_request is None]
    assert any(r.output_token_ids not in base for r in reqs.values() if r.lora_request)


def test_lru_slots_and_preemption_match_peft(adapters):
    """max_loras=2 for 3 adapters (the scheduler holds the third back, slots are evicted
    and refilled), and a KV cache small enough to preempt."""
    path, dirs = adapters
    model = hf_with_adapters(path, dirs)
    runner = lora_runner(path, max_loras=2, block_size=8, num_blocks=12)
    shared = [(7 * i + 2) % 1000 for i in range(10)]
    jobs = _jobs(dirs, shared, max_tokens=14)
    reqs, logits_at, sched = drive(runner, jobs, block_size=8, num_blocks=12, budget=32, max_loras=2)
    assert sched.num_preemptions > 0
    check(model, reqs, logits_at)


def test_grouped_products_equal_a_per_token_loop():
    torch.manual_seed(0)
    slots, rank, d_in, d_out = 4, 8, 24, 40
    a, b = torch.randn(slots, d_in, rank), torch.randn(slots, rank, d_out)
    for token_slots in ([2, -1, 0, 2, 3, -1, 0, 0], [1] * 30 + [0, 3], [-1, 3]):  # padded, segments, one row
        ts = np.array(token_slots)
        x, y = torch.randn(len(ts), d_in), torch.randn(len(ts), d_out)
        want = y.clone()
        for t, s in enumerate(ts):
            if s >= 0:
                want[t] += x[t] @ a[s] @ b[s]
        got = LoRABatch(ts, torch.device("cpu")).apply(x, y.clone(), a, b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_packed_base_gets_the_same_delta(adapters, quantization):
    """Over a QuantLinear (int8 / int4 packed) the adapter's delta is added to the packed
    layer's output: wrapper(x) - base(x) == x @ A^T @ B^T * scale."""
    path, dirs = adapters
    runner = lora_runner(path, quantization=quantization)
    lin = runner.lora.layers[1]["qkv_proj"]
    assert type(lin.base).__name__ == "QuantLinear"
    req = LoRARequest("all", 1, dirs["all"])
    slot = runner.lora._slot_for(req, {1})
    a, b, scale, _ = runner.lora.cpu[1].modules[(1, "v_proj")]
    x = torch.randn(5, lin.base.in_features)
    runner.lora.ref.batch = LoRABatch(np.array([slot] * 5), torch.device("cpu"))
    try:
        delta = lin(x) - lin.base(x)
    finally:
        runner.lora.end_step()
    d = runner.lora.dims
    torch.testing.assert_close(delta[:, d.q_out + d.kv_out :], x @ a.t() @ b.t() * scale, rtol=1e-4, atol=1e-4)
    assert isinstance(lin, LoRALinear) and isinstance(runner.lora.ref, _StepRef)


def _copy(src, dst, cfg_edit=None, tensors_edit=None):
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "adapter_config.json")) as f:
        cfg = json.load(f)
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    if cfg_edit:
        cfg_edit(cfg)
    if tensors_edit:
        tensors = tensors_edit(tensors)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    return dst


def test_refusals_name_what_is_wrong(adapters, tmp_path):
    path, dirs = adapters
    dims = BaseDims.of(ModelConfig.from_hf_dict(load_hf_config_dict(path)))
    with pytest.raises(ValueError, match="rank 16 is over max_lora_rank=8"):
        load_peft_adapter("all", dirs["all"], dims, max_rank=8, tensors=False)
    narrow = _copy(dirs["qv"], str(tmp_path / "narrow"), tensors_edit=lambda t: {
        k: (v[:, :-1].contiguous() if "lora_A" in k else v) for k, v in t.items()})
    with pytest.raises(ValueError, match="wrong base shape.*q_proj of layer 0"):
        load_peft_adapter("narrow", narrow, dims, 16)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="missing adapter_config.json"):
        load_peft_adapter("empty", str(tmp_path / "empty"), dims, 16)
    no_weights = _copy(dirs["qv"], str(tmp_path / "nw"))
    os.remove(os.path.join(no_weights, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="missing adapter_model.safetensors"):
        load_peft_adapter("nw", no_weights, dims, 16)
    dora = _copy(dirs["qv"], str(tmp_path / "dora"), cfg_edit=lambda c: c.update(use_dora=True))
    with pytest.raises(ValueError, match="use_dora"):
        load_peft_adapter("dora", dora, dims, 16)
    checker = LoRAChecker(True, 16, dims)
    checker.check(LoRARequest("qv", 1, dirs["qv"]))
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter"):
        checker.check(LoRARequest("mlp", 1, dirs["mlp"]))
    with pytest.raises(ValueError, match="without enable_lora"):
        LoRAChecker(False, 16, dims).check(LoRARequest("qv", 1, dirs["qv"]))
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, dirs["qv"])
    assert LoRAManager is not None


def _loading_off_the_step_loop(llm, prompt, want, mlp_dir):
    """An adapter read on the loader thread: its request waits while a base request runs;
    then it runs with the right tokens. A read that fails aborts its request alone."""
    import threading

    import pagedserve.executor.lora as lora_mod

    engine, gate, real = llm.engine, threading.Event(), lora_mod.load_peft_adapter
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    def slow(*a, **kw):
        assert gate.wait(30)
        return real(*a, **kw)

    lora_mod.load_peft_adapter = slow
    try:
        slow_id = engine.add_request(None, prompt, sp, lora_request=LoRARequest("mlp2", 7, mlp_dir))
        base_id = engine.add_request(None, prompt, sp)
        done = {}
        for _ in range(12):
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert base_id in done and slow_id not in done  # the base request ran meanwhile
        gate.set()
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert list(done[slow_id].outputs[0].token_ids) == want
        lora_mod.load_peft_adapter = lambda *a, **kw: (_ for _ in ()).throw(OSError("disk gone"))
        bad = engine.add_request(None, prompt, sp, lora_request=LoRARequest("mlp3", 8, mlp_dir))
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert done[bad].outputs[0].finish_reason == "abort"
    finally:
        lora_mod.load_peft_adapter = real


def test_llm_generate_per_prompt_adapters(adapters):
    """The offline API: one LoRARequest per prompt (and None: the base), greedy tokens as
    transformers + PEFT's; a bad adapter is a ValueError before anything runs."""
    from pagedserve import LLM

    path, dirs = adapters
    model = hf_with_adapters(path, dirs)
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, skip_tokenizer_init=True,
              num_kv_blocks=64)
    loras = [LoRARequest("qv", 1, dirs["qv"]), None, LoRARequest("mlp", 3, dirs["mlp"])]
    prompts = [{"prompt_token_ids": [(5 * i + k) % 1000 for i in range(20)]} for k in range(3)]
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
    outs_by_prompt = [o.outputs[0].token_ids for o in outs]
    for p, lora, out in zip(prompts, loras, outs):
        ids = list(p["prompt_token_ids"])
        for _ in range(5):
            ids.append(int(hf_logits(model, lora.lora_name if lora else None, ids)[-1].argmax()))
        assert list(out.outputs[0].token_ids) == ids[20:]
    # unloading an adapter in use: its running request finishes with it, then it is gone
    engine, manager = llm.engine, llm.engine.engine_core.executor.runner.lora
    rid = engine.add_request(None, prompts[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                             lora_request=loras[0])
    engine.step()
    engine.remove_lora(1)
    assert 1 in manager.cpu and 1 in manager.resident
    outs = [o for _ in range(20) if engine.has_unfinished_requests() for o in engine.step()]
    assert [o.request_id for o in outs if o.finished] == [rid] and len(outs[-1].outputs[0].token_ids) == 8
    assert 1 not in manager.cpu and 1 not in manager.resident and len(manager.free_slots) >= 1
    _loading_off_the_step_loop(llm, prompts[2], list(outs_by_prompt[2]), dirs["mlp"])
    with pytest.raises(ValueError, match="rank 16 is over"):
        LLM(path, enable_lora=True, max_lora_rank=8, skip_tokenizer_init=True, num_kv_blocks=16).generate(
            prompts[:1], sp, use_tqdm=False, lora_request=LoRARequest("all", 2, dirs["all"]))
    llm.shutdown()


# -- the fused C++ shrink+expand (ops/csrc/lora_kernels.cpp) against the PyTorch path -------------
KERNEL_ISAS = {"avx2": 1, "avx512": 2, "avx512_bf16": 3}


def _lora_kernels_at(isa: str):
    from pagedserve.executor import lora as xlora

    k = xlora.load_kernels()
    if k is None:
        pytest.skip("LoRA kernels unavailable here (no compiler or no AVX2): the PyTorch path runs")
    if not k.isa_available(KERNEL_ISAS[isa]):
        pytest.skip(f"this CPU lacks {isa}")
    return k


def _delta_loop(ts, x, y, a, b):
    """y + each token's (x @ A) @ B in float64, h rounded to x's dtype (as the bf16 products round it)."""
    want = y.double().clone()
    for t, s in enumerate(ts):
        if s >= 0:
            want[t] += (x[t].double() @ a[s].double()).to(x.dtype).double() @ b[s].double()
    return want


def _random_layer(in_features, part_outs, rank, dtype, slots=4):
    lin = LoRALinear(torch.nn.Linear(in_features, sum(part_outs), bias=False).to(dtype), in_features, part_outs,
                     slots, rank, _StepRef(), dtype, "cpu")
    for s in range(slots):
        r = rank - s % 2 * 2  # a rank under the max: zero-padded
        lin.set_slot(s, [None if (s + p) % 3 == 2 else (torch.randn(r, in_features), torch.randn(o, r), 0.5, r)
                         for p, o in enumerate(part_outs)])
    return lin


@pytest.mark.parametrize("isa", list(KERNEL_ISAS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_kernel_matches_the_pytorch_path(isa, dtype):
    """Fused q/k/v-like and single-part layers, segments longer than a tile, base rows, ranks
    under the max: the kernel's y equals the float64 loop (float32: to 1e-5; bfloat16: y's own
    rounding) and is no further from it than the PyTorch path (bmm + index_add)."""
    from pagedserve.executor import lora as xlora

    k = _lora_kernels_at(isa)
    torch.manual_seed(1)
    prev = k.set_isa(KERNEL_ISAS[isa])
    try:
        for in_features, part_outs, rank in ((38, [30, 10, 10], 6), (24, [40], 4), (64, [100, 12], 16)):
            lin = _random_layer(in_features, part_outs, rank, dtype)
            assert lin.packed == (dtype == torch.bfloat16 and k.get_isa() == 3)
            a, b = lin.weights()
            for token_slots in ([2, -1, 0, 2, 3, -1, 0, 0], [1] * 19 + [0, 3, -1] + [2] * 9, [-1, 3]):
                ts = np.array(token_slots)
                x = torch.randn(len(ts), in_features).to(dtype)
                lin.ref.batch = LoRABatch(ts, torch.device("cpu"))
                got = lin(x).double()
                xlora.use_kernel = False
                try:
                    ref = lin(x).double()
                finally:
                    xlora.use_kernel = True
                want = _delta_loop(ts, x, lin.base(x), a, b)
                scale = want.abs() + 1
                err, ref_err = ((got - want).abs() / scale).max(), ((ref - want).abs() / scale).max()
                assert err <= (1e-5 if dtype == torch.float32 else max(8e-3, ref_err)), (token_slots, err, ref_err)
                assert (got - lin.base(x).double()).abs().max() > 0.1  # the delta is there
    finally:
        k.set_isa(prev)


def test_bf16_runner_with_kernels_stays_as_close_to_peft(adapters):
    """A bfloat16 runner (the packed bf16 kernel where the CPU has avx512_bf16, else the AVX
    kernel or PyTorch): mixed adapters in chunked prefill steps, logits against PEFT in
    float32, no further off than the same runner on the PyTorch path."""
    from pagedserve.executor import lora as xlora

    path, dirs = adapters
    model = hf_with_adapters(path, dirs)
    cfg = ModelConfig.from_hf_dict(load_hf_config_dict(path))
    runner = ModelRunner(path, cfg, dtype="bfloat16", device="cpu",
                         lora=LoRAConfig(enable_lora=True, max_loras=3, max_lora_rank=16))
    runner.initialize_kv_cache(200, 16)
    jobs = _jobs(dirs, [(7 * i + 2) % 1000 for i in range(10)], max_tokens=1)
    errs = {}
    for use in (True, False):
        xlora.use_kernel = use
        try:
            reqs, logits_at, _ = drive(runner, jobs)
        finally:
            xlora.use_kernel = True
        worst = 0.0
        for rid, r in reqs.items():
            name = r.lora_request.lora_name if r.lora_request else None
            ref = hf_logits(model, name, r.all_token_ids)
            worst = max(worst, max((logits_at[(q, p)].float() - ref[p]).abs().max().item()
                                   for (q, p) in logits_at if q == rid))
        errs[use] = worst
    off = (hf_logits(model, "all", jobs[1][1]) - hf_logits(model, None, jobs[1][1])).abs().max().item()
    assert errs[True] <= 1.25 * errs[False] + 1e-3, errs
    assert errs[True] < off / 4, (errs, off)  # bf16 rounding, not a lost adapter
