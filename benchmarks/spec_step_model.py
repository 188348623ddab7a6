"""How fast can n-gram speculation be at batch 1, given what a verification step costs?

    python benchmarks/spec_step_model.py [--max-tokens 128] [--costs 0.3 0.25 0.2 0.15] [--ks 4 8]

Greedy outputs do not depend on speculation, so one plain run of `pagedserve bench spec`'s
prompts (input-grounded chat prompts on the default model) fixes every token; the n-gram
proposer (core/ngram_proposer.py, prompt_lookup_min 2, max 4) and the scheduler's
adaptive k (core/spec_decode.py: halve after a miss, pause after misses at k = 1, double
after a full accept) are then replayed on those tokens without the model. A step that
verifies r rows costs 1 + c * (r - 1) plain steps; the printed speedup is tokens / sum of
step costs, i.e. the bench's ratio if every step cost exactly that. `c` is measured as
(verification step / plain step - 1) / k: 0.30 on the 2-core AVX2 machine of BENCHMARKS.md
(section 22); the floor for float-exact products is the rows' multiply-adds at the FMA
peak: 135M MACs / 88.6 GMAC/s = 1.5 ms per row against an 8.2 ms plain step, c ~ 0.19.
Prints JSON lines.
"""

from __future__ import annotations

import argparse
import json


def replay(prompts, outputs, k_max: int, c: float, min_n: int = 2, max_n: int = 4) -> dict:
    from pagedserve.core.ngram_proposer import NgramProposer
    from pagedserve.core.spec_decode import PAUSE_STEPS

    prop = NgramProposer(k_max, min_n, max_n)
    cost = 0.0
    tokens = plain = verify = 0
    for prompt, out in zip(prompts, outputs):
        pos, k, pause = 0, k_max, 0
        while pos < len(out):
            room = len(out) - pos - 1  # the scheduler never guesses past max_tokens
            drafts = []
            if pause:
                pause -= 1
            elif room > 0:
                drafts = prop.propose(list(prompt) + list(out[:pos]), min(k, room))
            acc = 0
            while acc < len(drafts) and drafts[acc] == out[pos + acc]:
                acc += 1
            cost += 1 + c * len(drafts)
            pos += acc + 1
            if not drafts:
                plain += 1
                continue
            verify += 1
            if acc == 0:
                pause = PAUSE_STEPS if k == 1 else 0
                k = max(1, k // 2)
            elif acc == len(drafts):
                k = min(k_max, k * 2)
        tokens += len(out)
    return {"k": k_max, "c": c, "speedup": round(tokens / cost, 3), "tokens": tokens, "plain_steps": plain,
            "verify_steps": verify}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--costs", type=float, nargs="+", default=[0.3, 0.25, 0.2, 0.15])
    ap.add_argument("--ks", type=int, nargs="+", default=[4, 8])
    a = ap.parse_args(argv)

    from pagedserve import LLM, SamplingParams
    from pagedserve.bench.spec import PARAGRAPHS, TASKS
    from pagedserve.tokenizer import apply_chat_template

    llm = LLM("default")
    tok = llm.get_tokenizer()
    prompts = [apply_chat_template(tok, [{"role": "user", "content": t.format(p=p)}]) for t in TASKS for p in PARAGRAPHS]
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    outputs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    for k in a.ks:
        for c in a.costs:
            print(json.dumps(replay(prompts, outputs, k, c)))


if __name__ == "__main__":
    main()
