"""Offline A/B of the bf16 copies of packed weights (BENCHMARKS section 41): the default model,
64 random 256-token prompts x 64 greedy tokens, output tokens per second. Run it twice, copies on
and off, alternating:

    PAGEDSERVE_NO_ONEDNN_PACK=0 .venv/bin/python benchmarks/bf16_copies_ab.py
    PAGEDSERVE_NO_ONEDNN_PACK=1 .venv/bin/python benchmarks/bf16_copies_ab.py
"""

from __future__ import annotations

import json
import os
import random
import time

from pagedserve import LLM, SamplingParams


def main() -> None:
    llm = LLM()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(256)]} for _ in range(64)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    dt = time.perf_counter() - t
    print(json.dumps({"no_onednn_pack": os.environ.get("PAGEDSERVE_NO_ONEDNN_PACK", "0"),
                      "out_tok_s": round(64 * 64 / dt, 1), "total_s": round(dt, 2)}))


if __name__ == "__main__":
    main()
