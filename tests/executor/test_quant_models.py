"""Packed weights end to end: tiny checkpoints written as GGUF with each block type run packed
(the default for a GGUF) with the same greedy tokens and logprobs as the dequantized float
model (quantization="none"); int8 / int4 of a safetensors checkpoint stay close to float."""

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from pagedserve.executor.attention import get_attention_backend  # noqa: E402
from pagedserve.executor.loader import build_model, load_hf_config_dict, resolve_model_path  # noqa: E402
from pagedserve.executor.model_config import ModelConfig  # noqa: E402
from pagedserve.executor.model_runner import ModelRunner  # noqa: E402
from pagedserve.executor.quant import kernels  # noqa: E402
from pagedserve.executor.quant.copy_budget import CopyPolicy  # noqa: E402
from pagedserve.executor.quant.layers import QuantEmbedding, QuantLinear  # noqa: E402
from tests.checkpoints import build_checkpoint  # noqa: E402
from tests.executor.test_gguf import write_gguf  # noqa: E402

try:
    kernels.load()
    WHY = ""
except Exception as e:  # noqa: BLE001
    WHY = f"quant kernels do not build here: {e}"
pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY or "-")

PROMPTS = [[(13 * i + 4 + 7 * j) % 1000 for i in range(9 + 5 * j)] for j in range(3)]
K_QUANTS = {Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def fake_kquant(a, qtype):
    """gguf cannot quantize K-quants: random blocks with small scales stand in (both runs see
    the same file, which is all the packed-vs-dequantized comparison needs)."""
    rng = np.random.default_rng(a.size)
    be, bb = gguf.GGML_QUANT_SIZES[qtype]
    n, k = a.shape
    raw = rng.integers(0, 256, size=(n, k // be, bb), dtype=np.uint8)
    for off in K_QUANTS[qtype]:
        raw[..., off : off + 2] = (
            rng.uniform(0, 4e-4, size=(n, k // be)).astype(np.float16).view(np.uint8).reshape(n, k // be, 2)
        )
    if qtype == Q.Q6_K:  # int8 sub-block scales: keep them small too
        raw[..., 192:208] = rng.integers(-8, 8, size=(n, k // be, 16), dtype=np.int8).view(np.uint8)
    return raw.reshape(n, -1)


@pytest.fixture(scope="module")
def kquant_checkpoint(tmp_path_factory):
    # every matrix dimension a multiple of 256 (K-quant blocks), vocab odd
    return build_checkpoint(
        str(tmp_path_factory.mktemp("kq")),
        "llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1001,
    )


def write_quant_gguf(qtype, tmp_path, monkeypatch, kquant_dir, checkpoint=None) -> str:
    """A GGUF of `qtype` in tmp_path: a K-quant from kquant_dir (gguf has no quantizer for them:
    fake_kquant's random blocks, patched in for this test), any other type from
    checkpoint("llama")."""
    if qtype in K_QUANTS:
        real = gguf.quants.quantize
        monkeypatch.setattr(gguf.quants, "quantize", lambda a, t: fake_kquant(a, t) if t in K_QUANTS else real(a, t))
        hf_dir = kquant_dir
    else:
        hf_dir = checkpoint("llama")
    return write_gguf(hf_dir, str(tmp_path / f"{qtype.name}.gguf"), qtype)


def run(path, quantization, dtype="float32", **runner_kw):
    """Greedy decoding of PROMPTS through the real scheduler and runner: (tokens, logits)."""
    from tests.executor.test_model_parity import drive

    model_dir = resolve_model_path(path)
    cfg = ModelConfig.from_hf_dict(load_hf_config_dict(model_dir))
    runner = ModelRunner(model_dir, cfg, dtype=dtype, device="cpu", quantization=quantization, **runner_kw)
    runner.initialize_kv_cache(64, 16)
    reqs, logits_at, _ = drive(runner, PROMPTS, 10, 16)
    return {rid: r.all_token_ids for rid, r in reqs.items()}, logits_at


def assert_same(a, b, rel):
    """Same greedy tokens; logits within `rel` of the largest logit magnitude."""
    assert a[0] == b[0]
    for key, la in a[1].items():
        lb = b[1][key]
        assert (la - lb).abs().max().item() <= rel * la.abs().max().item(), key


def assert_close_where_inputs_agree(got, ref, rel):
    """Logits within `rel` of the largest wherever both runs saw the same tokens so far (bf16
    paths round differently, so a near-tie may send a random model's greedy run elsewhere);
    at least one step per prompt compared."""
    worst, compared = 0.0, 0
    for (rid, pos), la in ref[1].items():
        if ref[0][rid][: pos + 1] == got[0][rid][: pos + 1]:
            compared += 1
            worst = max(worst, (la - got[1][(rid, pos)]).abs().max().item() / la.abs().max().item())
    assert compared >= len(PROMPTS) and worst <= rel, (compared, worst)


def packed_modules(path, quantization):
    cfg = ModelConfig.from_hf_dict(load_hf_config_dict(path))
    model = build_model(
        path,
        cfg,
        torch.float32,
        torch.device("cpu"),
        get_attention_backend("torch", "cpu"),
        quantization=quantization,
    )
    return {type(m).__name__ for m in model.modules()}


@pytest.mark.parametrize(
    "qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name
)
def test_packed_gguf_matches_dequantized(checkpoint, kquant_checkpoint, tmp_path, monkeypatch, qtype):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_quant_gguf(qtype, tmp_path, monkeypatch, kquant_checkpoint, checkpoint)
    converted = resolve_model_path(path)
    mods = packed_modules(converted, None)
    assert "QuantLinear" in mods and "QuantEmbedding" in mods and "Linear" not in mods
    assert "QuantLinear" not in packed_modules(converted, "none")
    assert_same(run(path, None), run(path, "none"), 1e-4)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.Q5_K], ids=lambda t: t.name)
def test_gguf_q8_activations_close_to_float_activations(checkpoint, kquant_checkpoint, tmp_path, monkeypatch, qtype):
    """quantization="gguf_q8" (the named llama.cpp-style option): the same packed layers with
    act_q8 set (Q4_K's and Q5_K's too; Q5_K's from 9 rows on AVX-512 levels, so the prompts'
    prefill); logits within 5% of the largest logit of the float-activation path
    where the inputs agree, and not equal to it (the option must change the arithmetic)."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_quant_gguf(qtype, tmp_path, monkeypatch, kquant_checkpoint, checkpoint)
    ref, got = run(path, None), run(path, "gguf_q8")
    worst = 0.0
    for (rid, pos), la in ref[1].items():
        if ref[0][rid][: pos + 1] == got[0][rid][: pos + 1]:
            worst = max(worst, (la - got[1][(rid, pos)]).abs().max().item() / la.abs().max().item())
    assert 0.0 < worst <= 0.05, worst
    with pytest.raises(ValueError, match="GGUF"):
        packed_modules(checkpoint("llama"), "gguf_q8")


@pytest.mark.skipif(
    bool(WHY) or "avx512_bf16" not in kernels.available_isas(), reason=WHY or "this CPU lacks avx512_bf16"
)
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_bf16_model_products_on_bf16_units(checkpoint, tmp_path, monkeypatch, qtype):
    """A bfloat16 engine of a packed GGUF runs its prefill products on the bf16 many-row kernel
    (the weights' exact quants against bf16 activations): logits within 2% of the largest logit
    of the same engine with that kernel off (set_bf16_rows; few-row products stay on the
    interleaved copies' kernel in both) where the inputs agree; a float32 engine never takes it."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(checkpoint("llama"), str(tmp_path / f"{qtype.name}.gguf"), qtype)
    monkeypatch.setenv("PAGEDSERVE_NO_ONEDNN_PACK", "1")  # the kernel, not the bf16 copies
    mod = kernels.load()
    old, isa = kernels.set_bf16_rows(10**9), kernels.set_isa("avx512_bf16")
    try:
        ref = run(path, None, "bfloat16")
        kernels.set_bf16_rows(6)
        before = mod.bf16_calls()[0]
        got = run(path, None, "bfloat16")
        assert mod.bf16_calls()[0] > before
        assert_close_where_inputs_agree(got, ref, 0.02)
        before = mod.bf16_calls()[0]
        run(path, None, "float32")
        assert mod.bf16_calls()[0] == before
    finally:
        kernels.set_bf16_rows(old)
        kernels.set_isa(isa)


HAVE_BF16 = not WHY and "avx512_bf16" in kernels.available_isas()
needs_native_bf16 = pytest.mark.skipif(not HAVE_BF16, reason=WHY or "this CPU lacks AVX512-BF16 (bf16 copies need native bf16)")


@needs_native_bf16
def test_bf16_copy_layer_equals_dequantized_bf16_product():
    """QuantLinear.attach_bf16_copy: from its row threshold a bf16 product is x @ the weight
    dequantized and rounded once to bf16 (+ bias), up to the bf16 output's rounding; below it
    the packed kernels' result to the bit; float32 activations never take it. Three segments
    (Q4_1, Q6_K, float rows), odd N, K = 512, M = 1, 3, 16, 17, 64, 300."""
    from pagedserve.executor.quant.formats import PackedWeight
    from tests.executor.test_quant_kernels import random_packed

    k, parts = 512, [24, 13, 5]
    raws = [random_packed(Q.Q4_1, 24, k, seed=1), random_packed(Q.Q6_K, 13, k, seed=2)]
    f32 = torch.randn(5, k, generator=torch.Generator().manual_seed(3)) * 0.05
    bias = torch.nn.Parameter(torch.randn(sum(parts)).bfloat16(), requires_grad=False)
    plain, copied = QuantLinear(k, parts, bias), QuantLinear(k, parts, bias)
    for layer in (plain, copied):
        layer.set_part(0, PackedWeight(int(Q.Q4_1), torch.from_numpy(raws[0]), (24, k)))
        layer.set_part(1, PackedWeight(int(Q.Q6_K), torch.from_numpy(raws[1]), (13, k)))
        layer.set_part(2, f32)
    copied.attach_bf16_copy(16)
    assert copied.copy_bytes >= sum(parts) * k * 2 and plain.copy_bytes == 0
    w = torch.cat([torch.from_numpy(gguf.quants.dequantize(r, t).reshape(-1, k)) for r, t in zip(raws, (Q.Q4_1, Q.Q6_K))])
    wb = torch.cat([w, f32]).bfloat16().double()
    for m in (1, 3, 16, 17, 64, 300):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        got = copied(x)
        if m < 16:
            assert torch.equal(got, plain(x)), m
            continue
        ref = x.double() @ wb.T + bias.double()
        mag = x.double().abs() @ wb.abs().T
        assert got.dtype == torch.bfloat16 and got.shape == (m, sum(parts))
        assert torch.all((got.double() - ref).abs() <= ref.abs() / 128 + 1e-5 * mag + 1e-6), m
        assert torch.equal(copied(x.float()), plain(x.float())), m  # a float32 model: never


def quant_layers(model_dir, dtype, quantization=None, weight_copies=None) -> list[QuantLinear]:
    """The packed layers of a CPU model built from model_dir (as the engine loads it)."""
    cfg = ModelConfig.from_hf_dict(load_hf_config_dict(model_dir))
    backend = get_attention_backend("torch", "cpu")
    model = build_model(model_dir, cfg, dtype, torch.device("cpu"), backend, "auto", quantization, weight_copies)
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


@needs_native_bf16
def test_bf16_copies_where_and_only_where_they_apply(checkpoint, tmp_path, monkeypatch):
    """A bf16 engine of a packed GGUF keeps bf16 copies on the native-bf16 paths only
    (avx512_bf16 and the AMX ones): not in float32, not under gguf_q8 (its integer numerics),
    not with PAGEDSERVE_CPU_ISA below avx512_bf16, not with PAGEDSERVE_NO_ONEDNN_PACK=1. With
    copies for every row count its greedy tokens are those of the dequantized bf16 model
    (quantization="none": the same bf16 weights on oneDNN), logits within 1% of the largest. On
    AMX the Q4_1 layers' many-row products run on the tiles over their interleaved copies,
    with the tokens of the engine that runs them on the bf16 copies."""
    from pagedserve.executor import onednn_linear
    from pagedserve.executor.quant import layers

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(onednn_linear, "SPLIT_GATE_UP", False)  # the unfused MLP on both (its rounding)
    path = write_gguf(checkpoint("llama"), str(tmp_path / "q4_1.gguf"), Q.Q4_1)
    converted = resolve_model_path(path)

    def copies(dtype, quantization=None):
        return sum(m.copy_bytes > 0 for m in quant_layers(converted, dtype, quantization))

    per_model = 4 * 2 + 1  # qkv, o, gate_up, down per layer (2 layers) + the tied head
    isa = kernels.set_isa(kernels.available_isas()[-1])  # the best path, whatever PAGEDSERVE_CPU_ISA chose
    try:
        assert copies(torch.bfloat16) == per_model
        if kernels.amx_rows16(Q.Q4_1):  # AMX: the tiles read the Q4_1 layers' interleaved copies (amx_copy_min_rows)
            before = kernels.load().bf16_calls()[3]
            tiles = run(path, None, "bfloat16")
            assert kernels.load().bf16_calls()[3] > before
            amx_rows = layers.AMX_COPY_MIN_ROWS
            monkeypatch.setattr(layers, "AMX_COPY_MIN_ROWS", 9)
            assert_same(tiles, run(path, None, "bfloat16"), 1e-3)  # the same bf16 weights on oneDNN's tiles
            monkeypatch.setattr(layers, "AMX_COPY_MIN_ROWS", amx_rows)
        assert copies(torch.float32) == 0 and copies(torch.bfloat16, "gguf_q8") == 0
        kernels.set_isa("avx512_vnni")
        assert copies(torch.bfloat16) == 0
        kernels.set_isa("avx512_bf16")
        assert copies(torch.bfloat16) == per_model
        monkeypatch.setenv("PAGEDSERVE_NO_ONEDNN_PACK", "1")
        assert copies(torch.bfloat16) == 0
        monkeypatch.delenv("PAGEDSERVE_NO_ONEDNN_PACK")
        monkeypatch.setattr(layers, "BF16_COPY_MIN_ROWS", 1)
        monkeypatch.setattr(layers, "ROWS16_COPY_MIN_ROWS", 1)  # layers with interleaved copies too
        assert_same(run(path, None, "bfloat16"), run(path, "none", "bfloat16"), 1e-2)
    finally:
        kernels.set_isa(isa)


HAVE_AMX = HAVE_BF16 and "amx_bf16" in kernels.available_isas()


@pytest.mark.skipif(not HAVE_AMX, reason=WHY or "this CPU lacks AMX-BF16 (or Linux refused the tiles)")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_a_k_quant_engine_runs_its_many_rows_on_the_amx_tiles(kquant_checkpoint, tmp_path, monkeypatch, qtype):
    """On an AMX path a bf16 engine of a Q4_K / Q5_K / Q6_K (its six-bit copies) file runs its
    9-159-row products on the tile kernel over the row-interleaved copies, with the greedy
    tokens and logits (within 0.1% of the largest) of the same engine running them on the
    oneDNN bf16 copies: the same weights."""
    from pagedserve.executor import onednn_linear
    from pagedserve.executor.quant import layers

    if qtype == Q.Q6_K and not kernels.q6k_six_bits():
        pytest.skip("Q6_K's tiles read its six-bit copies (AVX512-VBMI)")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(onednn_linear, "SPLIT_GATE_UP", False)  # the unfused MLP on both (its rounding)
    path = write_quant_gguf(qtype, tmp_path, monkeypatch, kquant_checkpoint)
    isa = kernels.set_isa(kernels.available_isas()[-1])
    try:
        layers_ = quant_layers(resolve_model_path(path), torch.bfloat16)
        assert sum(m.amx_rows16_everywhere for m in layers_) == 4 * 2  # the head (1,001 rows): no copy
        before = kernels.load().bf16_calls()[3]
        tiles = run(path, None, "bfloat16")
        assert kernels.load().bf16_calls()[3] > before
        monkeypatch.setattr(layers, "AMX_COPY_MIN_ROWS", 9)
        assert_same(tiles, run(path, None, "bfloat16"), 1e-3)
    finally:
        kernels.set_isa(isa)


@pytest.mark.skipif(not HAVE_AMX, reason=WHY or "this CPU lacks AMX-BF16 (or Linux refused the tiles)")
def test_bf16_speculation_on_the_exact_tiles_gives_the_greedy_tokens_of_plain_decode(kquant_checkpoint, tmp_path, monkeypatch):
    """On an AMX path a bf16 engine of a Q4_K file runs its 1-16-row products on the exact tile
    kernel, which computes each row alone: n-gram speculation's verification rows (k + 1 at
    once) give the logits of 1-row decode steps, so the same greedy tokens as plain decode, with
    some guesses accepted. Ten guesses: verification steps of up to 11 rows. (Q6_K's one-row
    products stay on its bf16 kernel: not this test's.)"""
    from pagedserve import LLM, SamplingParams

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_quant_gguf(Q.Q4_K, tmp_path, monkeypatch, kquant_checkpoint)
    isa = kernels.set_isa(kernels.available_isas()[-1])
    try:
        kw = dict(dtype="bfloat16", max_model_len=256, num_kv_blocks=200)
        sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        prompts = [{"prompt_token_ids": ([7, 8, 9, 10, 11] * 6)[:20]}]
        base = LLM(path, **kw).generate(prompts, sp, use_tqdm=False)
        spec = {"method": "ngram", "num_speculative_tokens": 10, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        llm = LLM(path, speculative_config=spec, **kw)
        before = kernels.load().bf16_calls()[4]
        got = llm.generate(prompts, sp, use_tqdm=False)
        assert kernels.load().bf16_calls()[4] > before
        assert got[0].outputs[0].token_ids == base[0].outputs[0].token_ids
        assert llm.get_stats().spec_num_accepted_tokens > 0
    finally:
        kernels.set_isa(isa)


@pytest.mark.skipif(not HAVE_AMX, reason=WHY or "this CPU lacks AMX-BF16 (or Linux refused the tiles)")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_a_long_k_layer_leaves_the_tiles_after_one_chunk_of_rows(qtype):
    """The AMX tile kernel takes 64 rows at a time at K = 8,192 (past them it would dequantize the
    weights again): such a layer (Q4_K, Q6_K's six-bit copy) runs 17-64 rows on the tiles and 65
    and more on its bf16 copy; K = 768 one chunk of 320 rows, K = 512 one of 512: the copy from
    AMX_COPY_MIN_ROWS (512) there."""
    from pagedserve.executor.quant import layers
    from pagedserve.executor.quant.formats import PackedWeight
    from tests.executor.test_quant_kernels import random_packed

    if qtype == Q.Q6_K and not kernels.q6k_six_bits():
        pytest.skip("Q6_K's tiles read its six-bit copies (AVX512-VBMI)")
    mod = kernels.load()
    isa = kernels.set_isa(kernels.available_isas()[-1])
    try:
        for k, first_copy_row in ((8192, 65), (768, 321), (512, layers.AMX_COPY_MIN_ROWS)):
            lin = QuantLinear(k, [32], None)
            lin.set_part(0, PackedWeight(int(qtype), torch.from_numpy(random_packed(qtype, 32, k, seed=k)), (32, k)))
            assert lin.attach_rows16() and lin.amx_rows16_everywhere
            assert layers.amx_copy_min_rows(k) == first_copy_row
            assert layers.bf16_copies(lin, torch.bfloat16) == 1
            for m in (17, first_copy_row - 1, first_copy_row):  # (1-16 rows of Q4_K: the exact kernel)
                before = mod.bf16_calls()[3]
                lin(torch.randn(m, k).bfloat16())
                assert (mod.bf16_calls()[3] - before == 1) == (m < first_copy_row), (k, m)
    finally:
        kernels.set_isa(isa)


@pytest.mark.skipif(not HAVE_AMX, reason=WHY or "this CPU lacks AMX-BF16 (or Linux refused the tiles)")
def test_gate_up_copies_as_halves_run_the_mlp_fused(checkpoint, tmp_path, monkeypatch):
    """On AMX a bf16 Q4_1 engine keeps each dense MLP's gate_up bf16 copy as its gate and up
    halves (the same bytes; every other layer one packed copy): its products from
    AMX_COPY_MIN_ROWS rows (prefill chunks) run fused (onednn_linear.packed_silu_mul), fewer
    rows on the tiles as before. Greedy runs with the halves and with one copy (the unfused
    MLP) agree within bf16's rounding wherever they saw the same tokens. Not with
    silu_halves=False (LoRA adds to the whole gate_up output)."""
    from pagedserve.executor import onednn_linear
    from pagedserve.executor.quant import layers

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(checkpoint("llama"), str(tmp_path / "q4_1.gguf"), Q.Q4_1)
    converted = resolve_model_path(path)
    isa = kernels.set_isa(kernels.available_isas()[-1])
    try:
        split = quant_layers(converted, torch.bfloat16)
        halves = [m for m in split if m.silu_halves is not None]
        assert len(halves) == 2 and all(m._dense is None and m.parts == [m.parts[0]] * 2 for m in halves)
        assert all(m._dense is not None for m in split if m not in halves)
        monkeypatch.setattr(onednn_linear, "SPLIT_GATE_UP", False)
        whole = quant_layers(converted, torch.bfloat16)
        assert [m.copy_bytes for m in split] == [m.copy_bytes for m in whole]
        unfused = run(path, None, "bfloat16")
        monkeypatch.setattr(onednn_linear, "SPLIT_GATE_UP", True)
        cfg = ModelConfig.from_hf_dict(load_hf_config_dict(converted))
        lora_model = build_model(
            converted, cfg, torch.bfloat16, torch.device("cpu"), get_attention_backend("torch", "cpu"), silu_halves=False
        )
        assert not any(getattr(m, "silu_halves", None) for m in lora_model.modules())
        calls = []
        real = onednn_linear.packed_silu_mul
        monkeypatch.setattr(onednn_linear, "packed_silu_mul", lambda x, g, u: calls.append(x.shape[0]) or real(x, g, u))
        monkeypatch.setattr(layers, "AMX_COPY_MIN_ROWS", 9)  # the prompts' prefill rows
        fused = run(path, None, "bfloat16")
        assert calls and min(calls) >= 9
        assert_close_where_inputs_agree(fused, unfused, 2e-2)
    finally:
        kernels.set_isa(isa)


@needs_native_bf16
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_k_quant_copies_where_a_kernel_reads_them(kquant_checkpoint, tmp_path, monkeypatch, qtype):
    """Q4_K / Q5_K / Q6_K layers get row-interleaved copies in a bfloat16 engine on a
    native-bf16 path (the bf16 few-row kernel's) and in float32 or below avx512_bf16 (the float
    kernel's). A bf16 engine's
    decode steps on them give the greedy tokens of the same engine with the bf16 few-row kernel
    off (the float kernel), and a float32 engine's those of one without copies (the packed
    blocks), logits within 1% of the largest."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_quant_gguf(qtype, tmp_path, monkeypatch, kquant_checkpoint)
    converted = resolve_model_path(path)
    monkeypatch.setenv("PAGEDSERVE_NO_ONEDNN_PACK", "1")  # few-row products alone, every row count below

    def with_copies(dtype):
        return sum(m.rows16_everywhere for m in quant_layers(converted, dtype))

    every = 4 * 2  # qkv, o, gate_up, down x 2 layers (the head: 1,001 rows)
    isa = kernels.set_isa("avx512_bf16")
    try:
        assert with_copies(torch.bfloat16) == every
        assert with_copies(torch.float32) == every
        kernels.set_isa("avx512")
        assert with_copies(torch.bfloat16) == every
        kernels.set_isa("avx512_bf16")
        before = kernels.load().bf16_calls()[2]
        got = run(path, None, "bfloat16")
        assert kernels.load().bf16_calls()[2] > before
        assert kernels.set_rows16_bf16(False) is True
        assert_same(got, run(path, None, "bfloat16"), 1e-2)
        kernels.set_rows16_bf16(None)
        before = kernels.load().rows16_calls()
        got = run(path, None, "float32")
        assert kernels.load().rows16_calls() > before
        assert_same(got, run(path, None, "float32", weight_copies=CopyPolicy("none")), 1e-2)
    finally:
        kernels.set_rows16_bf16(None)
        kernels.set_isa(isa)


@pytest.mark.skipif(bool(WHY) or "avx2" not in kernels.available_isas(), reason=WHY or "this CPU lacks avx2")
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_avx2_engine_decodes_on_the_copies(checkpoint, kquant_checkpoint, tmp_path, monkeypatch, qtype):
    """On the AVX2 path (a CPU without AVX-512, or PAGEDSERVE_CPU_ISA=avx2) a float32 engine keeps
    the row-interleaved copies (Q6_K's in the byte layout; under gguf_q8 too, for the int8 kernel
    of each type, quant_rows16_q8_avx2.h) and
    its decode steps read them (quant_rows16_avx2.h; under gguf_q8 the int8 kernel): the greedy
    tokens of the same engine without copies (the packed rows' kernels), logits within 1% of the
    largest."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_quant_gguf(qtype, tmp_path, monkeypatch, kquant_checkpoint, checkpoint)
    isa = kernels.set_isa("avx2")
    six = kernels.set_q6k_six_bits(False)
    try:
        converted = resolve_model_path(path)
        assert sum(m.rows16_everywhere for m in quant_layers(converted, torch.float32)) > 0
        assert sum(m.rows16_bytes > 0 for m in quant_layers(converted, torch.float32, "gguf_q8")) > 0
        int8 = kernels.act_q8_type(int(qtype))
        assert kernels.rows16_q8_type(int(qtype)) is int8 is True
        before = kernels.load().rows16_calls()
        got = run(path, None, "float32")
        assert kernels.load().rows16_calls() > before
        assert_same(got, run(path, None, "float32", weight_copies=CopyPolicy("none")), 1e-2)
        if int8:
            before = kernels.load().rows16_q8_calls()
            got = run(path, "gguf_q8", "float32")
            assert kernels.load().rows16_q8_calls() > before
            assert_same(got, run(path, "gguf_q8", "float32", weight_copies=CopyPolicy("none")), 1e-2)
    finally:
        kernels.set_q6k_six_bits(six)
        kernels.set_isa(isa)


def test_packed_tied_embeddings(tmp_path, monkeypatch):
    # tied lm_head shares the packed embedding
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = build_checkpoint(str(tmp_path / "tied"), "llama_tied_llama3rope")
    path = write_gguf(hf_dir, str(tmp_path / "t.gguf"), Q.Q8_0)
    assert_same(run(path, None), run(path, "none"), 1e-4)


@pytest.mark.parametrize("method,tol", [("int8", 0.05), ("int4", 0.5)])
def test_int8_int4_safetensors_close_to_float(checkpoint, method, tol):
    # weight-only quantization of a float checkpoint (int8: Q8_0 layout, 8 bits with a scale
    # per group of 32; int4: Q4_1 layout, 4 bits with scale and minimum per group of 32):
    # logits within `tol` of the largest logit magnitude
    hf_dir = checkpoint("qwen2")  # q/k/v biases and tied embeddings
    assert "QuantLinear" in packed_modules(hf_dir, method)
    ref, got = run(hf_dir, "none"), run(hf_dir, method)
    worst = 0.0
    for (rid, pos), la in ref[1].items():  # positions whose inputs agree (greedy may diverge later)
        if ref[0][rid][: pos + 1] == got[0][rid][: pos + 1]:
            worst = max(worst, (la - got[1][(rid, pos)]).abs().max().item() / la.abs().max().item())
    assert worst <= tol, worst


def test_quantization_argument_checks(checkpoint):
    hf_dir = checkpoint("llama")
    with pytest.raises(ValueError, match="quantization"):
        packed_modules(hf_dir, "fp3")
    with pytest.raises(ValueError, match="GGUF"):
        packed_modules(hf_dir, "gguf")
    assert "QuantLinear" not in packed_modules(hf_dir, None)  # float checkpoints stay float by default


def test_quant_embedding_dtype():
    from pagedserve.executor.quant.formats import quantize_q8_0

    w = torch.randn(10, 64)
    emb = QuantEmbedding(quantize_q8_0(w), torch.bfloat16)
    out = emb(torch.tensor([[3, 1]]))
    assert out.shape == (1, 2, 64) and out.dtype == torch.bfloat16
    lin = QuantLinear.from_packed(quantize_q8_0(w))
    y = lin(torch.randn(2, 3, 64, dtype=torch.bfloat16))
    assert y.shape == (2, 3, 10) and y.dtype == torch.bfloat16
    assert os.environ.get("PAGEDSERVE_CPU_ISA", "auto") in ("auto", "", *kernels.ISAS)


def test_gguf_default_falls_back_without_kernels(tmp_path, monkeypatch):
    import json

    from pagedserve.executor.quant import resolve_quantization

    (tmp_path / "pagedserve_gguf.json").write_text(json.dumps({"source": "x.gguf"}))
    cpu = torch.device("cpu")
    assert resolve_quantization(None, str(tmp_path), cpu) == "gguf"
    assert resolve_quantization("none", str(tmp_path), cpu) == "none"
    assert resolve_quantization(None, str(tmp_path), torch.device("cuda")) == "none"
    monkeypatch.setenv("PAGEDSERVE_NO_CPP_KERNELS", "1")
    assert resolve_quantization(None, str(tmp_path), cpu) == "none"


@pytest.mark.parametrize("m", [1, 11, 12, 13, 64, 128, 129])
def test_float_linear_matches_f_linear_at_every_row_count(m):
    # float32 weights through the blocked many-row kernel (12-128 rows, AVX2), the BLAS
    # elsewhere: the same products up to float rounding, with a bias, batched leading dims
    from pagedserve.executor.quant.layers import FloatLinear

    if not kernels.has_many_rows_kernel():
        pytest.skip(f"the blocked many-row kernel is AVX2-only (this path: {kernels.current_isa()})")
    g = torch.Generator().manual_seed(m)
    lin = torch.nn.Linear(72, 37, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(37, 72, generator=g))
        lin.bias.copy_(torch.randn(37, generator=g))
    x = torch.randn(m, 72, generator=g)
    ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
    lin.__class__ = FloatLinear
    got = lin(x)
    assert got.shape == ref.shape and torch.allclose(got, ref, rtol=1e-5, atol=1e-4), (got - ref).abs().max()
    assert torch.allclose(lin(x.view(1, m, 72)), ref.view(1, m, 37), rtol=1e-5, atol=1e-4)


def test_float_checkpoints_run_their_linears_on_the_kernel_where_it_has_the_path(checkpoint, monkeypatch):
    hf_dir = checkpoint("llama")
    kinds = packed_modules(hf_dir, None)
    assert ("FloatLinear" in kinds) == kernels.has_many_rows_kernel(), kinds
    assert "Linear" not in kinds or not kernels.has_many_rows_kernel()
    monkeypatch.setenv("PAGEDSERVE_NO_CPP_KERNELS", "1")  # opted out: plain nn.Linear, the BLAS
    kinds = packed_modules(hf_dir, None)
    assert "Linear" in kinds and "FloatLinear" not in kinds, kinds


HAVE_AVX512 = not WHY and "avx512" in kernels.available_isas()
HAVE_AVX2 = not WHY and "avx2" in kernels.available_isas()


def layer_without_copies(layer, x):
    """The layer's product on its packed rows alone (its copies set aside for the call)."""
    copies = list(layer._rows16)
    layer._rows16[:] = []
    try:
        return layer(x)
    finally:
        layer._rows16[:] = copies


@pytest.mark.skipif(not HAVE_AVX2, reason=WHY or "this CPU lacks avx2 (the interleaved kernels' ISA)")
def test_rows16_copies_where_they_apply_and_the_layer_on_them(checkpoint, tmp_path, monkeypatch):
    """A GGUF engine keeps row-interleaved copies (the few-row kernels') of its Q4_0 / Q4_1 /
    Q8_0 layers whose rows come in 16s: in float32 and bf16, with PAGEDSERVE_CPU_ISA=avx2 too,
    under gguf_q8 too (its int8 kernels read them: Q4_1's on every path from AVX2 up), not on the
    scalar path. A layer with three segments
    (Q4_1, Q6_K, float rows) gives, at 1-11 rows, the packed kernels' products within float
    rounding."""
    from pagedserve.executor.quant.formats import PackedWeight
    from pagedserve.executor.quant.layers import rows16_copies
    from tests.executor.test_quant_kernels import random_packed

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(checkpoint("llama"), str(tmp_path / "q4_1.gguf"), Q.Q4_1)
    converted = resolve_model_path(path)

    def copies(dtype, quantization=None):
        layers = quant_layers(converted, dtype, quantization)
        fit = [m for m in layers if all(t in (Q.Q4_0, Q.Q4_1, Q.Q8_0) and d.shape[0] % 16 == 0 for t, d, _ in m.segments)]
        return sum(m.rows16_bytes > 0 for m in layers), len(fit)

    have, fit = copies(torch.float32)
    assert fit > 0 and have == fit
    assert copies(torch.bfloat16)[0] == fit and copies(torch.float32, "gguf_q8")[0] == fit
    isa = kernels.set_isa("avx2")
    try:
        assert copies(torch.float32)[0] == fit and copies(torch.float32, "gguf_q8")[0] == fit
        kernels.set_isa("scalar")
        assert copies(torch.float32)[0] == 0
    finally:
        kernels.set_isa(isa)

    k, parts = 512, [32, 13, 5]
    layer = QuantLinear(k, parts)
    layer.set_part(0, PackedWeight(int(Q.Q4_1), torch.from_numpy(random_packed(Q.Q4_1, 32, k, seed=1)), (32, k)))
    layer.set_part(1, PackedWeight(int(Q.Q6_K), torch.from_numpy(random_packed(Q.Q6_K, 13, k, seed=2)), (13, k)))
    layer.set_part(2, torch.randn(5, k, generator=torch.Generator().manual_seed(3)) * 0.05)
    xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for m in (1, 4, 11)]
    wrapper = torch.nn.Sequential(layer)
    assert rows16_copies(wrapper) == 1 and layer.rows16_bytes == 32 * k // 32 * 20  # the Q4_1 segment only
    for path in {kernels.current_isa(), "avx2"}:  # the AVX-512 kernel where the CPU has it, the AVX2 one
        isa = kernels.set_isa(path)
        try:
            for x in xs:
                plain_m = layer_without_copies(layer, x)
                before = kernels.load().rows16_calls()
                got = layer(x)
                assert kernels.load().rows16_calls() == before + 1  # the Q4_1 segment's copy, read
                torch.testing.assert_close(got, plain_m, rtol=1e-5, atol=1e-5)
                assert torch.equal(got[:, 32:], plain_m[:, 32:])  # Q6_K and float rows: their own kernels
        finally:
            kernels.set_isa(isa)


@pytest.mark.skipif(not HAVE_AVX2, reason=WHY or "this CPU lacks avx2 (the interleaved kernels' ISA)")
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_a_gguf_q8_layer_keeps_copies_of_its_float_segments_only(isa):
    """Under gguf_q8 (act_q8) a layer's Q4_1 and Q4_K segments run on int8 activations, while the
    Q6_K segment's few rows stay float (kernels.set_int8_rows at 9, its rule where no int8 kernel
    reads its copy: its six bits below AVX512-VNNI). Every segment keeps a copy: the
    int8 ones for their int8 kernel on it (kernels.rows16_q8_type), the other for the float one.
    The layer's output at 3 rows is each segment's product on its copy: int8 or float."""
    from pagedserve.executor.quant.formats import PackedWeight
    from pagedserve.executor.quant.layers import rows16_copies
    from tests.executor.test_quant_kernels import random_packed

    if isa not in kernels.available_isas():
        pytest.skip(f"this CPU lacks {isa}")
    types, k, parts = (Q.Q4_1, Q.Q4_K, Q.Q6_K), 512, [32, 16, 16]
    raws = [torch.from_numpy(random_packed(t, n, k, seed=i)) for i, (t, n) in enumerate(zip(types, parts))]
    prev = kernels.set_isa(isa)
    six = kernels.set_q6k_six_bits(False)  # the byte layout, which both levels read
    old9 = kernels.set_int8_rows(int(Q.Q6_K), 9)
    try:
        layer = QuantLinear(k, parts)
        for i, (t, raw) in enumerate(zip(types, raws)):
            layer.set_part(i, PackedWeight(int(t), raw, (parts[i], k)))
        assert [t for t, _, _ in layer.segments] == [int(t) for t in types]
        layer.act_q8 = True
        assert rows16_copies(torch.nn.Sequential(layer)) == 1
        floats = [not kernels.act_q8_type(int(t)) for t in types]
        assert floats == [False, False, True]
        assert [f or kernels.rows16_q8_type(int(t)) for t, f in zip(types, floats)] == [True] * 3
        sizes = [kernels.rows16_copy_size(raw, int(t), k) for t, raw in zip(types, raws)]
        assert min(sizes) > 0 and layer.rows16_bytes == sum(sizes)
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(4))
        want = torch.zeros(3, sum(parts))
        for i, (t, raw, f) in enumerate(zip(types, raws, floats)):
            kernels.gemm(x, raw, int(t), want, sum(parts[:i]), act_q8=not f, interleaved=layer._rows16[i])
        before, before8 = kernels.load().rows16_calls(), kernels.load().rows16_q8_calls()
        assert torch.equal(layer(x), want)
        assert kernels.load().rows16_calls() == before + sum(floats)
        assert kernels.load().rows16_q8_calls() == before8 + 3 - sum(floats)
    finally:
        kernels.set_int8_rows(int(Q.Q6_K), old9)
        kernels.set_q6k_six_bits(six)
        kernels.set_isa(prev)


@pytest.mark.skipif(not HAVE_AVX512 or "avx512_bf16" not in kernels.available_isas(), reason="this CPU lacks avx512_bf16")
def test_a_bf16_layer_with_interleaved_copies_keeps_them_up_to_8_rows():
    """bf16 activations: a segment with an interleaved copy runs its few-row kernel (on the
    bf16 units, csrc/quant_rows16_bf16.h) up to 8 rows (so a verification of up to 7 tokens
    computes what 1-row steps do), the many-row bf16 kernel from 9; a segment without one the
    many-row kernel from 6 (kernels.set_bf16_rows)."""
    from pagedserve.executor.quant.formats import PackedWeight
    from pagedserve.executor.quant.layers import rows16_copies
    from tests.executor.test_quant_kernels import random_packed

    k = 256
    with_copy, without = QuantLinear(k, [32]), QuantLinear(k, [32])
    for layer in (with_copy, without):
        layer.set_part(0, PackedWeight(int(Q.Q4_1), torch.from_numpy(random_packed(Q.Q4_1, 32, k, seed=1)), (32, k)))
    assert rows16_copies(torch.nn.Sequential(with_copy)) == 1
    mod = kernels.load()
    isa = kernels.set_isa("avx512_bf16")  # no AMX copies in play
    try:
        for layer, first_bf16 in ((with_copy, 9), (without, 6)):
            for m in (1, first_bf16 - 1, first_bf16):
                before = mod.bf16_calls()
                layer(torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16())
                many, few = sum(mod.bf16_calls()[:2]) - sum(before[:2]), mod.bf16_calls()[2] - before[2]
                assert (many > 0) == (m == first_bf16), (first_bf16, m)
                assert (few > 0) == (layer is with_copy and m < first_bf16), (first_bf16, m)
    finally:
        kernels.set_isa(isa)


@pytest.mark.skipif(bool(WHY) or "avx2" not in kernels.available_isas(), reason=WHY or "this CPU lacks avx2")
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_gguf_q8_speculation_gives_the_greedy_tokens_of_plain_decode(checkpoint, tmp_path, monkeypatch, isa):
    """Under gguf_q8 the int8 kernels on the row-interleaved copies round a row as the many-row
    kernel does, whatever the rows computed with it (quant_rows16_vnni.h, quant_rows16_q8_avx2.h),
    so n-gram speculation's verification rows (k + 1 at once) compute the logits that 1-row decode
    steps do: the same greedy tokens, with some guesses accepted, on the CPU's own path and on
    the AVX2 one (copies below 12 rows, the many-row kernel above: the same bits)."""
    from pagedserve import LLM, SamplingParams

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(checkpoint("llama"), str(tmp_path / "q4_1.gguf"), Q.Q4_1)
    prev = kernels.set_isa("avx2" if isa == "avx2" else kernels.current_isa())
    try:
        assert kernels.rows16_q8_type(int(Q.Q4_1))
        kw = dict(quantization="gguf_q8", dtype="float32", max_model_len=256, num_kv_blocks=200)
        sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        prompts = [{"prompt_token_ids": ([7, 8, 9, 10, 11] * 6)[:20]}]
        base = LLM(path, **kw).generate(prompts, sp, use_tqdm=False)
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        llm = LLM(path, speculative_config=spec, **kw)
        before = kernels.load().rows16_q8_calls()
        got = llm.generate(prompts, sp, use_tqdm=False)
        assert kernels.load().rows16_q8_calls() > before
        assert got[0].outputs[0].token_ids == base[0].outputs[0].token_ids
        assert llm.get_stats().spec_num_accepted_tokens > 0
    finally:
        kernels.set_isa(prev)


HAVE_VNNI = not WHY and kernels.ISAS[kernels.current_isa()] >= kernels.ISAS["avx512_vnni"]
needs_vnni = pytest.mark.skipif(
    not HAVE_VNNI, reason=WHY or "the path is below avx512_vnni (the CPU or PAGEDSERVE_CPU_ISA), where gguf_q8's copies do not serve every row count"
)


@needs_vnni
def test_a_dropped_layer_runs_on_its_copy_and_refuses_the_packed_paths():
    """QuantLinear.drop_packed_rows (gguf_q8, AVX512-VNNI): a Q4_1 + Q4_K layer with copies gives
    up its packed rows (the bytes freed: both segments'), and its products stay the same to the
    bit at 1-300 rows (the copy's int8 kernel at every row count). A rule that would send a
    product to the packed rows (set_rows16_q8_rows) and any other reader (dequant) raise a clear
    error instead of reading them; data that another module shares (`keep`) is not dropped."""
    from pagedserve.executor.quant.formats import PackedWeight
    from tests.executor.test_quant_kernels import random_packed

    types, k, parts = (Q.Q4_1, Q.Q4_K), 512, [32, 16]
    raws = [torch.from_numpy(random_packed(t, n, k, seed=i)) for i, (t, n) in enumerate(zip(types, parts))]
    layer = QuantLinear(k, parts)
    for i, (t, raw) in enumerate(zip(types, raws)):
        layer.set_part(i, PackedWeight(int(t), raw, (parts[i], k)))
    layer.act_q8 = True
    assert layer.attach_rows16() and all(kernels.rows16_q8_every_row(int(t)) for t in types)
    xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for m in (1, 5, 300)]
    before = [layer(x) for x in xs]
    assert layer.drop_packed_rows({layer.segments[0][1].data_ptr()}) == raws[1].numel()  # the first is shared
    assert layer.drop_packed_rows(set()) == raws[0].numel() and layer.packed_bytes == 0
    assert layer.drop_packed_rows(set()) == 0  # (once)
    for x, want in zip(xs, before):
        assert torch.equal(layer(x), want)
    old = kernels.set_rows16_q8_rows(int(Q.Q4_1), 4)
    try:
        with pytest.raises(RuntimeError, match="packed rows were dropped"):
            layer(xs[1])
    finally:
        kernels.set_rows16_q8_rows(int(Q.Q4_1), old)
    with pytest.raises(RuntimeError, match="packed rows were dropped"):
        kernels.dequant(layer.segments[0][1], int(Q.Q4_1), k)


@needs_vnni
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K], ids=lambda t: t.name)
def test_gguf_q8_engine_drops_the_packed_rows_its_copies_replace(checkpoint, kquant_checkpoint, tmp_path, monkeypatch, qtype):
    """A gguf_q8 engine on AVX512-VNNI keeps only the row-interleaved copies of its Q4_1 / Q4_K
    layers (rows16_copies' drop_packed, at load): fewer packed bytes, and the same greedy tokens and logits,
    bit for bit, as the same engine keeping its packed rows. A tied LM head (its vocabulary a
    multiple of 16, so that it has a copy) keeps the packed rows its embedding reads."""
    from pagedserve.executor.quant import layers as qlayers

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_quant_gguf(qtype, tmp_path, monkeypatch, kquant_checkpoint, checkpoint)
    converted = resolve_model_path(path)
    dropped = quant_layers(converted, torch.float32, "gguf_q8")
    got = run(path, "gguf_q8")
    with monkeypatch.context() as m:
        m.setattr(qlayers.QuantLinear, "drop_packed_rows", lambda self, keep: 0)
        kept = quant_layers(converted, torch.float32, "gguf_q8")
        ref = run(path, "gguf_q8")
    assert sum(q.packed_bytes for q in dropped) < sum(q.packed_bytes for q in kept)
    assert sum(q.rows16_bytes for q in dropped) == sum(q.rows16_bytes for q in kept) > 0
    assert_same(got, ref, 0.0)
    tied_dir = build_checkpoint(str(tmp_path / "tied"), "llama_tied_llama3rope", vocab_size=1008)
    tied = write_gguf(tied_dir, str(tmp_path / "tied.gguf"), Q.Q4_1)
    layers = quant_layers(resolve_model_path(tied), torch.float32, "gguf_q8")
    head = layers[-1]
    assert head.out_features == 1008 and head.rows16_bytes > 0 and head.packed_bytes > 0  # its embedding's rows
    assert all(q.packed_bytes == 0 for q in layers[:-1])  # (the others: dropped)
    run(tied, "gguf_q8")
