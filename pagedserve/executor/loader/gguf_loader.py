"""GGUF files through the `gguf` library: llama.cpp's llama (Llama, Mistral, and Mixtral
with experts), qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3 and phi3 architectures.

Metadata becomes a HF-style config dict, tensors are dequantized to float32 (any type the
library knows: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, ...), and llama.cpp's
rotary permutation of the Q/K rows is undone (llama architecture only), stacked experts
are split per expert, Gemma's norms (stored as 1 + w) go back to HF's w. The tokenizer is converted by transformers'
GGUF support.

Parsing a GGUF's metadata is slow in Python (seconds for a 49k-token vocabulary), so a
file's metadata is converted once into a Hugging Face directory (config.json, tokenizer files,
and an index of its tensors: name, type, shape, offset) under the cache dir
($PAGEDSERVE_CACHE_DIR, default ~/.cache/pagedserve), keyed by the file's path, size and mtime;
a newer conversion of the same path removes the older ones. The weights always come from the
GGUF itself, memory-mapped through the index, one tensor at a time: packed
(`iterate_gguf_packed`, by default on a CPU: pagedserve.executor.quant's kernels run the blocks)
or dequantized to float32 (`iterate_gguf_float`, quantization="none" and the GPU). Nothing of
4 bytes a weight is written to disk or held whole in memory: an 8 B model's float32 conversion
would be 32 GB of each.
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

CONVERTER_VERSION = 4  # 4: no float32 safetensors in the conversion

# llama.cpp's architecture names -> HF architectures ("llama" with experts: Mixtral)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
_GEMMA = ("gemma2", "gemma3")

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
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3: fused
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the router
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_ARCH_LAYER_NAMES = {  # where an architecture names a tensor differently
    "gemma2": {
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "attn_post_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    "phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"},  # gate and up, fused
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
# stacked experts [E, rows, cols] (ggml: cols, rows, E) -> per-expert HF names
_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj", "ffn_down_exps.weight": "down_proj"}
_OLD_EXPERT = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}  # blk.N.ffn_gate.E.weight
# tensors that stay float even in packed mode: the routers are not linear layers
UNPACKED = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


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
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)}).")
    p = arch + "."
    heads = _field(r, p + "attention.head_count")
    tensor_names = {t.name for t in r.tensors}
    vocab = _field(r, p + "vocab_size") or len(r.fields["tokenizer.ggml.tokens"].data)
    hidden = _field(r, p + "embedding_length")
    experts = _field(r, p + "expert_count") or 0
    hf_arch = "MixtralForCausalLM" if arch == "llama" and experts else ARCHITECTURES[arch]
    cfg = {
        "architectures": [hf_arch],
        "model_type": arch,
        "pagedserve_gguf_arch": arch,
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
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
    }
    scale_type = _field(r, p + "rope.scaling.type")
    if scale_type == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _field(r, p + "rope.scaling.factor")}
    elif scale_type == "yarn":
        cfg["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": _field(r, p + "rope.scaling.factor"),
            "original_max_position_embeddings": _field(r, p + "rope.scaling.original_context_length"),
        }
    if experts:
        _moe_config(cfg, r, p, arch, experts)
    _family_config(cfg, r, p, arch)
    return cfg


def _moe_config(cfg: dict, r, p: str, arch: str, experts: int) -> None:
    """llama.cpp's MoE keys; renormalisation as its loaders hard-code it (Mixtral and
    Qwen3-MoE renormalise the top-k weights, Qwen2-MoE does not)."""
    key = "num_local_experts" if arch == "llama" else "num_experts"
    cfg[key] = experts
    cfg["num_experts_per_tok"] = _field(r, p + "expert_used_count")
    ff = _field(r, p + "expert_feed_forward_length")
    if ff:
        cfg["moe_intermediate_size"] = ff
        if arch == "llama":
            cfg["intermediate_size"] = ff
    cfg["norm_topk_prob"] = arch != "qwen2moe"
    shared = _field(r, p + "expert_shared_feed_forward_length")
    if shared:
        cfg["shared_expert_intermediate_size"] = shared


def _family_config(cfg: dict, r, p: str, arch: str) -> None:
    """Gemma's soft caps, window and pattern; Phi-3's window and LongRoPE factors (stored
    as tensors). Gemma's query_pre_attn_scalar is llama.cpp's rule: head_dim, but
    hidden / heads for the 27B models (46 / 62 layers)."""
    n = cfg["num_hidden_layers"]
    window = _field(r, p + "attention.sliding_window")
    if window:
        cfg["sliding_window"] = window
    if arch in _GEMMA:
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        for k in ("attn_logit_softcapping", "final_logit_softcapping"):
            if _field(r, p + k) is not None:
                cfg[k] = _field(r, p + k)
        big = {"gemma2": 46, "gemma3": 62}[arch]
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if n == big else cfg["head_dim"]
        pattern = 2 if arch == "gemma2" else 6
        cfg["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
        if arch == "gemma3":
            cfg["rope_local_base_freq"] = 10000.0
    if arch == "phi3":
        factors = {t.name: np.asarray(t.data, dtype=np.float32).reshape(-1).tolist() for t in r.tensors
                   if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
        orig = _field(r, p + "rope.scaling.original_context_length")
        if factors:
            cfg["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": factors["rope_factors_long.weight"],
                "short_factor": factors["rope_factors_short.weight"],
                "original_max_position_embeddings": orig,
            }
            attn = _field(r, p + "rope.scaling.attn_factor")
            if attn is not None:
                cfg["rope_scaling"]["attention_factor"] = attn
        if orig:
            cfg["original_max_position_embeddings"] = orig


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert permutation (HF rotate-half order -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gname: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor (None: not a weight we load, or stacked experts)."""
    name = _NAMES.get(gname)
    if name is None and gname.startswith("blk."):
        _, idx, rest = gname.split(".", 2)
        parts = rest.split(".")
        if len(parts) == 3 and parts[0] in _OLD_EXPERT and parts[1].isdigit():  # one expert's tensor
            return f"model.layers.{idx}.mlp.experts.{parts[1]}.{_OLD_EXPERT[parts[0]]}.weight"
        rest = _ARCH_LAYER_NAMES.get(arch, {}).get(rest) or _LAYER_NAMES.get(rest)
        if rest is not None:
            name = f"model.layers.{idx}.{rest}"
    return name


def _rope_heads(gname: str, arch: str, heads: int, kv_heads: int) -> int:
    """Heads to un-permute a Q/K tensor over (llama-architecture files only), else 0."""
    if arch != "llama":
        return 0
    return heads if gname.endswith("attn_q.weight") else kv_heads if gname.endswith("attn_k.weight") else 0


def convert_tensor(gname: str, w: np.ndarray, arch: str, heads: int, kv_heads: int) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float array) for a dequantized GGUF tensor already in HF shape: Q/K rows
    un-permuted (llama), stacked experts split, Gemma's stored (1 + w) norms back to w, the
    shared expert's gate as a [1, H] row."""
    if gname.startswith("blk.") and gname.split(".", 2)[2] in _EXPERTS:
        idx, rest = gname.split(".", 2)[1:]
        for e in range(w.shape[0]):
            yield f"model.layers.{idx}.mlp.experts.{e}.{_EXPERTS[rest]}.weight", w[e]
        return
    name = hf_name(gname, arch)
    if name is None:
        return  # e.g. rope_freqs, rope_factors_* (config)
    n_head = _rope_heads(gname, arch, heads, kv_heads)
    if n_head:
        w = unpermute_rope(w, n_head)
    if arch in _GEMMA and gname.endswith("norm.weight"):
        w = w - 1.0
    if gname.endswith("ffn_gate_inp_shexp.weight"):
        w = w.reshape(1, -1)
    yield name, w


def _heads(r) -> tuple[str, int, int]:
    arch = _field(r, "general.architecture") or "llama"
    heads = _field(r, f"{arch}.attention.head_count") or 1
    return arch, heads, _field(r, f"{arch}.attention.head_count_kv", heads)


def iterate_gguf(path: str, reader=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) of every weight of the GGUF file at `path` (see iterate_gguf_float)."""
    r = reader or _reader(path)
    arch, heads, kv_heads = _heads(r)
    config = {"pagedserve_gguf_arch": arch, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    return iterate_gguf_float(path, tensor_index(r), config)


def dequantize_raw(raw: np.ndarray, info: dict, fast: bool = False) -> np.ndarray:
    """One tensor's bytes (of the tensor index's `info`) -> float32 in HF shape: gguf's numpy
    dequantization (any type it knows), or with `fast` the packed kernels' multi-threaded one
    for their block types (the same values to float32 rounding; ~20x faster on a Q4_K file)."""
    import gguf

    from pagedserve.executor.quant.formats import PACKED_TYPES

    shape = tuple(reversed(info["shape"]))
    if fast and info["type"] in PACKED_TYPES:
        from pagedserve.executor.quant import kernels

        rows = torch.from_numpy(np.array(raw, order="C").reshape(-1, info["nbytes"] // int(np.prod(shape[:-1]))))
        return kernels.dequant(rows, info["type"], shape[-1]).numpy().reshape(shape)
    qtype = gguf.GGMLQuantizationType(info["type"])
    w = gguf.quants.dequantize(raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1]), qtype)
    return np.asarray(w, dtype=np.float32).reshape(shape)


def iterate_gguf_float(source: str, index: dict, config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) of every weight of a GGUF, read from the memory-mapped file and
    dequantized one tensor at a time (the packed kernels' dequantization where they run, else
    gguf's): Q/K rows un-permuted (llama), stacked experts split, Gemma's norms back to HF's
    (convert_tensor)."""
    from pagedserve.executor.quant import _kernels_usable

    arch = config.get("pagedserve_gguf_arch", "llama")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    fast = _kernels_usable()
    mm = np.memmap(source, dtype=np.uint8, mode="r")
    try:
        for gname, info in index.items():
            w = dequantize_raw(mm[info["offset"] : info["offset"] + info["nbytes"]], info, fast)
            for name, a in convert_tensor(gname, w, arch, heads, kv_heads):
                yield name, torch.from_numpy(np.array(a, dtype=np.float32, order="C"))
    finally:
        del mm


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
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(out))
    try:
        reader = _reader(path)
        cfg = gguf_to_hf_config(path, reader)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
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
    _remove_stale_conversions(out, os.path.abspath(path))
    return out


def _remove_stale_conversions(current: str, source: str) -> None:
    """Delete the other conversions of the same path (the file changed since, or an older
    converter made them; v3 and before held a float32 copy of every weight)."""
    parent = os.path.dirname(current)
    prefix = os.path.basename(current).rsplit("-", 1)[0] + "-"
    for name in os.listdir(parent):
        d = os.path.join(parent, name)
        if not name.startswith(prefix) or d == current:
            continue
        try:
            with open(os.path.join(d, "pagedserve_gguf.json")) as f:
                stale = json.load(f).get("source") == source
        except (OSError, ValueError):
            continue
        if stale:
            shutil.rmtree(d, ignore_errors=True)


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
    PackedWeight copied once out of the file, Q/K rows un-permuted), stacked experts as one
    PackedWeight per expert, the rest as float32 (the routers among them)."""

    from pagedserve.executor.quant.formats import F32, PACKED_TYPES, PackedWeight

    arch = config.get("pagedserve_gguf_arch", "llama")
    heads = config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    # a fused layer (q/k/v, gate/up) is packed whole if any of its parts is: float parts of it
    # then travel as F32 rows
    groups = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gu", "ffn_up": "gu",
              "ffn_gate_shexp": "gus", "ffn_up_shexp": "gus", "ffn_gate_exps": "exps", "ffn_up_exps": "exps",
              "ffn_down_exps": "exps"}

    def group(gname: str) -> str | None:
        parts = gname.split(".")
        if len(parts) == 5 and parts[0] == "blk" and parts[3].isdigit():  # one expert's tensor
            return f"{parts[1]}.e{parts[3]}"
        g = groups.get(parts[2]) if len(parts) == 4 and parts[0] == "blk" else None
        return f"{parts[1]}.{g}" if g else None

    def packable(gname: str, info: dict) -> bool:
        dims = 3 if gname.split(".", 2)[-1] in _EXPERTS else 2
        return info["type"] in PACKED_TYPES and len(info["shape"]) == dims and not gname.endswith(UNPACKED)

    packed_groups = {group(n) for n, i in index.items() if group(n) and packable(n, i)}
    mm = np.memmap(source, dtype=np.uint8, mode="r")
    try:
        for gname, info in index.items():
            qtype = info["type"]
            raw = mm[info["offset"] : info["offset"] + info["nbytes"]]
            shape = tuple(reversed(info["shape"]))
            name = hf_name(gname, arch)
            if packable(gname, info) and name is None:  # stacked experts: one weight each
                per = raw.reshape(shape[0], shape[1], -1)
                for (hf, _), e in zip(convert_tensor(gname, per, arch, heads, kv_heads), range(shape[0])):
                    yield hf, PackedWeight(qtype, torch.from_numpy(np.array(per[e], order="C")), shape[1:])
                continue
            if packable(gname, info) and name is not None:
                rows = raw.reshape(shape[0], -1)
                n_head = _rope_heads(gname, arch, heads, kv_heads)
                if n_head:
                    rows = unpermute_rope(rows, n_head)
                data = torch.from_numpy(np.array(rows, order="C"))  # one copy, the file is closed after
                yield name, PackedWeight(qtype, data, shape)
                continue
            w = dequantize_raw(raw, info)
            for hf, a in convert_tensor(gname, w, arch, heads, kv_heads):
                t = torch.from_numpy(np.array(a, dtype=np.float32, order="C"))
                if group(gname) in packed_groups and t.dim() == 2:
                    yield hf, PackedWeight(F32, t.view(torch.uint8).reshape(t.shape[0], -1), tuple(t.shape))
                else:
                    yield hf, t
    finally:
        del mm


def iterate_packed_model(model_dir: str) -> Iterator[tuple[str, object]]:
    """The packed weights of the GGUF behind a converted directory."""
    source, config = _source_and_config(model_dir)
    return iterate_gguf_packed(source, packed_tensor_index(model_dir, source), config)


def iterate_float_model(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The float32 weights of the GGUF behind a converted directory."""
    source, config = _source_and_config(model_dir)
    return iterate_gguf_float(source, packed_tensor_index(model_dir, source), config)


def _source_and_config(model_dir: str) -> tuple[str, dict]:
    source = gguf_source(model_dir)
    if source is None or not os.path.exists(source):
        raise FileNotFoundError(f"{model_dir}: its source GGUF file is gone ({source})")
    with open(os.path.join(model_dir, "config.json")) as f:
        return source, json.load(f)
