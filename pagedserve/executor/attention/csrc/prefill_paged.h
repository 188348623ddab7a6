#pragma once
// Prefill attention on the CPU, float32 arithmetic: every listed request's query rows (a
// prompt chunk, fresh or after cached context) attend causally to keys 0 .. their own
// position, GQA-aware, K/V read through the block table from the paged cache (written before
// the call). One call for all of a step's prefill chunks: it replaces one SDPA call per prompt
// (which scales poorly over two threads and runs bf16 at a tenth of the core's FMA rate on
// short rows) and, for a chunk after cached context, a gathered copy of the context and a
// masked SDPA call (3-10x slower than this kernel on a 2-vCPU Zen 4: BENCHMARKS section 42).
//
//   q        [T, h, d]   rows may be strided (the fused QKV projection's columns)
//   k_cache, v_cache  [num_blocks, bs, kvh, d], q's dtype
//   out      [T, h, d]   contiguous; rows of the listed requests are written
//   starts, qlens, seq_lens  int64 [R]: request r's queries are rows starts[r] ..
//            starts[r] + qlens[r] - 1, at positions seq_lens[r] - qlens[r] .. seq_lens[r] - 1
//   block_tables  int64 [R, max_blocks] (row r: request r's blocks)
//
// float32 or bfloat16 in; everything in float32 (K transposed and V converted once per
// request and KV head, from the cache), scores in blocks of 16 keys x up to 16 query rows, an
// exact softmax per row (a Cephes exp, ~2 ulp), P.V in float32; the output rounded once to
// q's dtype. Work is split over threads by (request, head, block of query rows), costliest
// first, from a shared counter (rows late in a long context cost the most).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "chunk_args.h"  // ChunkArgs: the requests' rows and block tables, checked
#include "work_queue.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t KB = 16;  // keys per score block (one 16-float vector)
constexpr int64_t QB = 16;  // query rows per task
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));

inline v16 splat(float x) { return v16{} + x; }

inline v16 exp16(v16 x) {  // Cephes expf over [-87.3, 88.3] (clamped), as executor/ops' kernel
  x = x < -87.3f ? splat(-87.3f) : x;
  x = x > 88.3f ? splat(88.3f) : x;
  v16 fx = x * 1.44269504088896341f + 0.5f;
  const i16v fi = __builtin_convertvector(fx, i16v);
  v16 fl = __builtin_convertvector(fi, v16);
  fx = fl > fx ? fl - 1.f : fl;
  x = x - fx * 0.693359375f;
  x = x - fx * -2.12194440e-4f;
  const v16 z = x * x;
  v16 y = splat(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.f;
  const i16v bits = (__builtin_convertvector(fx, i16v) + 127) << 23;
  return y * reinterpret_cast<const v16&>(bits);
}

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, const v16& v) { std::memcpy(p, &v, sizeof v); }

struct Seq {
  // rows start .. start + len - 1 are positions ctx .. ctx + len - 1; keys ctx + len, padded
  // to lp (a multiple of KB); off: offset of its float K/V copies
  int64_t start, len, ctx, lp, off;
};

// One task: query rows [i0, i1) of request s, head hh. kt: [d][lp] (K transposed, zero
// padded), vf: [lp][d]. DC = d / 16.
template <typename T, int DC>
void attend_block(const T* q, int64_t sq, T* out, int64_t so, const Seq& s, int64_t hh, int64_t i0, int64_t i1, const float* kt,
                  const float* vf, float scale, std::vector<float>& scratch) {
  constexpr int64_t d = DC * 16;
  const int64_t nr = i1 - i0, nk = (s.ctx + i1 + KB - 1) / KB * KB;  // keys 0 .. ctx + i1 - 1, padded
  scratch.resize(QB * d + QB * nk);
  float* qf = scratch.data();       // [d][QB] scaled queries
  float* sc = qf + QB * d;          // [nr][nk] scores, then probabilities
  for (int64_t r = 0; r < QB; ++r) {  // [x][QB] layout: one row of 16 queries per x; rows past nr are 0
    const T* qr = q + (s.start + i0 + std::min(r, nr - 1)) * sq + hh * d;
    for (int64_t x = 0; x < d; ++x) qf[x * QB + r] = r < nr ? static_cast<float>(qr[x]) * scale : 0.f;
  }
  for (int64_t j = 0; j < nk; j += KB) {  // scores: 16 keys x nr rows per pass over d
    v16 acc[QB];
    for (int64_t r = 0; r < QB; ++r) acc[r] = splat(0.f);
    for (int64_t x = 0; x < d; ++x) {
      const v16 kv = load16(kt + x * s.lp + j);
      const float* qx = qf + x * QB;
      for (int64_t r = 0; r < QB; ++r) acc[r] += qx[r] * kv;  // a fixed count: acc stays in registers
    }
    for (int64_t r = 0; r < nr; ++r) store16(sc + r * nk + j, acc[r]);
  }
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < nr; ++r) {  // causal softmax of row r (position ctx + i0 + r sees keys 0 .. it)
    float* row = sc + r * nk;
    const int64_t n = s.ctx + i0 + r + 1;
    for (int64_t j = n; j < nk; ++j) row[j] = ninf;
    v16 m16 = splat(ninf);
    for (int64_t j = 0; j < nk; j += KB) {
      const v16 v = load16(row + j);
      m16 = v > m16 ? v : m16;
    }
    float m = ninf;
    for (int k = 0; k < 16; ++k) m = std::max(m, m16[k]);
    v16 s16 = splat(0.f);
    for (int64_t j = 0; j < nk; j += KB) {
      v16 e = exp16(load16(row + j) - m);
      e = load16(row + j) == ninf ? splat(0.f) : e;
      store16(row + j, e);
      s16 += e;
    }
    float sum = 0.f;
    for (int k = 0; k < 16; ++k) sum += s16[k];
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < nk; j += KB) store16(row + j, load16(row + j) * inv);
  }
  for (int64_t r0 = 0; r0 < nr; r0 += 4) {  // P.V, 4 rows at a time
    const int64_t rn = std::min<int64_t>(4, nr - r0);
    v16 acc[4][DC];
    for (int a = 0; a < 4; ++a)
      for (int c = 0; c < DC; ++c) acc[a][c] = splat(0.f);
    const int64_t jn = s.ctx + i0 + r0 + rn;  // keys any of these rows sees
    for (int64_t j = 0; j < jn; ++j) {
      v16 vv[DC];
      for (int c = 0; c < DC; ++c) vv[c] = load16(vf + j * d + c * 16);
      for (int64_t a = 0; a < rn; ++a) {
        const float p = sc[(r0 + a) * nk + j];
        for (int c = 0; c < DC; ++c) acc[a][c] += p * vv[c];
      }
    }
    for (int64_t a = 0; a < rn; ++a) {
      T* o = out + (s.start + i0 + r0 + a) * so + hh * d;
      for (int c = 0; c < DC; ++c)
        for (int k = 0; k < 16; ++k) o[c * 16 + k] = static_cast<T>(acc[a][c][k]);
    }
  }
}

template <typename T, int DC>
void prefill(const T* q, int64_t sq, const T* kc, const T* vc, int64_t bs, T* out, int64_t h, int64_t kvh,
             const int64_t* starts, const int64_t* qlens, const int64_t* seq_lens, const int64_t* tables,
             int64_t tstride, int64_t R, float scale) {
  constexpr int64_t d = DC * 16;
  std::vector<Seq> seqs(R);
  int64_t off = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t lp = (seq_lens[r] + KB - 1) / KB * KB;
    seqs[r] = {starts[r], qlens[r], seq_lens[r] - qlens[r], lp, off};
    off += lp * kvh * d;
  }
  // float copies per (request, KV head): K transposed [d][lp] and V [lp][d], zero padded
  static std::vector<float> kt, vf;  // reused across layers (calls hold the GIL: one at a time)
  kt.assign(off, 0.f);
  vf.assign(off, 0.f);
  at::parallel_for(0, R * kvh, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t r = t / kvh, kh = t % kvh;
      const Seq& s = seqs[r];
      const int64_t* table = tables + r * tstride;
      float* ktp = kt.data() + s.off + kh * d * s.lp;
      float* vfp = vf.data() + s.off + kh * s.lp * d;
      for (int64_t j = 0; j < s.ctx + s.len; ++j) {
        const int64_t slot = (table[j / bs] * bs + j % bs) * kvh + kh;
        const T* kr = kc + slot * d;
        const T* vr = vc + slot * d;
        for (int64_t x = 0; x < d; ++x) {
          ktp[x * s.lp + j] = static_cast<float>(kr[x]);
          vfp[j * d + x] = static_cast<float>(vr[x]);
        }
      }
    }
  });
  struct Task {
    int64_t cost, r, hh, i0;
  };
  std::vector<Task> tasks;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i0 = 0; i0 < seqs[r].len; i0 += QB)
      for (int64_t hh = 0; hh < h; ++hh) {
        const int64_t i1 = std::min(seqs[r].len, i0 + QB);
        tasks.push_back({(i1 - i0) * (seqs[r].ctx + i1 + 8), r, hh, i0});
      }
  const int64_t g = h / kvh;
  costliest_first(
      tasks, [] { return std::vector<float>(); },
      [&](std::vector<float>& scratch, const Task& t) {
        const Seq& s = seqs[t.r];
        const int64_t kh = t.hh / g;
        attend_block<T, DC>(q, sq, out, h * d, s, t.hh, t.i0, std::min(s.len, t.i0 + QB),
                            kt.data() + s.off + kh * d * s.lp, vf.data() + s.off + kh * s.lp * d, scale, scratch);
      });
}

}  // namespace

// prefill_paged(q, k_cache, v_cache, out, starts, qlens, seq_lens, block_tables, scale): see
// the top of this file.
inline void prefill_paged(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                          torch::Tensor starts, torch::Tensor qlens, torch::Tensor seq_lens, torch::Tensor block_tables,
                          double scale) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q/out [T,h,d], k_cache/v_cache [nb,bs,kvh,d]");
  const int64_t h = q.size(1), d = q.size(2), bs = k_cache.size(1), kvh = k_cache.size(2);
  TORCH_CHECK(h % kvh == 0 && k_cache.size(3) == d, "head shapes");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d, "q: rows of contiguous heads (the row stride may be larger)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache/v_cache: contiguous");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out: contiguous, q's shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "prefill_paged: float32 or bfloat16");
  TORCH_CHECK(d == 64 || d == 128, "prefill_paged: head_dim 64 or 128");
  const auto args = ChunkArgs::make(starts, qlens, seq_lens, block_tables, q.size(0), bs, k_cache.size(0));
  auto run = [&](auto* type, auto dc) {
    using T_ = std::remove_pointer_t<decltype(type)>;
    prefill<T_, decltype(dc)::value>(q.data_ptr<T_>(), q.stride(0), k_cache.data_ptr<T_>(), v_cache.data_ptr<T_>(), bs,
                                      out.data_ptr<T_>(), h, kvh, args.starts.data_ptr<int64_t>(),
                                      args.qlens.data_ptr<int64_t>(), args.seq_lens.data_ptr<int64_t>(),
                                      args.tables.data_ptr<int64_t>(), args.max_blocks, args.R, (float)scale);
  };
  auto with_d = [&](auto* type) {
    if (d == 64) run(type, std::integral_constant<int, 4>{});
    else run(type, std::integral_constant<int, 8>{});
  };
  if (q.scalar_type() == at::kFloat) with_d(static_cast<float*>(nullptr));
  else with_d(static_cast<at::BFloat16*>(nullptr));
}
