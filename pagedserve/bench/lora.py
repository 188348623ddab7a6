"""Many LoRA adapters in one batch beside the base model alone, same engine, same run.

    pagedserve bench lora [--model default] [--num-streams 64] [--num-adapters 8] [--rank 16]
        [--targets q_proj k_proj v_proj o_proj gate_proj up_proj down_proj]
        [--input-len 128] [--output-len 128] [--seed 0] [--output-json FILE]

The adapters are random PEFT LoRA directories (adapter_config.json +
adapter_model.safetensors, non-zero A and B) written for the model's shapes into a
temporary directory. One engine (enable_lora, max_loras = the adapter count, max_num_seqs
= the stream count) runs the same prompts twice: every stream on the base model, then the
streams spread round-robin over the adapters (one step mixes them all). Prompts are
random token ids, outputs have exact lengths (ignore_eos, greedy), so both runs do the
same work; `ratio` is the adapters' output tokens/s over the base model's (goal >= 0.8).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_random_adapter(out_dir: str, dims, rank: int, targets: list[str], seed: int, alpha: float = 32.0) -> str:
    """A PEFT LoRA directory with random A and B (std 0.02 / 0.01) for a base of `dims`
    (pagedserve.lora.BaseDims)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(dims.num_layers):
        for t in targets:
            out, inp = dims.shape(t)
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "bias": "none",
           "use_rslora": False, "use_dora": False, "fan_in_fan_out": False}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return out_dir


def _run(llm, prompts, sp, loras) -> dict:
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
    wall = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == len(prompts) * sp.max_tokens, "unexpected output lengths"
    return {"wall_s": round(wall, 3), "output_tokens": n_out, "output_tok_s": round(n_out / wall, 1)}


def run(args) -> dict:
    import random

    from pagedserve import LLM, LoRARequest, SamplingParams
    from pagedserve.lora import BaseDims

    llm = LLM(args.model, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=max(16, args.rank),
              max_num_seqs=args.num_streams, seed=args.seed, **({"dtype": args.dtype} if args.dtype else {}))
    dims = BaseDims.of(llm.engine.model_config)
    tmp = tempfile.mkdtemp(prefix="pagedserve-bench-lora-")
    loras = [
        LoRARequest(f"a{i}", i + 1, write_random_adapter(os.path.join(tmp, f"a{i}"), dims, args.rank, args.targets, i))
        for i in range(args.num_adapters)
    ]
    rng = random.Random(args.seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]} for _ in range(args.num_streams)]
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    per_stream = [loras[i % len(loras)] for i in range(args.num_streams)]
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    llm.generate(prompts[: len(loras)], warm, use_tqdm=False, lora_request=loras)  # adapters read, slots filled
    base = _run(llm, prompts, sp, None)
    llm.reset_prefix_cache()
    lora = _run(llm, prompts, sp, per_stream)
    llm.shutdown()
    return {
        "bench": "lora",
        "model": args.model,
        "streams": args.num_streams,
        "adapters": args.num_adapters,
        "rank": args.rank,
        "targets": args.targets,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "base": base,
        "lora": lora,
        "ratio": round(lora["output_tok_s"] / base["output_tok_s"], 3),
        "cpu_threads": __import__("torch").get_num_threads(),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="pagedserve bench lora", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--num-streams", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", nargs="+", default=ALL_TARGETS)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    res = run(args)
    print(json.dumps(res))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=1)
