"""The bound on decode attention's memory reads (BENCHMARKS section 45): every K row, then every V
row, of each sequence in block-table order (decode_bf16.h's order; torch's threads over sequences,
AVX-512 loads summed, nothing else), at SmolLM2's shapes (3 KV heads of 64, bf16), 30 layers each
with its own cache, rows prefetched `pfd` tokens ahead into L2 (T1) or L1 (T0). Builds a small
extension with torch's load_inline (~30 s the first time); needs AVX-512.

    .venv/bin/python benchmarks/kv_read_bound.py [--rows 64] [--context 320]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.utils.cpp_extension import load_inline

SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>

template <_mm_hint HINT>
static void pf(const char* p, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(p + c, HINT);
}

// the sum of every K then V row of each sequence (rows of kvh * d bf16), block by block
double read_rows(torch::Tensor kc, torch::Tensor vc, torch::Tensor bt, int64_t L, int64_t pfd, bool l1) {
  const int64_t n = bt.size(0), mb = bt.size(1), bs = kc.size(1), row = kc.size(2) * kc.size(3);
  const auto* K = reinterpret_cast<const uint16_t*>(kc.data_ptr());
  const auto* V = reinterpret_cast<const uint16_t*>(vc.data_ptr());
  const int64_t* B = bt.data_ptr<int64_t>();
  std::vector<double> part(at::get_num_threads(), 0.0);
  at::parallel_for(0, n, 1, [&](int64_t b0, int64_t b1) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t i = b0; i < b1; ++i)
      for (const uint16_t* C : {K, V})
        for (int64_t t = 0; t < L; ++t) {
          if (pfd && t + pfd < L) {
            const int64_t u = t + pfd;
            const char* p = reinterpret_cast<const char*>(C + (B[i * mb + u / bs] * bs + u % bs) * row);
            if (l1) pf<_MM_HINT_T0>(p, row * 2);
            else pf<_MM_HINT_T1>(p, row * 2);
          }
          const uint16_t* r = C + (B[i * mb + t / bs] * bs + t % bs) * row;
          for (int64_t c = 0; c < row; c += 32) acc = _mm512_add_epi32(acc, _mm512_loadu_si512(r + c));
        }
    part[at::get_thread_num()] += _mm512_reduce_add_epi32(acc);
  });
  double s = 0;
  for (double x : part) s += x;
  return s;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--iters", type=int, default=8)
    a = ap.parse_args()
    mod = load_inline("pagedserve_kv_read_bound", cpp_sources=SRC, functions=["read_rows"],
                      extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    torch.manual_seed(0)
    layers, bs = 30, 16
    nb_per = -(-a.context // bs)
    nb = a.rows * nb_per + 8
    kc = [torch.randn(nb, bs, 3, 64).bfloat16() for _ in range(layers)]
    vc = [torch.randn(nb, bs, 3, 64).bfloat16() for _ in range(layers)]
    bt = (torch.randperm(nb - 1)[: a.rows * nb_per] + 1).view(a.rows, nb_per).long()
    nbytes = layers * a.rows * a.context * 3 * 64 * 2 * 2
    res = {}
    for pfd, l1 in ((0, False), (8, False), (16, False), (32, False), (16, True)):
        ts = []
        for _ in range(a.iters):
            t = time.perf_counter()
            for i in range(layers):
                mod.read_rows(kc[i], vc[i], bt, a.context, pfd, l1)
            ts.append(time.perf_counter() - t)
        ms = statistics.median(ts) * 1e3
        res[f"pfd{pfd}_{'T0' if l1 else 'T1'}"] = {"ms_30_layers": round(ms, 2), "gb_s": round(nbytes / ms / 1e6, 1)}
    big = torch.randn(nbytes // 4)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        big.sum()
        ts.append(time.perf_counter() - t)
    res["sequential_sum_gb_s"] = round(nbytes / statistics.median(ts) / 1e9, 1)
    print(json.dumps({"rows": a.rows, "context": a.context, "threads": torch.get_num_threads(), **res}))


if __name__ == "__main__":
    main()
