"""How much memory a CPU engine's weight copies may take (executor/quant/copy_budget.py), and a
packed model loaded under a budget that holds only some of them."""

import logging

import pytest
import torch

from pagedserve.config import CacheConfig, EngineConfig, ModelLoadConfig, ParallelConfig, SchedulerConfig
from pagedserve.executor import host_memory, kv_cache
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.quant.copy_budget import HEADROOM_BYTES, CopyBudget, CopyPolicy

GIB = 1 << 30


def test_a_copy_is_kept_only_where_it_and_its_making_fit():
    b = CopyBudget(100)
    assert b.take("bf16", 40, transient=40)  # 80 <= 100
    assert not b.take("bf16", 40, transient=40)  # 80 > 60
    assert b.take("row-interleaved", 60) and b.left == 0
    assert not b.take("row-interleaved", 1)
    assert b.kept == {"bf16": [1, 40], "row-interleaved": [1, 60]}
    assert b.refused == {"bf16": [1, 40], "row-interleaved": [1, 1]}
    unbounded = CopyBudget(None)
    assert unbounded.take("bf16", 1 << 50, transient=1 << 50) and unbounded.left is None


def test_bytes_given_back_after_a_copy_fit_the_next_one():
    """gguf_q8 drops the packed rows a copy replaces (quant/layers.py): their bytes return."""
    b = CopyBudget(100)
    assert b.take("row-interleaved", 100) and not b.take("row-interleaved", 100)
    b.give_back(100)
    assert b.take("row-interleaved", 100) and b.kept == {"row-interleaved": [2, 200]}
    unbounded = CopyBudget(None)
    unbounded.give_back(5)
    assert unbounded.left is None


def test_policies_all_none_and_auto_from_the_free_memory(monkeypatch):
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 20 * GIB)
    assert CopyPolicy("all").budget().left is None
    assert CopyPolicy("none").budget().left == 0
    assert CopyPolicy("auto", reserve_bytes=2 * GIB).budget().left == 18 * GIB - HEADROOM_BYTES
    # four engine processes loading at once: a quarter of the free memory each
    assert CopyPolicy("auto", reserve_bytes=2 * GIB, processes=4).budget().left == 3 * GIB - HEADROOM_BYTES
    assert CopyPolicy("auto", reserve_bytes=30 * GIB).budget().left == 0
    with pytest.raises(ValueError, match="weight_copies"):
        CopyPolicy("some")
    with pytest.raises(ValueError, match="weight_copies"):
        ModelLoadConfig(weight_copies="some")


def test_an_engines_policy_reserves_its_kv_cache_and_counts_its_processes():
    """The reserve is the KV cache the core will allocate: the user's blocks or bytes (else the
    CPU default), at the KV dtype the runner resolves, a tensor-parallel rank's share of the KV
    heads, and no more than every sequence at full length could fill."""
    mc = ModelConfig.from_hf_dict(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    )

    def policy(local_ranks=1, dtype="float32", kv="auto", tp=1, seqs=None, max_len=None, **kw):
        cache = {k: v for k, v in kw.items() if k in ("kv_cache_memory_bytes", "num_kv_blocks")}
        sched = {} if seqs is None else {"max_num_seqs": seqs, "max_model_len": max_len}
        cfg = EngineConfig(
            model=ModelLoadConfig(weight_copies=kw.get("mode", "auto"), dtype=dtype),
            cache=CacheConfig(kv_cache_dtype=kv, **cache),
            scheduler=SchedulerConfig(**sched),
            parallel=ParallelConfig(data_parallel_size=kw.get("dp", 1), tensor_parallel_size=tp),
        )
        return CopyPolicy.of_engine(cfg, mc, local_ranks)

    assert policy() == CopyPolicy("auto", kv_cache.DEFAULT_CPU_KV_BYTES, 1)
    assert policy(kv_cache_memory_bytes="3GiB", mode="none").reserve_bytes == 3 * GIB
    per_block = 2 * 3 * 16 * 2 * 16 * 4  # K and V, 3 layers, 16 tokens, 2 heads of 16, float32
    assert policy(num_kv_blocks=10).reserve_bytes == 10 * per_block
    assert policy(num_kv_blocks=10, kv="float16").reserve_bytes == 10 * per_block // 2
    assert policy(num_kv_blocks=10, dtype="bfloat16").reserve_bytes == 10 * per_block // 2
    assert policy(num_kv_blocks=10, tp=2).reserve_bytes == 10 * per_block // 2  # a rank's one KV head
    # 2 sequences of up to 64 tokens: 2 x 4 blocks and the null block, far under the 2 GiB default
    assert policy(seqs=2, max_len=64).reserve_bytes == 9 * per_block
    assert policy(seqs=2, max_len=64, kv_cache_memory_bytes=4 * per_block).reserve_bytes == 4 * per_block
    assert policy(local_ranks=2, dp=3).processes == 6


gguf = pytest.importorskip("gguf")


def _native_bf16_and_avx512():
    from pagedserve.executor.quant import kernels

    try:
        isas = kernels.available_isas()
    except Exception as e:  # noqa: BLE001
        return f"quant kernels do not build here: {e}"
    if "avx512_bf16" not in isas:
        return "this CPU lacks AVX512-BF16 (the bf16 copies and the K-quant interleaved ones need it)"
    return ""


WHY = _native_bf16_and_avx512()


@pytest.mark.skipif(bool(WHY), reason=WHY or "-")
def test_a_bf16_engine_under_a_tight_budget_keeps_some_copies_and_the_same_answers(
    checkpoint, tmp_path, monkeypatch, caplog
):
    """A bf16 engine of a Q4_1 GGUF whose free memory holds the row-interleaved copies and about
    half of the bf16 ones keeps exactly those (model order, each bf16 copy with its making's
    transient), warns naming the setting, and gives the logits of the dequantized bf16 model
    within 2% of the largest wherever both saw the same tokens (layers without a copy run on the
    packed kernels, bf16 activations against the exact quants: another rounding); with
    weight_copies="none" it keeps none, says so without a warning, and answers the same way."""
    from gguf import GGMLQuantizationType as Q

    from pagedserve.executor.loader import resolve_model_path
    from pagedserve.executor.quant import kernels
    from tests.executor.test_gguf import write_gguf
    from tests.executor.test_quant_models import assert_close_where_inputs_agree, quant_layers, run

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(checkpoint("llama"), str(tmp_path / "q4_1.gguf"), Q.Q4_1)
    converted = resolve_model_path(path)
    isa = kernels.set_isa("avx512_bf16")
    try:
        every = quant_layers(converted, torch.bfloat16)  # today's free memory holds them all
        rows16 = sum(m.rows16_bytes for m in every)
        bf16 = [m.copy_bytes for m in every]
        assert rows16 > 0 and all(bf16)
        left = rows16 + sum(bf16) // 2
        expect = 0
        for size in bf16:  # what the budget's rule keeps, in model order
            if left - rows16 >= 2 * size:
                left -= size
                expect += 1
        assert 0 < expect < len(bf16)

        reserve = 1 << 20
        free = HEADROOM_BYTES + reserve + rows16 + sum(bf16) // 2
        monkeypatch.setattr(host_memory, "available_bytes", lambda: free)
        tight = CopyPolicy("auto", reserve_bytes=reserve)
        with caplog.at_level(logging.INFO, logger="pagedserve.executor.quant.copy_budget"):
            layers = quant_layers(converted, torch.bfloat16, weight_copies=tight)
        assert [m.rows16_everywhere for m in layers] == [m.rows16_everywhere for m in every]
        assert sum(m.copy_bytes > 0 for m in layers) == expect
        assert [r.levelname for r in caplog.records] == ["WARNING"] and "weight_copies='all'" in caplog.text

        reference = run(path, "none", "bfloat16")
        assert_close_where_inputs_agree(run(path, None, "bfloat16", weight_copies=tight), reference, 0.02)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pagedserve.executor.quant.copy_budget"):
            layers = quant_layers(converted, torch.bfloat16, weight_copies=CopyPolicy("none"))
        assert not any(m.rows16_bytes or m.copy_bytes for m in layers)
        assert [r.levelname for r in caplog.records] == ["INFO"] and "none kept" in caplog.text
        assert_close_where_inputs_agree(run(path, None, "bfloat16", weight_copies=CopyPolicy("none")), reference, 0.02)
    finally:
        kernels.set_isa(isa)


@pytest.mark.skipif(bool(WHY), reason=WHY or "-")
def test_a_bf16_copy_made_in_slices_equals_one_made_whole(monkeypatch):
    """attach_bf16_copy dequantizes DEQUANT_SLICE values at a time: with slices of 5 rows the
    copy's products are those of a copy made in one piece, to the bit (three segments, odd N)."""
    from pagedserve.executor.quant import layers as quant_layers
    from pagedserve.executor.quant.formats import Q4_1, Q6_K, PackedWeight
    from pagedserve.executor.quant.layers import QuantLinear
    from tests.executor.test_quant_kernels import random_packed

    k, parts = 256, [24, 13, 5]

    def layer():
        torch.manual_seed(0)
        q = QuantLinear(k, parts)
        q.set_part(0, PackedWeight(Q4_1, torch.from_numpy(random_packed(Q4_1, 24, k)), (24, k)))
        q.set_part(1, PackedWeight(Q6_K, torch.from_numpy(random_packed(Q6_K, 13, k)), (13, k)))
        q.set_part(2, torch.randn(5, k))
        q.attach_bf16_copy(1)
        return q

    whole = layer()
    monkeypatch.setattr(quant_layers, "DEQUANT_SLICE", 5 * k)
    sliced = layer()
    x = torch.randn(17, k).to(torch.bfloat16)
    assert torch.equal(whole(x), sliced(x))
