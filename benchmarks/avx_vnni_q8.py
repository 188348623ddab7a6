"""gguf_q8's integer products on the AVX2 level, vpmaddubsw (avx2) against AVX-VNNI's vpdpbusd
(avx_vnni), forced by set_isa on a CPU that has both: median us per product (hot cache), the
default model's shapes and a 1 B model's, Q4_1 / Q8_0 / Q4_K, on the packed rows and on the
row-interleaved copies (below the AVX2 level's 12 rows, where act_q8 reads them).

    python benchmarks/avx_vnni_q8.py

--engine MODEL: the engine instead, under the path PAGEDSERVE_CPU_ISA names (run it once per
path, alternating): gguf_q8 in float32, 64 requests of 256 random tokens generating 64 each
(greedy, ignore_eos), and one request alone; prints generated tok/s and the one's ms a token.

    PAGEDSERVE_CPU_ISA=avx2 python benchmarks/avx_vnni_q8.py --engine M.gguf
    PAGEDSERVE_CPU_ISA=avx_vnni python benchmarks/avx_vnni_q8.py --engine M.gguf
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from pagedserve.bench.timing import sample_times
from pagedserve.executor.quant import kernels


def packed(qtype, n, k, seed=0):
    """Random blocks with finite scales (the tests' own generator)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    from tests.executor.test_quant_kernels import random_packed

    return torch.from_numpy(random_packed(qtype, n, k, seed))


def us(fn, n=30):
    return statistics.median(sample_times(fn, n, warmup=3)) * 1e6


def main():
    if "avx_vnni" not in kernels.available_isas():
        print(json.dumps({"skipped": "this CPU lacks AVX-VNNI"}))
        return
    prev = kernels.current_isa()
    shapes = {"gate_up [3072, 576]": (3072, 576), "down [576, 1536]": (576, 1536), "1B mlp [5632, 2048]": (5632, 2048)}
    try:
        for qtype in (Q.Q4_1, Q.Q8_0, Q.Q4_K):
            for name, (n, k) in shapes.items():
                if k % GGML_QUANT_SIZES[qtype][0]:
                    continue
                w = packed(qtype, n, k)
                copy = kernels.interleave_rows16(w, int(qtype), k)
                for m in (1, 4, 8, 64, 256):
                    x = torch.randn(m, k)
                    out = torch.empty(m, n)
                    row = {"type": qtype.name, "shape": name, "rows": m}
                    def product(x=x, w=w, t=int(qtype), out=out, copy=copy):
                        kernels.gemm(x, w, t, out, 0, act_q8=True, interleaved=copy)

                    for isa in ("avx2", "avx_vnni"):
                        kernels.set_isa(isa)
                        row[isa] = round(us(product), 1)
                    row["speedup"] = round(row["avx2"] / row["avx_vnni"], 2)
                    print(json.dumps(row), flush=True)
    finally:
        kernels.set_isa(prev)


def engine(model: str) -> None:
    from pagedserve import LLM, SamplingParams

    llm = LLM(model, quantization="gguf_q8", dtype="float32", enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)

    def prompts(n, seed):
        g = np.random.default_rng(seed)
        return [{"prompt_token_ids": g.integers(100, vocab - 100, 256).tolist()} for _ in range(n)]

    llm.generate(prompts(4, 0), params, use_tqdm=False)  # warm up
    t = time.perf_counter()
    llm.generate(prompts(64, 1), params, use_tqdm=False)
    many = 64 * 64 / (time.perf_counter() - t)
    one = SamplingParams(max_tokens=65, ignore_eos=True, temperature=0)
    first = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    p = prompts(1, 2)
    t = time.perf_counter()
    llm.generate(p, first, use_tqdm=False)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(p, one, use_tqdm=False)
    tpot = (time.perf_counter() - t - ttft) / 64
    print(json.dumps({"isa": kernels.current_isa(), "gen_tok_s_64x": round(many, 1),
                      "batch1_ms_per_token": round(tpot * 1e3, 2), "ttft_256_ms": round(ttft * 1e3, 1)}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", metavar="MODEL", help="the engine on MODEL instead of the products alone")
    a = ap.parse_args()
    engine(a.engine) if a.engine else main()
