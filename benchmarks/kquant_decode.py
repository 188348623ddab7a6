"""Batch-1 decode of a K-quant GGUF (BENCHMARKS section 49): a synthetic Llama of about 0.9 B
weights (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 5632, SmolLM2's tokenizer and
vocabulary) in llama.cpp's Q4_K_M mix: Q4_K matrices, Q6_K for the output and for attn_v and
ffn_down in llama.cpp's "more bits" layers; random blocks with small scales (gguf cannot
quantize K-quants; speed does not depend on the values), written once to --out. Then a bfloat16 engine
decodes --tokens tokens at batch 1, the bf16 few-row kernel on the Q4_K copies on and off in
turns (off: the float kernel on the packed blocks, as before the copies). The same file runs
under llama.cpp's llama-bench for the anchor (`llama-bench -m FILE -p 0 -n 128 -t 2`).

    .venv/bin/python benchmarks/kquant_decode.py [--out /tmp/q4k.gguf] [--tokens 64] [--rounds 3] [--mix q5_k_m|q6_k|q4_0|q8_0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import gguf
import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, MLP = 2048, 16, 32, 8, 5632


def random_k_min(rows: int, cols: int, rng, five: bool = False) -> np.ndarray:
    """[rows, cols / 256 * 144] bytes of Q4_K blocks (five: [.., 176] of Q5_K): random quants and
    6-bit scales, d and dmin small."""
    size, d_max = (176, 1e-3) if five else (144, 2e-3)
    raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    d = rng.uniform(0, d_max, size=(rows, cols // 256, 2)).astype(np.float16)
    raw[..., 0:4] = d.view(np.uint8).reshape(rows, cols // 256, 4)
    return raw.reshape(rows, -1)


def random_q6_k(rows: int, cols: int, rng) -> np.ndarray:
    """[rows, cols / 256 * 210] bytes of Q6_K blocks: random quants, small int8 scales and d."""
    raw = rng.integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
    raw[..., 192:208] = rng.integers(-8, 8, size=(rows, cols // 256, 16), dtype=np.int8).view(np.uint8)
    raw[..., 208:210] = rng.uniform(0, 2e-3, size=(rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def more_bits(layer: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < LAYERS // 8 or layer >= 7 * LAYERS // 8 or (layer - LAYERS // 8) % 3 == 2


def random_block32(rows: int, cols: int, rng, qtype) -> np.ndarray:
    """[rows, cols / 32 * size] bytes of Q4_0 / Q4_1 / Q8_0 blocks: random quants, d (and Q4_1's m)
    small."""
    size = {gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20}.get(qtype, 34)
    raw = rng.integers(0, 256, size=(rows, cols // 32, size), dtype=np.uint8)
    halves = 2 if size == 20 else 1
    d = rng.uniform(-2e-3, 2e-3, size=(rows, cols // 32, halves)).astype(np.float16)
    raw[..., 0 : 2 * halves] = d.view(np.uint8).reshape(rows, cols // 32, 2 * halves)
    return raw.reshape(rows, -1)


def write_model(out: str, mix: str = "q4_k_m") -> None:
    """mix "q4_k_m" (see above), "q5_k_m" (the same with Q5_K for Q4_K, as llama.cpp's Q5_K_M),
    "q6_k": every matrix in Q6_K, as llama.cpp's Q6_K files; "q4_0" / "q8_0": every matrix in that
    type, the output in Q6_K for q4_0 (as llama.cpp's Q4_0 files), in Q8_0 for q8_0."""
    from pagedserve.model_files import default_model_path

    src = gguf.GGUFReader(default_model_path())  # its tokenizer and vocabulary
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(MLP)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    for key, field in src.fields.items():  # the tokenizer, as the default model has it
        if key.startswith("tokenizer."):
            vt = field.types[0]
            val = field.contents()
            if vt == gguf.GGUFValueType.ARRAY:
                w.add_array(key, val)
            else:
                w.add_key_value(key, val, vt)
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(0)
    T = gguf.GGMLQuantizationType
    base = {"q5_k_m": T.Q5_K, "q6_k": T.Q6_K, "q4_0": T.Q4_0, "q8_0": T.Q8_0}.get(mix, T.Q4_K)

    def matrix(rows: int, cols: int, qtype) -> tuple[np.ndarray, T]:
        if qtype == T.Q6_K:
            return random_q6_k(rows, cols, rng), qtype
        if qtype in (T.Q4_K, T.Q5_K):
            return random_k_min(rows, cols, rng, qtype == T.Q5_K), qtype
        return random_block32(rows, cols, rng, qtype), qtype

    def add(name: str, data_type: tuple[np.ndarray, T]) -> None:
        w.add_tensor(name, data_type[0], raw_dtype=data_type[1])

    add("token_embd.weight", matrix(vocab, HIDDEN, base))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    add("output.weight", matrix(vocab, HIDDEN, T.Q8_0 if mix == "q8_0" else T.Q6_K))
    kv = KV_HEADS * HIDDEN // HEADS
    for i in range(LAYERS):
        for name, rows, cols in (
            ("attn_q", HIDDEN, HIDDEN),
            ("attn_k", kv, HIDDEN),
            ("attn_v", kv, HIDDEN),
            ("attn_output", HIDDEN, HIDDEN),
            ("ffn_gate", MLP, HIDDEN),
            ("ffn_up", MLP, HIDDEN),
            ("ffn_down", HIDDEN, MLP),
        ):
            k_m = mix in ("q4_k_m", "q5_k_m") and name in ("attn_v", "ffn_down") and more_bits(i)
            add(f"blk.{i}.{name}.weight", matrix(rows, cols, T.Q6_K if k_m else base))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/pagedserve-q4_k_m-0.9b.gguf")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--mix",
        choices=["q4_k_m", "q5_k_m", "q6_k", "q4_0", "q8_0"],
        default="q4_k_m",
        help="the file's types (q6_k: all Q6_K; q4_0 / q8_0: all that type)",
    )
    a = ap.parse_args()
    if not os.path.exists(a.out):
        write_model(a.out, a.mix)
    from pagedserve import LLM, SamplingParams
    from pagedserve.executor.quant import kernels

    llm = LLM(a.out, dtype="bfloat16", max_model_len=1024)
    prompt = {"prompt_token_ids": [100 + 7 * i for i in range(32)]}
    sp = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=0)
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    tok_s = {"on": [], "off": []}
    for _ in range(a.rounds):
        for mode in ("on", "off"):
            kernels.set_rows16_bf16(mode == "on")
            t = time.perf_counter()
            llm.generate([prompt], sp, use_tqdm=False)
            tok_s[mode].append(a.tokens / (time.perf_counter() - t))
    kernels.set_rows16_bf16(None)
    med = {k: round(statistics.median(v), 2) for k, v in tok_s.items()}
    print(
        json.dumps(
            {
                "bench": "kquant_decode",
                "model": a.out,
                "isa": kernels.current_isa(),
                "batch1_tok_s": med,
                "ratio": round(med["on"] / med["off"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
