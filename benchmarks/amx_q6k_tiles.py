"""K-quant layers' many-row products of a bf16 model on an AMX Xeon (BENCHMARKS section 68): the
tile kernel over the interleaved copy (csrc/quant_rows16_amx.h; Q6_K's six bits through
quant_rows16_amx_q6k.h) against oneDNN on the layer's bf16 copy (QuantLinear's copy), median ms a
pass over several layers (random blocks) so that the weights stream from memory as in a decode
step. Shapes of a 1 B Llama in Q4_K_M: ffn_down [2048, 8192] x 8, attn_v [512, 2048] x 16, the
output layer [128256, 2048] (Q6_K in Q4_K_M files; --type q4_k: the same shapes in Q4_K).

    python benchmarks/amx_q6k_tiles.py [--type q6_k] [--rows 9 16 32 64 128]
"""

import argparse
import json
import os
import statistics
import sys

import torch
from gguf import GGMLQuantizationType as Q

from pagedserve.bench.timing import sample_times
from pagedserve.executor import onednn_linear
from pagedserve.executor.quant import kernels


def packed(qtype, n, k, seed=0):
    """Random blocks with finite scales (the tests' own generator)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    from tests.executor.test_quant_kernels import random_packed

    return torch.from_numpy(random_packed(qtype, n, k, seed))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[9, 16, 32, 64, 128])
    ap.add_argument("--type", choices=["q6_k", "q4_k"], default="q6_k")
    a = ap.parse_args()
    qt = Q.Q6_K if a.type == "q6_k" else Q.Q4_K
    if "amx_bf16" not in kernels.available_isas() or (qt == Q.Q6_K and not kernels.q6k_six_bits()):
        print(json.dumps({"skipped": "needs AMX-BF16 and Q6_K's six-bit copies (AVX512-VBMI)"}))
        return
    kernels.set_isa(kernels.available_isas()[-1])
    for name, (n, k, layers) in {"ffn_down": (2048, 8192, 8), "attn_v": (512, 2048, 16), "output": (128256, 2048, 1)}.items():
        ws = [packed(qt, n, k, s) for s in range(layers)]
        wis = [kernels.interleave_rows16(w, int(qt), k) for w in ws]
        copies = [onednn_linear.pack_weight(kernels.dequant(w, int(qt), k).bfloat16()) for w in ws]
        for m in a.rows:
            x = torch.randn(m, k).bfloat16()
            out = torch.empty(m, n)

            def tiles(x=x, out=out, ws=ws, wis=wis):
                for w, wi in zip(ws, wis):
                    kernels.gemm_amx_rows16(x, w, wi, int(qt), out, 0)

            def onednn(x=x, copies=copies):
                for c in copies:
                    onednn_linear.packed_linear(x, c, None)

            t = {f.__name__: statistics.median(sample_times(f, 9, 2)) * 1e3 for f in (tiles, onednn, tiles, onednn)}
            print(json.dumps({"type": a.type, "layer": name, "shape": [n, k], "layers": layers, "rows": m, "tiles_ms": round(t["tiles"], 3),
                              "onednn_bf16_copy_ms": round(t["onednn"], 3), "speedup": round(t["onednn"] / t["tiles"], 2)}),
                  flush=True)
        del ws, wis, copies


if __name__ == "__main__":
    main()
