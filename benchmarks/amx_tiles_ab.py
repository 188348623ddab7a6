"""The AMX tile products beside oneDNN's on the same weights (BENCHMARKS section 65): SmolLM2's
four layer shapes (qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536), 30
layers of each cycling (weights from memory, as in a step), M bf16 rows, best of three medians,
ms for all 120 products. Needs an AMX path.

    .venv/bin/python benchmarks/amx_tiles_ab.py [--type q4_1|q8_0|q4_k|bf16] [--rows 9 16 64 ...]

`--type q4_k`: a 1 B model's shapes instead (qkv 2048 x 2048... as 2048 x 2048, gate_up 11264 x
2048, down 2048 x 5632; K a multiple of 256), 8 layers, random quants with small scales.

`--type q4_1` / `q8_0`: the tile kernel over the row-interleaved copy (quant_rows16_amx.h,
weights dequantized as used) against oneDNN on the bf16 copy (QuantLinear.attach_bf16_copy's
weights); `bf16`: the MoE tile kernel on a tile copy (onednn_linear's OneDNNLinear.tiles)
against oneDNN's packed weight. Checks that both agree before timing. One JSON line per M.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from pagedserve.bench.timing import sample_times
from pagedserve.executor import onednn_linear as od
from pagedserve.executor.ops import moe_gemm
from pagedserve.executor.quant import formats, kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
K_SHAPES, K_LAYERS = [(2048, 2048), (11264, 2048), (2048, 5632)], 8


def random_q4_k(n: int, k: int) -> torch.Tensor:
    """[n, k / 256 * 144] random Q4_K blocks, d and dmin float16 in [0, 4e-4)."""
    g = torch.Generator().manual_seed(n * 7 + k)
    raw = torch.randint(0, 256, (n, k // 256, 144), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // 256, 2, generator=g) * 4e-4).half().view(torch.uint8).reshape(n, k // 256, 4)
    raw[..., 0:4] = scales
    return raw.reshape(n, -1).contiguous()


def median_ms(fn, n: int = 7) -> float:
    return statistics.median(sample_times(fn, n)) * 1e3


def weights(kind: str):
    """Per shape, LAYERS of (oneDNN's packed bf16 weight, the tile product's callable factory)."""
    qtype = {"q4_1": formats.Q4_1, "q8_0": formats.Q8_0, "q4_k": formats.Q4_K}.get(kind)
    quantize = {"q4_1": formats.quantize_q4_1, "q8_0": formats.quantize_q8_0}.get(kind)
    out = []
    for n, k in shapes(kind):
        layers = []
        for _ in range(K_LAYERS if kind == "q4_k" else LAYERS):
            w = torch.randn(n, k) * 0.05
            if qtype is None:
                wb = w.bfloat16()
                layers.append((od.pack_weight(wb, 9), ("bf16", moe_gemm.pack(wb[None], moe_gemm.AMX_BLOCK_N))))
                continue
            packed = random_q4_k(n, k) if kind == "q4_k" else quantize(w).data
            wb = kernels.dequant(packed, qtype, k).bfloat16()
            layers.append((od.pack_weight(wb, 9), ("quant", packed, kernels.interleave_rows16(packed, qtype, k), qtype)))
        out.append(layers)
    return out


def shapes(kind: str):
    return K_SHAPES if kind == "q4_k" else SHAPES


def tile_fn(entry, x: torch.Tensor, out: torch.Tensor):
    if entry[0] == "bf16":
        off = torch.tensor([0, x.shape[0]], dtype=torch.int64)
        return lambda: moe_gemm.experts_mm(x, off, entry[1])
    _, packed, wi, qtype = entry
    return lambda: kernels.gemm_amx_rows16(x, packed, wi, qtype, out, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--type", default="q4_1", choices=["q4_1", "q8_0", "q4_k", "bf16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[9, 16, 32, 64, 128, 256, 512, 1024, 2048])
    a = ap.parse_args()
    if not kernels.amx_in_use():
        raise SystemExit("needs an AMX path (this CPU or PAGEDSERVE_CPU_ISA has none)")
    torch.manual_seed(0)
    ws = weights(a.type)
    sh = shapes(a.type)
    flops_per_row = 2 * sum(n * k * len(layers) for (n, k), layers in zip(sh, ws))
    for m in a.rows:
        xs = [torch.randn(m, k).bfloat16() for _, k in sh]
        outs = [torch.empty(m, n) for n, _ in sh]
        tiles = [[tile_fn(e, xs[i], outs[i]) for _, e in layers] for i, layers in enumerate(ws)]
        for i, layers in enumerate(ws):  # both agree (the same bf16 weights; float32 sums in another order)
            ref = od.packed_linear(xs[i], layers[0][0], None).float()
            got = tiles[i][0]()
            got = outs[i] if got is None else got.float()
            assert (got - ref).abs().max() <= 0.01 * ref.abs().max() + 1e-3

        def onednn(xs=xs):
            for li in range(len(ws[0])):
                for i in range(len(sh)):
                    od.packed_linear(xs[i], ws[i][li][0], None)

        def tile(tiles=tiles):
            for li in range(len(ws[0])):
                for i in range(len(sh)):
                    tiles[i][li]()

        runs = [(median_ms(onednn), median_ms(tile)) for _ in range(3)]
        o, t = min(r[0] for r in runs), min(r[1] for r in runs)
        print(json.dumps({"type": a.type, "rows": m, "onednn_ms": round(o, 2), "tiles_ms": round(t, 2),
                          "onednn_tflops": round(m * flops_per_row / o / 1e9, 2),
                          "tiles_tflops": round(m * flops_per_row / t / 1e9, 2), "speedup": round(o / t, 2)}), flush=True)


if __name__ == "__main__":
    main()
