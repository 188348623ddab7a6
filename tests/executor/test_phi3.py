"""Phi-3 against transformers: fused qkv_proj / gate_up_proj checkpoints, LongRoPE, a
sliding window. LongRoPE's factors depend on the sequence length (long ones past
original_max_position_embeddings, 48 here), which transformers chooses per forward for the
whole sequence: compared where that choice is the same for every position of a sequence,
one that stays within 48 tokens (short factors) and one whose prompt is longer (long)."""

import pytest
import torch

from pagedserve.executor.models.phi3 import Phi3ForCausalLM
from tests.checkpoints import load_hf
from tests.executor.test_model_parity import check_against_hf, drive, make_runner


@pytest.mark.parametrize("plen,max_tokens,block_size", [(30, 12, 8), (60, 10, 16)])
def test_phi3_longrope_matches_transformers(checkpoint, plen, max_tokens, block_size):
    path = checkpoint("phi3")
    hf = load_hf(path)
    runner = make_runner(path, block_size)
    assert isinstance(runner.model, Phi3ForCausalLM)
    cfg = runner.model.config
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.sliding_window == 30
    prompt = [(7 * i + 3) % 1000 for i in range(plen)]
    reqs, logits_at, _ = drive(runner, [prompt], max_tokens, block_size)
    check_against_hf(hf, reqs, logits_at)
    with torch.inference_mode():
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, plen:].tolist()
    assert reqs["r0"].output_token_ids == gen


def test_phi3_batched_chunked_prefill_and_prefix_hits(checkpoint):
    """Short sequences (under the original 48) batched with chunked prefill and a prefix hit."""
    path = checkpoint("phi3")
    hf = load_hf(path)
    runner = make_runner(path, 8)
    shared = [(11 * i + 5) % 1000 for i in range(24)]
    prompts = [shared + [1, 2], [9] * 3, list(range(100, 130))]
    late = {3: [("late0", shared + [6, 7, 8], 6)]}
    reqs, logits_at, sched = drive(runner, prompts, 6, 8, budget=16, late=late)
    assert sched.kv.prefix_cache_hits >= 16
    check_against_hf(hf, reqs, logits_at)
