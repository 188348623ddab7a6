#pragma once
// Causal self-attention of prompt chunks with no cached context (prefill from position 0),
// on the CPU: every listed sequence's queries attend to its own keys 0..i, GQA-aware.
// Replaces one SDPA call per sequence (which scales poorly over two threads and runs bf16
// at a tenth of the core's FMA rate on these short rows) with one call for the step:
//
//   q        [T, h, d]   rows may be strided (the fused QKV projection's columns)
//   k, v     [T, kvh, d] likewise
//   out      [T, h, d]   contiguous; rows of the listed sequences are written
//   starts, lens  int64 [R]: sequence r is rows starts[r] .. starts[r] + lens[r] - 1
//
// float32 or bfloat16 in; everything in float32 (K transposed and V converted once per
// sequence and KV head), scores in blocks of 16 keys x up to 16 query rows, an exact softmax
// per row (a Cephes exp, ~2 ulp), P.V in float32; the output rounded once to q's dtype.
// Work is split over threads by (sequence, head, block of query rows), longest first, from a
// shared counter (rows near the end of a long prompt cost the most).
#include <torch/extension.h>
#include <ATen/Parallel.h>

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
  int64_t start, len, lp, off;  // rows, keys padded to KB, offset of its float K/V copies
};

// One task: query rows [i0, i1) of sequence s, head hh. kt: [d][lp] (K transposed, zero
// padded), vf: [lp][d]. DC = d / 16.
template <typename T, int DC>
void attend_block(const T* q, int64_t sq, T* out, int64_t so, const Seq& s, int64_t hh, int64_t i0, int64_t i1, const float* kt,
                  const float* vf, float scale, std::vector<float>& scratch) {
  constexpr int64_t d = DC * 16;
  const int64_t nr = i1 - i0, nk = (i1 + KB - 1) / KB * KB;  // keys 0 .. i1 - 1, padded
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
  for (int64_t r = 0; r < nr; ++r) {  // causal softmax of row r (position i0 + r sees keys 0 .. i0 + r)
    float* row = sc + r * nk;
    const int64_t n = i0 + r + 1;
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
    const int64_t jn = i0 + r0 + rn;  // keys any of these rows sees
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
void prefill(const T* q, int64_t sq, const T* k, int64_t sk, const T* v, int64_t sv, T* out, int64_t h, int64_t kvh,
             const int64_t* starts, const int64_t* lens, int64_t R, float scale) {
  constexpr int64_t d = DC * 16;
  std::vector<Seq> seqs(R);
  int64_t off = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t lp = (lens[r] + KB - 1) / KB * KB;
    seqs[r] = {starts[r], lens[r], lp, off};
    off += lp * kvh * d;
  }
  // float copies per (sequence, KV head): K transposed [d][lp] and V [lp][d], zero padded
  static std::vector<float> kt, vf;  // reused across layers (calls hold the GIL: one at a time)
  kt.assign(off, 0.f);
  vf.assign(off, 0.f);
  at::parallel_for(0, R * kvh, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const Seq& s = seqs[t / kvh];
      const int64_t kh = t % kvh;
      float* ktp = kt.data() + s.off + kh * d * s.lp;
      float* vfp = vf.data() + s.off + kh * s.lp * d;
      for (int64_t j = 0; j < s.len; ++j) {
        const T* kr = k + (s.start + j) * sk + kh * d;
        const T* vr = v + (s.start + j) * sv + kh * d;
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
        tasks.push_back({(i1 - i0) * (i1 + 8), r, hh, i0});
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

// prefill_causal(q, k, v, out, starts, lens, scale): see the top of this file.
inline void prefill_causal(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, torch::Tensor starts,
                    torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "q/out [T,h,d], k/v [T,kvh,d]");
  const int64_t h = q.size(1), d = q.size(2), kvh = k.size(1);
  TORCH_CHECK(h % kvh == 0 && k.size(2) == d && v.size(1) == kvh && v.size(2) == d, "head shapes");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && k.stride(2) == 1 && k.stride(1) == d && v.stride(2) == 1 &&
                  v.stride(1) == d,
              "q/k/v: rows of contiguous heads (the row stride may be larger)");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out: contiguous, q's shape");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "prefill_causal: float32 or bfloat16");
  TORCH_CHECK(d == 64 || d == 128, "prefill_causal: head_dim 64 or 128");
  auto st = starts.contiguous(), ln = lens.contiguous();
  TORCH_CHECK(st.scalar_type() == at::kLong && ln.scalar_type() == at::kLong && st.numel() == ln.numel(), "starts/lens");
  const int64_t R = st.numel(), T = q.size(0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t a = st.data_ptr<int64_t>()[r], n = ln.data_ptr<int64_t>()[r];
    TORCH_CHECK(a >= 0 && n > 0 && a + n <= T, "a sequence outside q's rows");
  }
  auto run = [&](auto* type, auto dc) {
    using T_ = std::remove_pointer_t<decltype(type)>;
    prefill<T_, decltype(dc)::value>(q.data_ptr<T_>(), q.stride(0), k.data_ptr<T_>(), k.stride(0), v.data_ptr<T_>(),
                                      v.stride(0), out.data_ptr<T_>(), h, kvh, st.data_ptr<int64_t>(),
                                      ln.data_ptr<int64_t>(), R, (float)scale);
  };
  auto with_d = [&](auto* type) {
    if (d == 64) run(type, std::integral_constant<int, 4>{});
    else run(type, std::integral_constant<int, 8>{});
  };
  if (q.scalar_type() == at::kFloat) with_d(static_cast<float*>(nullptr));
  else with_d(static_cast<at::BFloat16*>(nullptr));
}
