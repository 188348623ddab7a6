"""Few-row decode on the AVX2 path (BENCHMARKS section 56): a float32 engine with
PAGEDSERVE_CPU_ISA=avx2 (what CPUs without AVX-512 run: Zen 2 / Zen 3, Intel's client cores),
its packed layers with the row-interleaved copies (weight_copies auto: quant_rows16_avx2.h)
against without them (weight_copies none: the packed rows' kernels, all AVX2 CPUs had before),
two engines in this process, alternated round by round.

    PAGEDSERVE_CPU_ISA=avx2 .venv/bin/python benchmarks/avx2_rows16_decode.py [--model default|FILE.gguf]
        [--batch 1 4] [--tokens 64] [--rounds 3]

Q6_K's copies are the byte layout (a path forced below avx512 gets it, as a CPU without AVX512-VBMI). Prints
one JSON line per batch size: output tokens/s of `LLM.generate` (greedy, ignore_eos), median of
--rounds, without and with the copies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from pagedserve import LLM, SamplingParams
from pagedserve.executor.quant import kernels
from pagedserve.model_files import default_model_path

PROMPTS = ["Hello there", "The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]


def rate(llm: LLM, batch: int, tokens: int) -> float:
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    t = time.perf_counter()
    llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(batch)], sp, use_tqdm=False)
    return batch * tokens / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if os.environ.get("PAGEDSERVE_CPU_ISA") != "avx2":
        raise SystemExit("run with PAGEDSERVE_CPU_ISA=avx2")
    model = default_model_path() if a.model == "default" else a.model
    engines = {c: LLM(model=model, dtype="float32", max_model_len=512, weight_copies=c) for c in ("none", "auto")}
    for llm in engines.values():
        rate(llm, 1, 8)  # warm-up
    for batch in a.batch:
        rates: dict[str, list[float]] = {c: [] for c in engines}
        for _ in range(a.rounds):
            for c, llm in engines.items():
                rates[c].append(rate(llm, batch, a.tokens))
        med = {c: statistics.median(r) for c, r in rates.items()}
        print(json.dumps({"bench": "avx2_rows16_decode", "model": a.model, "isa": kernels.current_isa(), "batch": batch,
                          "packed_tok_s": round(med["none"], 2), "copies_tok_s": round(med["auto"], 2),
                          "ratio": round(med["auto"] / med["none"], 3),
                          "all": {c: [round(x, 2) for x in r] for c, r in rates.items()}}), flush=True)


if __name__ == "__main__":
    main()
