"""Decode attention of the working tree against the attention module of another commit, both
loaded in one process and alternated (BENCHMARKS section 45): a C++ change A/B'd without a second
checkout (the editable install always imports the working tree). The old sources are taken with
`git show REV:...` into a scratch folder and built there (~40 s, cached by content). A REV
before 2697abb has no bf16 decode kernel: "auto" then compares its float kernel with the bf16 one.

    .venv/bin/python benchmarks/attention_rev_ab.py --rev 29336d2 [--float] [--engine-model GGUF] [--engine-case 1x4000]

Kernel cases (30 layers, each its own bf16 cache, random block tables): mixed contexts (12 x 2,500
then 52 x 320; (2,500, 100); (2,000, 50, 50)), uniform ones and single long rows; outputs are checked equal to the bit
before timing only with --same-bits. --float: bf16 queries through the float kernel in both
modules (set_decode_bf16(False)). --engine-model: also a bf16 engine's decode steps over the
contexts of --engine-case (default 12 requests of 2,500 tokens beside 52 of 320), the two modules
swapped into its attention backend every round. --march: both modules built for that CPU instead of this one (haswell: the AVX2
path, float32 arithmetic). Prints one JSON line per case: median ms, old and new.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rev_sources import bf16_engine, sources_at  # noqa: E402

ATTN = "pagedserve/executor/attention/csrc"
OPS = "pagedserve/executor/ops/csrc"
CASES = [
    ("12x2500+52x320", [2500] * 12 + [320] * 52, 3),
    ("2500,100", [2500, 100], 10),
    ("2000,50,50", [2000, 50, 50], 10),
    ("64x320", [320] * 64, 10),
    ("16x320", [320] * 16, 20),
    ("5x320", [320] * 5, 30),
    ("1x320", [320], 100),
    ("1x1000", [1000], 50),
    ("1x4000", [4000], 20),
]


def _cflags(march: str | None) -> tuple:
    from pagedserve.executor.attention import cpu_kernels

    if not march:
        return cpu_kernels._CFLAGS
    return tuple(f"-march={march}" if f == "-march=native" else f for f in cpu_kernels._CFLAGS)


def new_module(march: str | None):
    """The working tree's attention module (built for `march` instead of the machine's CPU)."""
    from pagedserve.executor.attention import cpu_kernels
    from pagedserve.executor.cpp_build import load_extension

    if not march:
        return cpu_kernels.load()
    return load_extension("attention", [cpu_kernels._SRC], headers=cpu_kernels._HEADERS, cflags=_cflags(march),
                          ldflags=("-fopenmp",), expected_seconds=40)


def old_module(rev: str, march: str | None = None):
    """The attention module of commit `rev`, built from that commit's attention and ops csrc
    folders (every file they held then)."""
    from pagedserve.executor.cpp_build import load_extension

    tmp, files = sources_at(rev, [ATTN, OPS])
    src = os.path.join(tmp, ATTN, "paged_decode.cpp")
    headers = [os.path.join(tmp, r) for r in files if r.endswith(".h")]
    return load_extension("attention", [src], headers=headers, cflags=_cflags(march), ldflags=("-fopenmp",),
                          expected_seconds=40)


def kernel_case(mods, lens, iters, rounds, same_bits):
    rows, bs = len(lens), 16
    nb_per = -(-max(lens) // bs)
    nb = rows * nb_per + 8
    kc = [torch.randn(nb, bs, 3, 64).bfloat16() for _ in range(30)]
    vc = [torch.randn(nb, bs, 3, 64).bfloat16() for _ in range(30)]
    bt = (torch.randperm(nb - 1)[: rows * nb_per] + 1).view(rows, nb_per).long()
    sl = torch.tensor(lens, dtype=torch.int64)
    q = torch.randn(rows, 9, 64).bfloat16()
    if same_bits:
        a, b = (m.paged_decode(q, kc[0], vc[0], bt, sl, 0.125, 0, 0.0) for m in mods.values())
        assert torch.equal(a, b), "the two modules' outputs differ"
    ms = {k: [] for k in mods}
    for _ in range(rounds):
        for k, m in mods.items():
            m.paged_decode(q, kc[0], vc[0], bt, sl, 0.125, 0, 0.0)
            t = time.perf_counter()
            for _ in range(iters):
                for i in range(30):
                    m.paged_decode(q, kc[i], vc[i], bt, sl, 0.125, 0, 0.0)
            ms[k].append((time.perf_counter() - t) / iters * 1e3)
    return {k: round(statistics.median(v), 3) for k, v in ms.items()}


def engine_case(mods, model_path, rounds, lens):
    from pagedserve import SamplingParams

    eng, ec, model = bf16_engine(model_path, 64)
    backend = model.layers[0].self_attn.backend
    vocab = eng.model_config.vocab_size
    for i, n in enumerate(lens):
        ids = [(i * 131 + j * 17) % (vocab - 100) + 100 for j in range(n)]
        eng.add_request(f"r{i}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=rounds * 8 + 8, ignore_eos=True))
    sched = ec.scheduler
    while sched.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        eng.step()
    ms = {k: [] for k in mods}
    for _ in range(rounds):
        for k, m in mods.items():
            backend._cpp, model._plan = m, None  # the lean decode loop's plan holds the kernel
            eng.step()
            t = time.perf_counter()
            for _ in range(3):
                eng.step()
            ms[k].append((time.perf_counter() - t) / 3 * 1e3)
    return {k: round(statistics.median(v), 1) for k, v in ms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True)
    ap.add_argument("--float", action="store_true", help="bf16 queries through the float kernel in both")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--same-bits", action="store_true", help="check the outputs equal before timing")
    ap.add_argument("--engine-model", default=None)
    ap.add_argument("--engine-case", default="12x2500+52x320", choices=[c[0] for c in CASES],
                    help="the engine's requests (a kernel case's contexts)")
    ap.add_argument("--march", default=None, help="build both for this -march (e.g. haswell: the AVX2 path)")
    a = ap.parse_args()
    from pagedserve.executor.quant import kernels as quant_kernels

    mods = {"old": old_module(a.rev, a.march), "new": new_module(a.march)}
    for m in mods.values():  # a commit before 2697abb has no bf16 decode kernel: its bf16 rows take the float one
        if hasattr(m, "set_decode_bf16"):
            m.set_decode_bf16(not a.float and quant_kernels.native_bf16_in_use())
    torch.manual_seed(0)
    for name, lens, iters in CASES:
        res = kernel_case(mods, lens, iters, a.rounds, a.same_bits)
        print(json.dumps({"case": name, "kernel": "float" if a.float else "auto", "march": a.march or "native",
                          "ms_30_layers": res}), flush=True)
    if a.engine_model:
        lens = next(c[1] for c in CASES if c[0] == a.engine_case)
        res = engine_case(mods, a.engine_model, a.rounds, lens)
        print(json.dumps({"case": f"engine {a.engine_case} decode step", "ms": res}), flush=True)


if __name__ == "__main__":
    main()
