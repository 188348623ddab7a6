"""A random-weight GGUF of a 1 B Llama's shapes (4 layers, vocabulary 32,000) laid out as
llama.cpp's Q4_K_M: the output layer and layers 0 and 3's attn_v / ffn_down in Q6_K (its "more
bits" tensors), every other matrix Q4_K; K-quant blocks from the tests' fake_kquant (gguf has
no K-quant quantizer). For runner A/B runs (BENCHMARKS section 70):

    .venv/bin/python benchmarks/make_q4_k_m_like.py /tmp/k1b
    .venv/bin/python benchmarks/decode_step_ab.py --model /tmp/k1b/Q4_K_M.gguf --batches 1 2 4 8 16
"""

from __future__ import annotations

import os
import sys

import gguf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.checkpoints import build_checkpoint  # noqa: E402
from tests.executor.test_gguf import write_gguf  # noqa: E402
from tests.executor.test_quant_models import K_QUANTS, fake_kquant  # noqa: E402

Q = gguf.GGMLQuantizationType


def q4_k_m_type(name: str):
    """Q6_K for the output layer and the first and last layers' attn_v / ffn_down, else Q4_K."""
    parts = name.split(".")
    more_bits = len(parts) > 2 and parts[1] in ("0", "3") and parts[2] in ("attn_v", "ffn_down")
    return Q.Q6_K if name == "output.weight" or more_bits else Q.Q4_K


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/k1b"
    hf = build_checkpoint(os.path.join(out, "hf_km"), "llama", hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                          vocab_size=32000)
    real = gguf.quants.quantize
    gguf.quants.quantize = lambda a, t: fake_kquant(a, t) if t in K_QUANTS else real(a, t)
    print(write_gguf(hf, os.path.join(out, "Q4_K_M.gguf"), Q.Q4_K, type_of=q4_k_m_type))


if __name__ == "__main__":
    main()
