"""Speculative decoding (n-gram prompt lookup) against plain decoding, same model, same run.

    pagedserve bench spec [--model default] [--k 4] [--max-tokens 160] [--batch-load 64]

Part 1, batch 1, input-grounded chat prompts (copy or lightly edit a given paragraph or
function): decode tokens/s with and without speculation (greedy, so the outputs must be
identical, which is checked), acceptance rate and mean accepted length (vLLM's meanings).
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


def run_batch1(llm, prompts, max_tokens: int) -> dict:
    from pagedserve import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    outs, decode_s, n_dec = [], 0.0, 0
    for p in prompts:
        llm.generate([p], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)  # prefill cached
        t = time.perf_counter()
        (o,) = llm.generate([p], sp, use_tqdm=False)
        dt = time.perf_counter() - t
        n = len(o.outputs[0].token_ids)
        decode_s += dt
        n_dec += n
        outs.append(o.outputs[0].token_ids)
    return {"tok_s": round(n_dec / decode_s, 2), "tokens": n_dec, "seconds": round(decode_s, 2), "outs": outs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch-load", type=int, default=0, help="also N random prompts at once (0: skip)")
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args(argv)

    from pagedserve import LLM, SamplingParams
    from pagedserve.tokenizer import apply_chat_template

    spec_cfg = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    base = LLM(a.model, dtype=a.dtype)
    spec = LLM(a.model, dtype=a.dtype, speculative_config=spec_cfg)
    tok = base.get_tokenizer()
    prompts = [
        {"prompt_token_ids": apply_chat_template(tok, [{"role": "user", "content": t.format(p=p)}])}
        for t in TASKS
        for p in PARAGRAPHS
    ]
    r_base = run_batch1(base, prompts, a.max_tokens)
    r_spec = run_batch1(spec, prompts, a.max_tokens)
    st = spec.get_stats()
    result = {
        "bench": "spec",
        "model": a.model,
        "k": a.k,
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
        tput = {}
        for name, llm in (("off", base), ("on", spec)):
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": w} for w in work], sp, use_tqdm=False)
            tput[name] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
        result["load"] = {
            "requests": a.batch_load,
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
