"""Sliding-window attention and Gemma 2 / 3 against transformers (logits within 1e-4 in
float32, the same greedy tokens): Mistral with a window smaller than a block (5) and one
spanning several blocks (40), Gemma 2 (alternating sliding / global layers, attention and
final soft caps, query_pre_attn_scalar, (1 + w) norms, sandwich norms, GELU, scaled tied
embeddings), Gemma 3 (3 sliding : 1 global, local and global rope bases, linear scaling on
the global ones, q/k norms); prompts longer than the windows, through the real scheduler
with chunked prefill, prefix hits and preemption."""

import pytest
import torch

from pagedserve.config import EngineConfig, ModelLoadConfig
from pagedserve.core.engine_core import resolve_config
from pagedserve.executor.attention.torch_backend import TorchAttentionBackend
from pagedserve.executor.model_config import FULL, SLIDING, ModelConfig
from pagedserve.executor.models.gemma import GemmaForCausalLM
from pagedserve.executor.models.llama import LlamaForCausalLM, check_backend
from tests.checkpoints import load_hf
from tests.executor.test_model_parity import check_against_hf, drive, make_runner

WINDOW_ARCHS = ["mistral_w5", "mistral_w40", "gemma2", "gemma3"]


@pytest.mark.parametrize(
    "arch,block_size", [("mistral_w5", 8), ("mistral_w40", 8), ("gemma2", 16), ("gemma3", 8), ("gemma3", 16)]
)
def test_windowed_prefill_and_decode_match_transformers(checkpoint, arch, block_size):
    path = checkpoint(arch)
    hf = load_hf(path)
    runner = make_runner(path, block_size)
    cfg = runner.model.config
    assert cfg.has_sliding_layers and isinstance(runner.model, GemmaForCausalLM) == arch.startswith("gemma")
    prompt = [(7 * i + 3) % 1000 for i in range(53)]  # longer than every window
    reqs, logits_at, _ = drive(runner, [prompt, prompt[:9]], 12, block_size)
    check_against_hf(hf, reqs, logits_at)


@pytest.mark.parametrize("arch", WINDOW_ARCHS)
def test_windowed_chunked_prefill_prefix_hits_and_generate(checkpoint, arch):
    path = checkpoint(arch)
    hf = load_hf(path)
    runner = make_runner(path, 16)
    shared = [(11 * i + 5) % 1000 for i in range(40)]
    prompts = [shared + [1, 2, 3], list(range(100, 171)), [42]]
    late = {3: [("late0", shared + [6, 7, 8, 9], 6)]}
    reqs, logits_at, sched = drive(runner, prompts, 8, 16, budget=24, late=late)
    assert sched.kv.prefix_cache_hits >= 32
    check_against_hf(hf, reqs, logits_at)
    with torch.inference_mode():
        hf_gen = hf.generate(
            torch.tensor([prompts[1]]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompts[1]) :].tolist()
    assert reqs["r1"].output_token_ids == hf_gen


def test_windowed_preemption_recompute_matches(checkpoint):
    path = checkpoint("gemma3")
    hf = load_hf(path)
    runner = make_runner(path, 8, num_blocks=24)  # 4 KV cache groups: up to 4 blocks a block of tokens
    prompts = [[(3 * i + j) % 1000 for j in range(20)] for i in range(4)]
    reqs, logits_at, sched = drive(runner, prompts, 16, 8, num_blocks=24, caching=False)
    assert sched.num_preemptions > 0
    check_against_hf(hf, reqs, logits_at)


def test_mistral_runs_its_whole_context(checkpoint):
    """max_model_len is the model's max_position_embeddings, no longer capped at the window."""
    path = checkpoint("mistral_w40")
    cfg = EngineConfig(model=ModelLoadConfig(model=path))
    info = resolve_config(cfg)
    assert info.model_config.sliding_window == 40
    assert cfg.scheduler.max_model_len == info.model_config.max_position_embeddings == 2048


def _cfg(arch, **extra):
    base = {"architectures": [arch], "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
            "num_hidden_layers": 8, "vocab_size": 300, "max_position_embeddings": 4096, "sliding_window": 512}
    return ModelConfig.from_hf_dict({**base, **extra})


def test_layer_kinds_from_older_configs():
    """Without transformers 5's layer_types: Gemma 2 alternates, Gemma 3 follows
    sliding_window_pattern with rope_local_base_freq, Qwen2 slides from max_window_layers on
    (only with use_sliding_window), Mistral slides everywhere; a window as long as the
    context is full attention."""
    g2 = _cfg("Gemma2ForCausalLM")
    assert g2.layer_types == [SLIDING, FULL] * 4 and g2.tie_word_embeddings and g2.hidden_act == "gelu_tanh"
    g3 = _cfg("Gemma3ForCausalLM", sliding_window_pattern=4, rope_local_base_freq=1234.0, rope_theta=5e5)
    assert g3.layer_types == [SLIDING] * 3 + [FULL] + [SLIDING] * 3 + [FULL]
    assert (g3.rope_local_theta, g3.rope_theta, g3.layer_window(0), g3.layer_window(3)) == (1234.0, 5e5, 512, None)
    q2 = _cfg("Qwen2ForCausalLM", use_sliding_window=True, max_window_layers=6)
    assert q2.layer_types == [FULL] * 6 + [SLIDING] * 2
    assert _cfg("Qwen2ForCausalLM").sliding_window is None
    assert _cfg("MistralForCausalLM").layer_types == [SLIDING] * 8
    assert not _cfg("MistralForCausalLM", sliding_window=4096).has_sliding_layers
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        _cfg("Gemma3ForCausalLM", use_bidirectional_attention=True)


def test_backend_without_windows_is_refused():
    class NoWindows(TorchAttentionBackend):
        name = "no-windows"
        supports_sliding_window = False
        supports_softcap = False

    with pytest.raises(ValueError, match="sliding_window=512"):
        check_backend(_cfg("MistralForCausalLM"), NoWindows())
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        LlamaForCausalLM(_cfg("Gemma2ForCausalLM", sliding_window=None, attn_logit_softcapping=50.0), NoWindows())


def test_engine_runs_gemma3_with_kv_cache_groups_and_ngram_speculation(checkpoint):
    """Through LLM (the engine core passes the KV cache groups to the scheduler): greedy
    tokens equal transformers' generate under n-gram speculation (rejected guesses trim
    every group's table)."""
    from pagedserve import LLM, SamplingParams

    path = checkpoint("gemma3")
    hf = load_hf(path)
    prompt = [(7 * i + 3) % 1000 for i in range(30)] * 2
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt) :].tolist()
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(model=path, block_size=8, speculative_config=spec)
    assert list(llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids) == ref
