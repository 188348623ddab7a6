"""Batch-1 decode of a GGUF whose matrices are Q5_0 (or Q5_1): the default model (SmolLM2-135M)
with its Q4_1 matrices requantized, as llama.cpp's Q4_K_M / Q5_K_M mixes store a model whose
rows are not a multiple of 256 (576 here: Q5_0 / Q5_1 stand in for Q4_K / Q5_K). Its
QuantLinear layers run the working tree's quant module and another commit's in turns
(quant_rev_ab.py's old_module), in one engine: tokens a second for each, and the tokens.

    .venv/bin/python benchmarks/q5_decode.py --rev 660ae93 [--type Q5_0] [--dtype float32 bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import gguf
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from quant_rev_ab import old_module  # noqa: E402


def requantized(src_path: str, out: str, qtype) -> str:
    """src's GGUF with every Q4_1 matrix requantized to qtype (from its dequantized values)."""
    src = gguf.GGUFReader(src_path)
    arch = src.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out, arch)
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), vt)
    q41 = gguf.GGMLQuantizationType.Q4_1
    for t in src.tensors:
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists the fastest dimension first
        if t.tensor_type == q41:
            f = gguf.quants.dequantize(np.asarray(t.data), q41).reshape(shape)
            w.add_tensor(t.name, gguf.quants.quantize(f, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # as read: bytes or elements
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def without_q5_copies(qlinear):
    """qlinear of a module from before Q5_0 / Q5_1 had row-interleaved copies (it refuses them):
    their segments' copies left out, so it runs its packed kernels on them."""
    import torch

    q5 = (int(gguf.GGMLQuantizationType.Q5_0), int(gguf.GGMLQuantizationType.Q5_1))

    def op(x, ws, types, cols, n, bias, act_q8, rows16):
        rows16 = [torch.empty(0, dtype=torch.uint8) if t in q5 else r for t, r in zip(types, rows16)]
        return qlinear(x, ws, types, cols, n, bias, act_q8, rows16)

    return op


def decode_rates(path: str, dtype: str, mods: dict, tokens: int, rounds: int) -> dict:
    from pagedserve import LLM, SamplingParams
    from pagedserve.executor.quant.layers import QuantLinear

    llm = LLM(path, dtype=dtype, num_kv_blocks=64, max_num_seqs=1)
    model = llm.engine.engine_core.executor.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode("The history of the printing press")}
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    rates, outs, last = {name: [] for name in mods}, set(), {}
    for _ in range(rounds):
        for name, mod in mods.items():
            for q in layers:
                q._op = mod.qlinear if name == "new" else without_q5_copies(mod.qlinear)
            llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # warm
            t = time.perf_counter()
            o = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
            rates[name].append(tokens / (time.perf_counter() - t))
            outs.add(tuple(o.token_ids))
            last[name] = o.token_ids
    return {
        "tok_s": {name: round(statistics.median(v), 1) for name, v in rates.items()},
        "same_tokens": len(outs) == 1,  # every round of every module
        "text": llm.get_tokenizer().decode(last["new"][:24]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True)
    ap.add_argument("--type", default="Q5_0", choices=("Q5_0", "Q5_1"))
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reuse", action="store_true", help="keep an existing requantized file (else it is rewritten)")
    a = ap.parse_args()
    from pagedserve.executor.quant import kernels
    from pagedserve.model_files import default_model_path

    qtype = getattr(gguf.GGMLQuantizationType, a.type)
    out = f"/tmp/pagedserve-smollm2-{a.type.lower()}.gguf"
    if not (a.reuse and os.path.exists(out)):
        requantized(default_model_path(), out, qtype)
    mods = {"old": old_module(a.rev), "new": kernels.load()}
    for dtype in a.dtype:
        res = decode_rates(out, dtype, mods, a.tokens, a.rounds)
        print(json.dumps({"file": os.path.basename(out), "dtype": dtype, "isa": kernels.current_isa(), **res}), flush=True)


if __name__ == "__main__":
    main()
