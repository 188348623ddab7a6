"""Fresh-prompt attention in bf16 (BENCHMARKS.md section 33): the C++ causal kernel (one call for all
prompts) against torch's SDPA on [1, heads, n, d] views of the same strided QKV rows (one call per
prompt: what torch_backend runs on an AMX CPU), 9 query / 3 KV heads, d 64, median ms per call.

    python benchmarks/prefill_attention_ab.py
"""

import torch
import torch.nn.functional as F

from pagedserve.bench.forward import _median_time
from pagedserve.executor.attention import cpu_kernels


def ms(fn, n=20):
    return round(_median_time(fn, n) * 1e3, 3)


def case(cpp, t: int, nseq: int) -> dict:
    h, kvh, d = 9, 3, 64
    qkv = torch.randn(t * nseq, (h + 2 * kvh) * d).bfloat16()
    q = qkv[:, : h * d].view(-1, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(-1, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(-1, kvh, d)
    out = torch.empty(t * nseq, h, d, dtype=torch.bfloat16)
    starts, lens = torch.arange(nseq) * t, torch.full((nseq,), t)

    def sdpa():
        for i in range(nseq):
            s = i * t
            views = [x[s : s + t].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
            o = F.scaled_dot_product_attention(*views, is_causal=True, enable_gqa=True, scale=0.125)
            out[s : s + t] = o[0].transpose(0, 1)

    a = ms(lambda: cpp.prefill_causal(q, k, v, out, starts, lens, 0.125))
    b = ms(sdpa)
    return {"tokens": t, "prompts": nseq, "cpp_ms": a, "sdpa_ms": b, "cpp_over_sdpa": round(a / b, 2)}


def main():
    cpp = cpu_kernels.load()
    for t in (256, 1024):
        for nseq in (1, 8):
            print(case(cpp, t, nseq), flush=True)


if __name__ == "__main__":
    main()
