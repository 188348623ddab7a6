"""Prefill attention (BENCHMARKS.md sections 33, 37, 42 and 43), 9 query / 3 KV heads, d 64, median ms
per call (one layer): the AMX tile kernel (csrc/prefill_amx.h, bf16, one call for all chunks, K/V
read from a paged cache of 16-token blocks) and the vdpbf16ps kernel (csrc/prefill_bf16.h, the
same call) where built, the float32-arithmetic kernel
(csrc/prefill_paged.h, the same call) on bf16 and on float32 tensors, and torch's SDPA one call
per chunk (fresh chunks on [1, heads, n, d] views of the fused QKV rows; a chunk after cached
context on its gathered K/V with a mask, as torch_backend ran it before prefill_paged), in bf16
and in float32.

    python benchmarks/prefill_attention_ab.py
"""

import random

import torch
import torch.nn.functional as F

from pagedserve.bench.forward import _median_time
from pagedserve.executor.attention import cpu_kernels
from pagedserve.executor.attention.torch_backend import TorchAttentionBackend

H, KVH, D, BS = 9, 3, 64, 16


def ms(fn, n=20):
    return round(_median_time(fn, n) * 1e3, 3)


def case(cpp, name: str, reqs: list[tuple[int, int]], dtype) -> dict:
    """reqs: (cached tokens, query tokens) per chunk."""
    t = sum(n for _, n in reqs)
    qkv = torch.randn(t, (H + 2 * KVH) * D).to(dtype)
    q = qkv[:, : H * D].view(t, H, D)
    k = qkv[:, H * D : (H + KVH) * D].view(t, KVH, D)
    v = qkv[:, (H + KVH) * D :].view(t, KVH, D)
    blocks = [-(-(c + n) // BS) for c, n in reqs]
    kc = torch.randn(sum(blocks) + 1, BS, KVH, D).to(dtype)
    vc = torch.randn_like(kc)
    bt = torch.zeros(len(reqs), max(blocks), dtype=torch.int64)
    starts, first = [], 1
    for r, nb in enumerate(blocks):
        bt[r, :nb] = torch.arange(first, first + nb)
        first += nb
        starts.append(sum(n for _, n in reqs[:r]))
    seq = [c + n for c, n in reqs]
    out = torch.empty(t, H, D, dtype=dtype)
    args = (torch.tensor(starts), torch.tensor([n for _, n in reqs]), torch.tensor(seq), bt)

    def sdpa():
        for r, ((c, n), s) in enumerate(zip(reqs, starts)):
            if c == 0:
                views = [x[s : s + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
                o = F.scaled_dot_product_attention(*views, is_causal=True, enable_gqa=True, scale=0.125)
                out[s : s + n] = o[0].transpose(0, 1)
            else:
                out[s : s + n] = TorchAttentionBackend._prefill(q[s : s + n], k, v, kc, vc, bt[r], seq[r], 0.125)

    res = {"case": name, "dtype": str(dtype).removeprefix("torch."), "tokens": t, "chunks": len(reqs)}
    if hasattr(cpp, "prefill_amx") and dtype == torch.bfloat16:
        res["amx_ms"] = ms(lambda: cpp.prefill_amx(q, kc, vc, out, *args, 0.125))
    if hasattr(cpp, "prefill_bf16") and dtype == torch.bfloat16:
        res["bf16_ms"] = ms(lambda: cpp.prefill_bf16(q, kc, vc, out, *args, 0.125))
    res["paged_ms"] = ms(lambda: cpp.prefill_paged(q, kc, vc, out, *args, 0.125))
    res["sdpa_ms"] = ms(sdpa)
    res["sdpa_over_paged"] = round(res["sdpa_ms"] / res["paged_ms"], 2)
    if "bf16_ms" in res:
        res["paged_over_bf16"] = round(res["paged_ms"] / res["bf16_ms"], 2)
        res["sdpa_over_bf16"] = round(res["sdpa_ms"] / res["bf16_ms"], 2)
    if "amx_ms" in res:
        res["sdpa_over_amx"] = round(res["sdpa_ms"] / res["amx_ms"], 2)
    return res


def main():
    cpp = cpu_kernels.load()
    rng = random.Random(0)
    cases = {
        "1 x 256": [(0, 256)],
        "8 x 256": [(0, 256)] * 8,
        "1 x 1024": [(0, 1024)],
        "8 x 1024": [(0, 1024)] * 8,
        "1 x 2048": [(0, 2048)],
        "embed step: 15 x 16-256": [(0, rng.randint(16, 256)) for _ in range(15)],
        "32 x 64": [(0, 64)] * 32,
        "chunk 512 after 2,500": [(2500, 512)],
        "chunk 2,048 after 2,048": [(2048, 2048)],
        "chunk 64 after 2,000": [(2000, 64)],
        "chunk 128 after 2,000": [(2000, 128)],
        "chunk 256 after 1,000": [(1000, 256)],
    }
    for dtype in (torch.bfloat16, torch.float32):
        for name, reqs in cases.items():
            print(case(cpp, name, reqs, dtype), flush=True)


if __name__ == "__main__":
    main()
