"""Speculative decoding (n-gram prompt lookup) against plain decoding, same model, same run.

    pagedserve bench spec [--model default] [--k 4] [--max-tokens 160] [--batch-load 64] [--kv-cache-dtype float16]
        [--method ngram | draft_model [--draft-model PATH | --draft-layers N] [--draft-quantization int4]]

Part 1, batch 1, input-grounded chat prompts (copy or lightly edit a given paragraph or
function): decode tokens/s with and without speculation (greedy, so the outputs must be
identical, which is checked), acceptance rate and mean accepted length (vLLM's meanings).
Each prompt runs without, then with speculation, alternately, so a noisy machine hits both.
--draft-layers N: the draft is the target's first N layers (and its embeddings, final norm
and head), written as a checkpoint of its own: a self-speculative draft with the same
tokenizer, for models that have no smaller sibling at hand.
Part 2, --batch-load N random prompts at once: output throughput with speculation on over
off (speculation switches itself off above max_batch_size running requests).
"""

from __future__ import annotations

import argparse
import json
import random
import time

PARAGRAPHS = [
    "The old lighthouse stood at the end of the rocky point, its white paint peeling in long strips. "
    "Every evening the keeper climbed the one hundred and twelve steps to light the lamp, and every "
    "morning he climbed them again to put it out. Ships passed in the night without ever knowing his name.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
    "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n",
    "To make bread, mix four cups of flour with a spoon of salt and a packet of yeast. Add warm water "
    "slowly until the dough holds together, then knead it for ten minutes. Let it rise for an hour in a "
    "warm place, shape the loaf, and bake it at two hundred degrees for forty minutes.",
    "The committee met on Tuesday to review the budget. After a long discussion, the members agreed to "
    "reduce travel costs by ten percent, to delay the new building until next spring, and to hire two "
    "more teachers for the science department before the start of the school year.",
]
TASKS = [
    "Repeat the following text exactly, word for word:\n\n{p}",
    "Copy this text, changing nothing:\n\n{p}",
]


def run_batch1(llms: dict, prompts, max_tokens: int) -> dict:
    """Decode speed of each engine in `llms` at batch 1, prompt by prompt, alternating."""
    from pagedserve import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    res = {name: {"seconds": 0.0, "tokens": 0, "outs": []} for name in llms}
    for p in prompts:
        for name, llm in llms.items():
            llm.generate([p], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)  # prefill cached
            t = time.perf_counter()
            (o,) = llm.generate([p], sp, use_tqdm=False)
            r = res[name]
            r["seconds"] += time.perf_counter() - t
            r["tokens"] += len(o.outputs[0].token_ids)
            r["outs"].append(o.outputs[0].token_ids)
    for r in res.values():
        r["tok_s"] = round(r["tokens"] / r["seconds"], 2)
        r["seconds"] = round(r["seconds"], 2)
    return res


def truncated_draft(model: str, layers: int) -> str:
    """A checkpoint of the target's first `layers` layers (float weights) in a temporary
    directory; returns its path."""
    import os
    import shutil
    import tempfile

    from safetensors.torch import save_file

    from pagedserve.executor.loader import iterate_weights, load_hf_config_dict, resolve_model_path

    src = resolve_model_path(model)
    out = tempfile.mkdtemp(prefix=f"pagedserve-draft{layers}-")
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name.endswith(".jinja") or name == "generation_config.json":
            shutil.copy(os.path.join(src, name), out)
    cfg = load_hf_config_dict(src)
    if layers >= cfg["num_hidden_layers"]:
        raise ValueError(f"--draft-layers must be below the target's {cfg['num_hidden_layers']} layers")
    cfg["num_hidden_layers"] = layers
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    weights = {}
    for key, t in iterate_weights(src):  # safetensors, or a GGUF's tensors dequantized
        parts = key.split(".")
        if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
            continue
        weights[key] = t.float().contiguous()
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, help="the target's (both engines'), e.g. gguf_q8")
    ap.add_argument("--kv-cache-dtype", default="auto", help="both engines' KV cache (auto, float16, bfloat16)")
    ap.add_argument("--weight-copies", default="auto", help="both engines' (CPU, packed weights): auto | all | none")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch-load", type=int, default=0, help="also N random prompts at once (0: skip)")
    ap.add_argument("--load-rounds", type=int, default=2, help="off/on rounds of the load part, alternating")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--method", default="ngram", choices=["ngram", "draft_model"])
    ap.add_argument("--draft-model", default=None, help="the draft model (method draft_model)")
    ap.add_argument("--draft-layers", type=int, default=0, help="draft = the target's first N layers")
    ap.add_argument("--draft-quantization", default=None, help="the draft's weights: int8, int4 (default: float)")
    a = ap.parse_args(argv)

    from pagedserve import LLM, SamplingParams
    from pagedserve.tokenizer import apply_chat_template

    if a.method == "ngram":
        spec_cfg = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    else:
        draft = a.draft_model or (truncated_draft(a.model, a.draft_layers) if a.draft_layers else None)
        if draft is None:
            ap.error("--method draft_model needs --draft-model PATH or --draft-layers N")
        spec_cfg = {"method": "draft_model", "model": draft, "num_speculative_tokens": a.k}
        if a.draft_quantization:
            spec_cfg["quantization"] = a.draft_quantization
    kw = dict(dtype=a.dtype, quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype, weight_copies=a.weight_copies)
    base = LLM(a.model, **kw)
    spec = LLM(a.model, **kw, speculative_config=spec_cfg)
    tok = base.get_tokenizer()
    prompts = [
        {"prompt_token_ids": apply_chat_template(tok, [{"role": "user", "content": t.format(p=p)}])}
        for t in TASKS
        for p in PARAGRAPHS
    ]
    runs = run_batch1({"base": base, "spec": spec}, prompts, a.max_tokens)
    r_base, r_spec = runs["base"], runs["spec"]
    st = spec.get_stats()
    result = {
        "bench": "spec",
        "model": a.model,
        "k": a.k,
        "method": a.method,
        "quantization": a.quantization,
        "kv_cache_dtype": a.kv_cache_dtype,
        "weight_copies": a.weight_copies,
        "draft": {k: v for k, v in spec_cfg.items() if k in ("model", "quantization")} or None,
        "draft_layers": a.draft_layers or None,
        "batch1": {
            "prompts": len(prompts),
            "plain_tok_s": r_base["tok_s"],
            "spec_tok_s": r_spec["tok_s"],
            "speedup": round(r_spec["tok_s"] / r_base["tok_s"], 2),
            "identical_outputs": r_base["outs"] == r_spec["outs"],
            "acceptance_rate": round(st.spec_acceptance_rate, 3),
            "mean_accepted_length": round(st.spec_mean_accepted_length, 2),
            "accepted_per_position": st.spec_accepted_per_position,
            "drafts": st.spec_num_drafts,
        },
    }
    if a.batch_load:
        rng = random.Random(0)
        vocab = base.engine.model_config.vocab_size
        work = [[rng.randrange(100, vocab) for _ in range(256)] for _ in range(a.batch_load)]
        sp = SamplingParams(max_tokens=64, min_tokens=64, ignore_eos=True, temperature=0)
        toks, secs = {"off": 0, "on": 0}, {"off": 0.0, "on": 0.0}
        for r in range(a.load_rounds):  # alternating, so a noisy stretch hits both
            for name, llm in (("off", base), ("on", spec))[:: 1 if r % 2 == 0 else -1]:
                t = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": w} for w in work], sp, use_tqdm=False)
                secs[name] += time.perf_counter() - t
                toks[name] += sum(len(o.outputs[0].token_ids) for o in outs)
        tput = {name: toks[name] / secs[name] for name in toks}
        result["load"] = {
            "requests": a.batch_load,
            "rounds": a.load_rounds,
            "off_tok_s": round(tput["off"], 1),
            "on_tok_s": round(tput["on"], 1),
            "ratio": round(tput["on"] / tput["off"], 3),
        }
    print(json.dumps(result), flush=True)
    if a.output_json:
        with open(a.output_json, "w") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
