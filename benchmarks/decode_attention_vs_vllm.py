"""bf16 decode attention alone, pagedserve's kernel beside vLLM CPU's (BENCHMARKS section 36).

30 layers of one query token per row at SmolLM2's shapes (9 query heads, 3 KV heads of 64), each
layer its own bf16 cache (K/V come from memory), random block tables; prints ms for the 30 layers
and the K/V bytes read per second. `--engine vllm` runs vLLM's `cpu_attention_with_kv_cache`
(its own layout and ISA choice, blocks of 128 by default, as its server does) and must run under
the anchors' venv; `--with-vllm` does that in a subprocess after pagedserve's run.

    .venv/bin/python benchmarks/decode_attention_vs_vllm.py --rows 12 --context 2500 --with-vllm

`--ab-float` alternates pagedserve's vdpbf16ps kernel (csrc/decode_bf16.h) with its float kernel
(bf16 widened to float32) in one process, `--rounds` times each, and prints both medians.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

H, KVH, D, LAYERS = 9, 3, 64, 30


def timed(run, iters: int) -> float:
    run()
    t = time.perf_counter()
    for _ in range(iters):
        run()
    return (time.perf_counter() - t) / iters


KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def pagedserve_run(rows: int, ctx: int, bs: int, kv_dtype: str = "bfloat16"):
    from pagedserve.executor.attention import cpu_kernels

    cpp = cpu_kernels.load()
    nb_per = -(-ctx // bs)
    nblocks = rows * nb_per + 8
    kc = [torch.randn(nblocks, bs, KVH, D).to(KV_DTYPES[kv_dtype]) for _ in range(LAYERS)]
    vc = [torch.randn(nblocks, bs, KVH, D).to(KV_DTYPES[kv_dtype]) for _ in range(LAYERS)]
    bt = (torch.randperm(nblocks - 1)[: rows * nb_per] + 1).view(rows, nb_per).long()
    sl = torch.full((rows,), ctx, dtype=torch.int64)
    q = torch.randn(rows, H, D).bfloat16()
    return lambda: [cpp.paged_decode(q, kc[i], vc[i], bt, sl, D**-0.5, 0, 0.0) for i in range(LAYERS)]


def vllm_run(rows: int, ctx: int, bs: int):
    import vllm._custom_ops as ops

    torch._C._cpu._init_amx()  # the tiles' permission, as vLLM's worker asks for it
    isa = "amx" if torch.cpu._is_amx_tile_supported() and bs % 32 == 0 else "vec"
    nb_per = -(-ctx // bs)
    nblocks = rows * nb_per + 8
    caches = [torch.randn(nblocks, KVH, 2 * bs, D).bfloat16() for _ in range(LAYERS)]
    bt = (torch.randperm(nblocks - 1)[: rows * nb_per] + 1).view(rows, nb_per).int()
    sl = torch.full((rows,), ctx, dtype=torch.int32)
    qsl = torch.arange(rows + 1, dtype=torch.int32)
    q = torch.randn(rows, H, D).bfloat16()
    out = torch.empty_like(q)
    meta = ops.cpu_attn_get_scheduler_metadata(rows, H, KVH, D, sl, torch.bfloat16, qsl, True, -1, isa, False)

    def run():
        for c in caches:
            k, v = c.chunk(2, dim=2)
            ops.cpu_attention_with_kv_cache(q, k, v, out, qsl, sl, D**-0.5, True, None, -1, bt, 0.0, meta, None)

    return run


def ab_float(run, a) -> None:
    """The vdpbf16ps kernel and the float kernel alternately (set_decode_bf16), medians."""
    import statistics

    from pagedserve.executor.attention import cpu_kernels

    cpp = cpu_kernels.load()
    if cpp is None or not hasattr(cpp, "set_decode_bf16"):
        sys.exit("this module has no vdpbf16ps decode kernel (a CPU without AVX512-BF16)")
    ms = {"float_kernel": [], "bf16_kernel": []}
    try:
        for _ in range(a.rounds):
            for name, on in (("float_kernel", False), ("bf16_kernel", True)):
                cpp.set_decode_bf16(on)
                ms[name].append(timed(run, a.iters) * 1e3)
    finally:
        cpu_kernels.sync_isa(cpp)
    res = {k: round(statistics.median(v), 2) for k, v in ms.items()}
    print(json.dumps({"engine": "pagedserve", "rows": a.rows, "context": a.context, "kv_dtype": a.kv_dtype,
                      "ms_30_layers": res, "ratio": round(res["float_kernel"] / res["bf16_kernel"], 3),
                      "rounds": a.rounds, "threads": torch.get_num_threads()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--block-size", type=int, default=None, help="default: 16 (pagedserve), 128 (vLLM)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="bfloat16", help="pagedserve's cache dtype")
    ap.add_argument("--engine", choices=["pagedserve", "vllm"], default="pagedserve")
    ap.add_argument("--with-vllm", action="store_true", help="then vLLM's kernel, under the anchors' venv")
    ap.add_argument("--ab-float", action="store_true", help="the bf16 kernel against the float one, alternating")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    if a.ab_float and (a.engine != "pagedserve" or a.kv_dtype != "bfloat16"):
        ap.error("--ab-float compares pagedserve's two kernels over a bf16 cache (--engine pagedserve)")
    torch.manual_seed(0)
    bs = a.block_size or (16 if a.engine == "pagedserve" else 128)
    if a.engine == "pagedserve":
        run, elem = pagedserve_run(a.rows, a.context, bs, a.kv_dtype), KV_DTYPES[a.kv_dtype].itemsize
    else:
        run, elem = vllm_run(a.rows, a.context, bs), 2
    if a.ab_float and a.engine == "pagedserve":
        ab_float(run, a)
        return
    dt = timed(run, a.iters)
    kv_bytes = LAYERS * a.rows * a.context * KVH * D * 2 * elem
    print(json.dumps({"engine": a.engine, "rows": a.rows, "context": a.context, "block_size": bs,
                      "kv_dtype": a.kv_dtype if a.engine == "pagedserve" else "bfloat16",
                      "ms_30_layers": round(dt * 1e3, 2), "kv_gb_s": round(kv_bytes / dt / 1e9, 1),
                      "threads": torch.get_num_threads()}), flush=True)
    if a.with_vllm:
        py = os.path.expanduser("~/.cache/pagedserve-anchors/venv/bin/python")
        cmd = [py, __file__, "--engine", "vllm", "--rows", str(a.rows), "--context", str(a.context), "--iters", str(a.iters)]
        subprocess.run(cmd, check=True, cwd="/tmp", env={**os.environ, "PYTHONPATH": ""})


if __name__ == "__main__":
    sys.exit(main())
