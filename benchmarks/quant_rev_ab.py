"""Few-row products on the row-interleaved copies (quant/csrc/quant_rows16*.h) of the working tree
against the quant module of another commit, both loaded in one process and alternated: each
module multiplies through its own copies (built by its own interleave_rows16, so a layout change
is A/B'd too). The old sources come from `git show REV:...` (rev_sources.py), built apart (~50 s).

    .venv/bin/python benchmarks/quant_rev_ab.py --rev 152a217 [--float] [--same-bits] [--engine-model default]
        [--type Q4_K]  (PAGEDSERVE_CPU_ISA=avx2 forces both modules' path)

Kernel cases: Q4_1 [1536, 576] and [576, 1536] (the default model's gate_up and down), 30 layers
cycling (in L3), and 120 layers of the first (66 MB: from memory), 1-8 activation rows, bf16
activations on the bf16 kernel (--float: float32 ones on the float kernel; --q8: gguf_q8's integer
products on the packed rows, no copy; --packed: float32 ones on the packed rows, no copy). --engine-model: a
bf16 engine's decode steps at batch 1, 4 and 7 (context ~320), every QuantLinear's op and copies
swapped each round. Prints one JSON line per case: median us a layer (engine: ms a step), old
and new.
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

QUANT, OPS = "pagedserve/executor/quant/csrc", "pagedserve/executor/ops/csrc"


def old_module(rev: str):
    from pagedserve.executor.cpp_build import load_extension
    from pagedserve.executor.quant import kernels

    tmp, files = sources_at(rev, [QUANT, OPS])
    headers = [os.path.join(tmp, r) for r in files if r.endswith(".h")]
    mod = load_extension("quant", [os.path.join(tmp, QUANT, "quant_kernels.cpp")], headers=headers,
                         cflags=("-O3", "-fopenmp", "-fno-math-errno"), ldflags=("-fopenmp",), expected_seconds=40)
    mod.set_isa(kernels.ISAS[kernels.current_isa()])
    return mod


def product(mod, x, w, wi, out, kind, qtype):
    if kind == "q8":  # gguf_q8's integer products on the packed rows (no copy)
        mod.gemm(x, w, qtype, out, 0, True, None)
    elif kind:  # float32 activations
        mod.gemm(x, w, qtype, out, 0, False, wi)
    else:
        mod.gemm_bf16(x, w, qtype, out, 0, False, wi)


def weights(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    """Q4_1 from random floats; other types: random blocks with moderate scales (the tests')."""
    from pagedserve.executor.quant import formats

    if qtype == formats.Q4_1:
        return formats.quantize_q4_1(torch.randn(n, k) * 0.1).data
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    from tests.executor.test_quant_kernels import random_packed

    return torch.from_numpy(random_packed(qtype, n, k, seed=seed))


def kernel_case(mods, n, k, layers, rows, rounds, kind, same_bits, qtype):
    ws = [weights(qtype, n, k, i) for i in range(layers)]
    wis = {name: [None if kind == "packed" else m.interleave_rows16(w, qtype, k) for w in ws] for name, m in mods.items()}
    x = torch.randn(rows, k)
    x = x if kind else x.bfloat16()
    outs = {name: torch.zeros(rows, n) for name in mods}
    if same_bits:
        for name, m in mods.items():
            product(m, x, ws[0], wis[name][0], outs[name], kind, qtype)
        a, b = outs.values()
        assert torch.equal(a, b), "the two modules' outputs differ"
    us = {name: [] for name in mods}
    iters = max(1, 2000 // (layers * rows))
    for _ in range(rounds):
        for name, m in mods.items():
            t = time.perf_counter()
            for _ in range(iters):
                for w, wi in zip(ws, wis[name]):
                    product(m, x, w, wi, outs[name], kind, qtype)
            us[name].append((time.perf_counter() - t) / (iters * layers) * 1e6)
    return {name: round(statistics.median(v), 2) for name, v in us.items()}


def engine_case(mods, model_path, batches, rounds):
    from pagedserve import SamplingParams
    from pagedserve.executor.quant.layers import QuantLinear

    eng, ec, model = bf16_engine(model_path, 16)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m._rows16]
    copies = {}
    for name, m in mods.items():
        copies[name] = [[m.interleave_rows16(d, t, q.in_features) if c.numel() else c
                         for (t, d, _), c in zip(q.segments, q._rows16)] for q in layers]

    def use(name):
        for q, cs in zip(layers, copies[name]):
            q._op, q._rows16[:] = mods[name].qlinear, cs

    vocab, out = eng.model_config.vocab_size, {}
    for b in batches:
        for i in range(b):
            ids = [(i * 131 + j * 17) % (vocab - 100) + 100 for j in range(320)]
            eng.add_request(f"b{b}-{i}", {"prompt_token_ids": ids},
                            SamplingParams(max_tokens=rounds * 2 * 6 + 8, ignore_eos=True, temperature=0))
        sched = ec.scheduler
        while sched.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
            eng.step()
        ms = {name: [] for name in mods}
        for _ in range(rounds):
            for name in mods:
                use(name)
                eng.step()
                t = time.perf_counter()
                for _ in range(5):
                    eng.step()
                ms[name].append((time.perf_counter() - t) / 5 * 1e3)
        for i in range(b):
            eng.abort_request(f"b{b}-{i}")
        out[b] = {name: round(statistics.median(v), 2) for name, v in ms.items()}
    use("new")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True)
    kind = ap.add_mutually_exclusive_group()  # default: bf16 activations on the bf16 kernel
    kind.add_argument("--float", action="store_true", help="float32 activations on the float kernel")
    kind.add_argument("--q8", action="store_true", help="gguf_q8's integer products (act_q8) on the packed rows")
    kind.add_argument("--packed", action="store_true", help="float32 activations on the packed rows (no copy)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--same-bits", action="store_true", help="check the outputs equal before timing")
    ap.add_argument("--engine-model", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 7])
    ap.add_argument("--type", default="Q4_1", choices=("Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q4_0", "Q8_0"),
                    help="the weights' type (K-quants: random blocks, [5632, 2048] and [2048, 5632] x 12 layers; "
                    "Q5_0 / Q5_1 / Q4_0 / Q8_0: random blocks in Q4_1's shapes, the default model's)")
    a = ap.parse_args()
    from pagedserve.executor.quant import formats, kernels

    qtype = getattr(formats, a.type)
    small = a.type in ("Q4_1", "Q5_0", "Q5_1", "Q4_0", "Q8_0")
    shapes = ((1536, 576, 30), (576, 1536, 30), (1536, 576, 120)) if small else ((5632, 2048, 12), (2048, 5632, 12))

    mods = {"old": old_module(a.rev), "new": kernels.load()}
    torch.manual_seed(0)
    for n, k, layers in shapes:
        for rows in a.rows:
            kind = "q8" if a.q8 else "packed" if a.packed else a.float
            res = kernel_case(mods, n, k, layers, rows, a.rounds, kind, a.same_bits, qtype)
            print(json.dumps({"case": f"{a.type} {n}x{k} x{layers} layers", "rows": rows,
                              "kernel": "gguf_q8" if a.q8 else "packed" if a.packed else "float" if a.float else "bf16",
                              "us_a_layer": res}), flush=True)
    if a.engine_model:
        for b, res in engine_case(mods, a.engine_model, a.batches, a.rounds).items():
            print(json.dumps({"case": "engine decode step", "batch": b, "ms": res}), flush=True)


if __name__ == "__main__":
    main()
