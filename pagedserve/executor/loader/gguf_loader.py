"""Llama-architecture GGUF files through the `gguf` library.

Metadata becomes a HF-style config dict, tensors are dequantized to float32 (any type the
library knows: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, ...), and llama.cpp's
rotary permutation of the Q/K rows is undone. The tokenizer is converted by transformers'
GGUF support.

Parsing a GGUF's metadata is slow in Python (seconds for a 49k-token vocabulary), so a
file is converted once into a Hugging Face directory (config.json, tokenizer files,
float32 safetensors) under the cache dir ($PAGEDSERVE_CACHE_DIR, default
~/.cache/pagedserve), keyed by the file's path, size and mtime; later loads mmap it.

By default (quantization=None on a CPU) the float32 copy is not what runs: the block-quantized
tensors are read packed from the GGUF itself (`iterate_gguf_packed`, through a tensor index
kept beside the conversion) and run by pagedserve.executor.quant's kernels; the float32
conversion serves quantization="none".
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

import numpy as np
import torch

from pagedserve import envs

CONVERTER_VERSION = 2

_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _reader(path: str):
    try:
        import gguf
    except ImportError as e:  # the engine core does not need gguf
        raise ImportError(
            "loading GGUF files needs the 'gguf' package: pip install 'pagedserve[gguf]'"
        ) from e
    return gguf.GGUFReader(path)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_to_hf_config(path: str, reader=None) -> dict:
    r = reader or _reader(path)
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama').")
    p = "llama."
    heads = _field(r, p + "attention.head_count")
    tensor_names = {t.name for t in r.tensors}
    vocab = _field(r, p + "vocab_size") or len(r.fields["tokenizer.ggml.tokens"].data)
    hidden = _field(r, p + "embedding_length")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _field(r, p + "feed_forward_length"),
        "num_hidden_layers": _field(r, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(r, p + "attention.head_count_kv", heads),
        "head_dim": _field(r, p + "attention.key_length")
        or _field(r, p + "rope.dimension_count")
        or hidden // heads,
        "rms_norm_eps": _field(r, p + "attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _field(r, p + "rope.freq_base", 10000.0),
        "max_position_embeddings": _field(r, p + "context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
    }
    scale_type = _field(r, p + "rope.scaling.type")
    if scale_type == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _field(r, p + "rope.scaling.factor")}
    return cfg


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert permutation (HF rotate-half order -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iterate_gguf(path: str, reader=None) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    r = reader or _reader(path)
    heads = _field(r, "llama.attention.head_count")
    kv_heads = _field(r, "llama.attention.head_count_kv", heads)
    for t in r.tensors:
        name = _NAMES.get(t.name)
        if name is None and t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if rest in _LAYER_NAMES:
                name = f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
        if name is None:
            continue  # e.g. rope_freqs
        w = gguf.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml lists dims fastest first
        w = w.reshape(shape)
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rope(w, heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rope(w, kv_heads)
        yield name, torch.from_numpy(np.array(w, dtype=np.float32, order="C"))


def cache_dir() -> str:
    return envs.PAGEDSERVE_CACHE_DIR


def converted_dir(path: str) -> str:
    """The cached HF directory for a GGUF file (converting it on first use)."""
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}"
    name = os.path.basename(path).removesuffix(".gguf")
    out = os.path.join(cache_dir(), "gguf", f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
    if os.path.exists(os.path.join(out, "pagedserve_gguf.json")):
        return out
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(out))
    try:
        reader = _reader(path)
        cfg = gguf_to_hf_config(path, reader)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        save_file(dict(iterate_gguf(path, reader)), os.path.join(tmp, "model.safetensors"))
        with open(os.path.join(tmp, PACKED_INDEX), "w") as f:
            json.dump(tensor_index(reader), f)
        del reader
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, "pagedserve_gguf.json"), "w") as f:
            json.dump({"source": os.path.abspath(path), "key": key}, f)
        try:
            os.rename(tmp, out)
        except OSError:  # another process converted it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# -- packed (quantized) tensors, read from the GGUF itself ------------------------------------------
PACKED_INDEX = "pagedserve_gguf_tensors.json"


def tensor_index(reader) -> dict:
    """name -> type, ggml shape (fastest dim first), absolute file offset and byte count."""
    return {
        t.name: {
            "type": int(t.tensor_type),
            "shape": [int(x) for x in t.shape],
            "offset": int(t.data_offset),
            "nbytes": int(t.n_bytes),
        }
        for t in reader.tensors
    }


def gguf_source(model_dir: str) -> str | None:
    """The GGUF file a converted directory came from (None for a plain HF directory)."""
    meta = os.path.join(model_dir, "pagedserve_gguf.json")
    if not os.path.exists(meta):
        return None
    with open(meta) as f:
        return json.load(f)["source"]


def packed_tensor_index(model_dir: str, source: str) -> dict:
    """The converted directory's tensor index (written once: parsing the GGUF takes seconds)."""
    path = os.path.join(model_dir, PACKED_INDEX)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    index = tensor_index(_reader(source))
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(index, f)
    os.replace(tmp, path)
    return index


def iterate_gguf_packed(source: str, index: dict, config: dict) -> Iterator[tuple[str, object]]:
    """(HF name, tensor) with every 2-D tensor of a block-quantized type kept packed (a
    PackedWeight copied once out of the file, Q/K rows un-permuted), the rest as float32."""
    import gguf

    from pagedserve.executor.quant.formats import F32, PACKED_TYPES, PackedWeight

    heads = config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    # a fused layer (q/k/v, gate/up) is packed whole if any of its parts is: float parts of it
    # then travel as F32 rows
    groups = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gu", "ffn_up": "gu"}

    def group(gname: str) -> str | None:
        parts = gname.split(".")
        g = groups.get(parts[2]) if len(parts) == 4 and parts[0] == "blk" else None
        return f"{parts[1]}.{g}" if g else None

    packed_groups = {
        group(n) for n, i in index.items() if group(n) and i["type"] in PACKED_TYPES and len(i["shape"]) == 2
    }
    mm = np.memmap(source, dtype=np.uint8, mode="r")
    try:
        for gname, info in index.items():
            name = _NAMES.get(gname)
            if name is None and gname.startswith("blk."):
                _, idx, rest = gname.split(".", 2)
                if rest in _LAYER_NAMES:
                    name = f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
            if name is None:
                continue
            qtype = info["type"]
            raw = mm[info["offset"] : info["offset"] + info["nbytes"]]
            shape = tuple(reversed(info["shape"]))
            n_head = heads if gname.endswith("attn_q.weight") else kv_heads if gname.endswith("attn_k.weight") else 0
            if qtype in PACKED_TYPES and len(shape) == 2:
                rows = raw.reshape(shape[0], -1)
                if n_head:
                    rows = unpermute_rope(rows, n_head)
                data = torch.from_numpy(np.array(rows, order="C"))  # one copy, the file is closed after
                yield name, PackedWeight(qtype, data, shape)
            else:
                bsize = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)][1]
                w = gguf.quants.dequantize(raw.reshape(-1, bsize), gguf.GGMLQuantizationType(qtype))
                w = np.asarray(w, dtype=np.float32).reshape(shape)
                if n_head:
                    w = unpermute_rope(w, n_head)
                t = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
                if group(gname) in packed_groups:
                    yield name, PackedWeight(F32, t.view(torch.uint8).reshape(shape[0], -1), shape)
                else:
                    yield name, t
    finally:
        del mm


def iterate_packed_model(model_dir: str) -> Iterator[tuple[str, object]]:
    """The packed weights of the GGUF behind a converted directory."""
    source = gguf_source(model_dir)
    if source is None or not os.path.exists(source):
        raise FileNotFoundError(f"{model_dir}: its source GGUF file is gone ({source})")
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return iterate_gguf_packed(source, packed_tensor_index(model_dir, source), config)
