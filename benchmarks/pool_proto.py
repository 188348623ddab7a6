"""OpenMP's fork-join against a two-thread pool whose master never waits for an absent worker,
on a synthetic decode-like step, with or without another process's CPU bursts (BENCHMARKS
section 69; run cpu_burst.py beside it for the bursts):

    python benchmarks/cpu_burst.py 3 25 &
    for m in omp pool pool_yield; do .venv/bin/python benchmarks/pool_proto.py $m; done
    kill %1

A step is 30 "layers" of six loops: two read 1 MB slices of a 200 MB buffer in 16 chunks
(memory-bound, as decode attention), four run FMAs on registers in 8 chunks (compute-bound,
as the GEMMs), each loop called from Python (as the engine's decode loop calls its kernels).
`omp`: at::parallel_for. `pool`: a shared chunk counter; the master claims chunks until none
is left and waits only for chunks a worker holds; an idle worker spins on pause, then sleeps on
a futex. `pool_yield`: the same, every 16th pause a sched_yield. Builds with torch's
load_inline (~30 s the first time). Prints the median step in ms.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.utils.cpp_extension import load_inline

SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <atomic>
#include <functional>
#include <thread>

static float work_chunk(const float* mem, int64_t memn, int64_t flops) {
  __m256 a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.9999f), c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
  for (int64_t i = 0; i < memn; i += 8) c0 = _mm256_add_ps(c0, _mm256_loadu_ps(mem + i));
  for (int64_t i = 0; i < flops; ++i) {
    c1 = _mm256_fmadd_ps(c1, a, b); c2 = _mm256_fmadd_ps(c2, a, b); c3 = _mm256_fmadd_ps(c3, a, b);
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, _mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));
  return t[0] + t[7];
}

struct Pool {
  std::atomic<uint64_t> word{0};  // generation << 32 | next chunk
  std::atomic<int64_t> done{0};
  std::atomic<uint32_t> seq{0};
  std::atomic<int> sleeping{0};
  int64_t n = 0;
  const std::function<void(int64_t)>* fn = nullptr;
  bool yield;
  explicit Pool(bool y) : yield(y) { std::thread([this] { loop(); }).detach(); }
  void wait_step(int& s) {
    if (yield && ++s % 16 == 0) sched_yield();
    else { ++s; _mm_pause(); }
  }
  bool claim(uint32_t gen, int64_t& i) {
    uint64_t w = word.load(std::memory_order_acquire);
    for (;;) {
      if ((uint32_t)(w >> 32) != gen || (int64_t)(uint32_t)w >= n) return false;
      if (word.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel)) { i = (int64_t)(uint32_t)w; return true; }
    }
  }
  void loop() {
    uint32_t seen = 0;
    for (;;) {
      int s = 0;
      uint32_t q;
      while ((q = seq.load(std::memory_order_acquire)) == seen && s < 20000) wait_step(s);
      if (q == seen) {
        sleeping.store(1);
        if (seq.load() == seen) syscall(SYS_futex, &seq, FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
        sleeping.store(0);
        continue;
      }
      seen = q;
      const uint32_t gen = (uint32_t)(word.load(std::memory_order_acquire) >> 32);
      const auto* f = fn;
      int64_t i;
      while (claim(gen, i)) { (*f)(i); done.fetch_add(1, std::memory_order_release); }
    }
  }
  void run(int64_t chunks, const std::function<void(int64_t)>& f) {
    const uint32_t gen = (uint32_t)(word.load() >> 32) + 1;
    n = chunks; fn = &f; done.store(0);
    word.store((uint64_t)gen << 32, std::memory_order_release);
    seq.fetch_add(1, std::memory_order_release);
    if (sleeping.load()) syscall(SYS_futex, &seq, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
    int64_t i, mine = 0;
    while (claim(gen, i)) { f(i); ++mine; }
    for (int s = 0; done.load(std::memory_order_acquire) + mine < chunks;) wait_step(s);
  }
};
static Pool* g_pool = nullptr;

void make_pool(bool yield) { if (!g_pool) g_pool = new Pool(yield); }

double region(torch::Tensor buf, int64_t off, int64_t chunks, int64_t memn, int64_t flops) {
  const float* m = buf.data_ptr<float>() + off;
  std::vector<float> out(chunks);
  std::function<void(int64_t)> f = [&](int64_t i) { out[i] = work_chunk(m + i * memn, memn, flops); };
  if (g_pool) g_pool->run(chunks, f);
  else at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) { for (int64_t i = b; i < e; ++i) f(i); });
  double s = 0;
  for (float x : out) s += x;
  return s;
}
"""


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "omp"
    if mode not in ("omp", "pool", "pool_yield"):
        raise SystemExit("mode: omp | pool | pool_yield")
    mod = load_inline("pagedserve_pool_proto", cpp_sources=SRC, functions=["make_pool", "region"],
                      extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
    if mode != "omp":
        mod.make_pool(mode == "pool_yield")
    buf = torch.randn(200 << 18)  # 200 MB of float32: streamed from memory
    memn = 64 << 10  # floats a memory-bound chunk reads (256 KB)
    layer = [(16, memn, 0), (8, 0, 20000), (8, 0, 10000), (16, memn, 0), (8, 0, 40000), (8, 0, 20000)]
    steps, off = [], 0
    for _ in range(60):
        t = time.perf_counter()
        for _ in range(30):
            for chunks, mn, fl in layer:
                if off + chunks * mn >= buf.numel():
                    off = 0
                mod.region(buf, off, chunks, mn, fl)
                off += chunks * mn
        steps.append(time.perf_counter() - t)
    print(f"{mode}: step {statistics.median(steps[5:]) * 1e3:.2f} ms (median of 55)")


if __name__ == "__main__":
    main()
