"""Rotary scalings against transformers' own formulas (ROPE_INIT_FUNCTIONS, float32):
linear, llama3, YaRN (with its attention factor), LongRoPE (short and long factors, chosen
per request by its length) and dynamic NTK (per request length beyond max_position)."""

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.models.rope import RotaryEmbedding, rope_parameters

D, MAX = 32, 512
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
             "beta_slow": 1},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                    "mscale_all_dim": 0.5},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(D // 2)],
                 "long_factor": [1.0 + 0.5 * i for i in range(D // 2)], "original_max_position_embeddings": 128},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def configs(name):
    sc = dict(SCALINGS[name])
    hf = transformers.LlamaConfig(hidden_size=D * 4, num_attention_heads=4, head_dim=D, max_position_embeddings=MAX,
                                  rope_parameters={"rope_theta": 10000.0, **sc})
    ours = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": D * 4,
                                     "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
                                     "vocab_size": 10, "max_position_embeddings": MAX, "rope_theta": 10000.0,
                                     "rope_scaling": sc})
    return hf, ours, sc["rope_type"]


@pytest.mark.parametrize("name", list(SCALINGS))
def test_inverse_frequencies_and_attention_factor_match_transformers(name):
    hf, ours, kind = configs(name)
    ref_inv, ref_attn = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    inv, attn = rope_parameters(ours, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert attn == pytest.approx(ref_attn)


@pytest.mark.parametrize("name", ["longrope", "dynamic"])
def test_length_dependent_scalings_follow_each_request(name):
    """Tokens of a request whose context is longer than the original (max) length rotate
    with transformers' frequencies for that length; the other request's tokens keep theirs."""
    hf, ours, kind = configs(name)
    rot = RotaryEmbedding(ours, ours.rope_theta, ours.rope_scaling)
    long_len = 700  # past original_max (longrope) and max_position_embeddings (dynamic)
    pos = torch.tensor([5, 6, long_len - 2, long_len - 1])
    seq_lens = torch.tensor([7, 7, long_len, long_len])
    cos, sin = rot.cos_sin(pos, torch.float32, seq_lens)
    short_inv, attn = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    long_inv, _ = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=long_len)
    for i, inv in enumerate([short_inv, short_inv, long_inv, long_inv]):
        f = pos[i].float() * inv.float()
        emb = torch.cat((f, f))
        torch.testing.assert_close(cos[i, 0], emb.cos() * attn, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sin[i, 0], emb.sin() * attn, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(short_inv, long_inv)


@pytest.mark.parametrize("name", ["longrope", "dynamic", "llama3"])
def test_only_dynamic_ntk_keeps_a_model_out_of_cuda_graphs(name):
    """Dynamic NTK reads the step's request lengths on the host (a table per length): the
    runner then leaves CUDA graphs off. LongRoPE's choice is a device-side `where`."""
    from pagedserve.executor.attention.torch_backend import TorchAttentionBackend
    from pagedserve.executor.models.llama import LlamaForCausalLM

    _, ours, kind = configs(name)
    with torch.device("meta"):
        model = LlamaForCausalLM(ours, TorchAttentionBackend())
    assert model.cuda_graph_safe == (kind != "dynamic")
