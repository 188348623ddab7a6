"""Batch-1 decode of a K-quant GGUF in a float32 engine (BENCHMARKS section 55): the path of
AVX-512 CPUs without AVX512-BF16 (Skylake-SP .. Ice Lake), where dtype auto is float32 and the
few-row products run on the float kernel (quant/csrc/quant_rows16.h). The file is
kquant_decode.py's synthetic 0.9 B Q4_K_M mix (`kquant_decode.py --out FILE` writes it).

    .venv/bin/python benchmarks/kquant_float_decode.py [--model /tmp/q4k.gguf] [--q6k-bytes]

--q6k-bytes: Q6_K's copies a byte a quant (what such CPUs get; on a CPU with AVX512-VBMI and
AVX512-BF16 the six-bit copy is the default, which only the bf16 kernel reads). Run it from
another checkout (PYTHONPATH) for the A/B against an older commit. Prints one JSON line: output
tokens/s of `LLM.generate`, median of --rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedserve import LLM, SamplingParams
from pagedserve.executor.quant import kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/q4k.gguf")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--q6k-bytes", action="store_true")
    a = ap.parse_args()
    if a.q6k_bytes and hasattr(kernels, "set_q6k_six_bits"):
        kernels.set_q6k_six_bits(False)
    llm = LLM(model=a.model, dtype="float32", max_model_len=512)
    sp = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=0)
    llm.generate(["Hello there"], sp, use_tqdm=False)
    rates = []
    for _ in range(a.rounds):
        t = time.perf_counter()
        llm.generate(["Hello there"], sp, use_tqdm=False)
        rates.append(a.tokens / (time.perf_counter() - t))
    print(json.dumps({"bench": "kquant_float_decode", "model": a.model, "q6k_bytes": a.q6k_bytes,
                      "batch1_tok_s": round(statistics.median(rates), 2)}))


if __name__ == "__main__":
    main()
