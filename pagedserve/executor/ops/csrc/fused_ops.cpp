// Fused per-layer elementwise work of a decoder step on the CPU (pagedserve.executor.ops):
//   add_rms_norm_  residual += x; x = weight * rmsnorm(residual)        (in place, one pass)
//   rms_norm       out = weight * rmsnorm(x)
//   rotary_        neox rotary on the q and k heads of a fused qkv row  (in place)
//   rotary_cache_  the same, then K and V rows written to their paged-cache slots
//   silu_and_mul   out = silu(gate) * up over a fused [gate | up] row
//   argmax_rows    first index of each row's maximum (greedy sampling)
//   sample_rows    a token per row at a temperature, by inverse CDF from a given uniform
//
// Built per machine with -march=native (the build is keyed by the CPU's flags, as the
// attention kernel's): plain loops the compiler vectorizes for what the CPU has (SSE/AVX2/
// AVX-512), bfloat16 silu and roundings on AVX-512 intrinsics. Rounding follows PyTorch's
// eager ops step by step (-ffp-contract=off, no fast-math): rotary and the norm's scaling are
// bit-identical to the reference; the norm's sum of squares, silu's exp (a Cephes polynomial,
// ~2 ulp) and bf16 silu's reciprocal (rcp14 and a Newton step, ~1 ulp) differ in the last
// float32 bits (the same bf16 bits as torch's on 3.1M random elements).
// bfloat16 rounds where transformers rounds (the residual sum, the normed value, the
// product with the weight). Rows are split over threads only when a step has enough of them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx512_exp.h"  // exp16 (AVX-512 only)

namespace {

template <typename T>
inline float f(T x) { return static_cast<float>(x); }

template <typename T>
inline T r(float x) { return static_cast<T>(x); }

// Run fn(begin, end) over rows; in one thread when the work is small (a batch-1 step).
template <typename F>
void for_rows(int64_t rows, int64_t row_elems, F fn) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems));
  if (rows <= grain) {
    fn(0, rows);
  } else {
    at::parallel_for(0, rows, grain, fn);
  }
}

// ---- vectors ---------------------------------------------------------------------------
// GCC/Clang vector extensions as wide as the target's registers (16 float lanes with
// AVX-512, 8 with AVX/AVX2, 4 otherwise): one source serves every ISA.
#if defined(__AVX512F__)
constexpr int64_t W = 16;
#elif defined(__AVX__)
constexpr int64_t W = 8;
#else
constexpr int64_t W = 4;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

inline vf splat(float x) { return vf{} + x; }
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));

// W values of a row as floats / W floats stored as T. bfloat16 through bit operations (c10's
// conversions are the same arithmetic: round to nearest even, NaN -> 0x7FC0), which the
// compiler keeps in vector registers; c10's scalar conversions stay scalar in these loops.
template <typename T>
inline vf load_w(const T* p) {
  vf v;
  for (int k = 0; k < W; ++k) v[k] = static_cast<float>(p[k]);
  return v;
}
template <>
inline vf load_w(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <>
inline vf load_w(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  // one widening load and a shift (GCC lowers the generic conversion below to two 8-lane
  // widenings and an insert: ~20% of a bf16 SiLU-and-mul's instructions)
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  vf v;
  std::memcpy(&v, &w, sizeof v);
  return v;
#else
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
#endif
}

template <typename T>
inline void store_w(T* p, const vf& v) {
  for (int k = 0; k < W; ++k) p[k] = static_cast<T>(v[k]);
}
template <>
inline void store_w(float* p, const vf& v) { std::memcpy(p, &v, sizeof v); }
#if defined(__AVX512BF16__) && defined(__AVX512F__)
// AVX512-BF16: vcvtneps2bf16 rounds to nearest even in one instruction (the bit operations
// below took ~40 instructions per 16 values with the loads: bf16 add_rms_norm_ ran at 0.44x
// float32's speed on an AMX Xeon). The same bits except below float32's normal range, which
// it flushes to zero, and NaNs, which stay NaN with their payload quieted (not 0x7FC0).
inline __m256i bf16_bits(const vf& v) {
  __m512 x;
  std::memcpy(&x, &v, sizeof x);
  return (__m256i)_mm512_cvtneps_pbh(x);
}
template <>
inline void store_w(c10::BFloat16* p, const vf& v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(v));
}
#else
template <>
inline void store_w(c10::BFloat16* p, const vf& v) {
  vu u;
  std::memcpy(&u, &v, sizeof u);
  vu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const vu nan = reinterpret_cast<vu>(v != v);  // all ones where NaN
  rounded = (rounded & ~nan) | (nan & 0x7FC0u);
  const vh h = __builtin_convertvector(rounded, vh);
  std::memcpy(p, &h, sizeof h);
}
#endif

// x rounded to T and back (a no-op for float); bfloat16 in registers: store_w's rounding
// (nearest even, NaN -> 0x7FC0) with the low half cleared, the bits store_w + load_w give
template <typename T>
inline vf round_w(const vf& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(x)), 16);
    vf v;
    std::memcpy(&v, &w, sizeof v);
    return v;
#else
    vu u;
    std::memcpy(&u, &x, sizeof u);
    vu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    const vu nan = reinterpret_cast<vu>(x != x);
    rounded = (rounded & ~nan) | (nan & 0x7FC00000u);
    vf v;
    std::memcpy(&v, &rounded, sizeof v);
    return v;
#endif
  } else {
    T tmp[W];
    store_w(tmp, x);
    return load_w(tmp);
  }
}

// ---- RMSNorm ------------------------------------------------------------------------
// sum of squares over a row: W partial sums, then the lanes (a fixed order per row length)
inline float sum_lanes(const vf& acc) {
  float ss = 0.f;
  for (int k = 0; k < W; ++k) ss += acc[k];
  return ss;
}

// o[j] = T(w[j] * T(x[j] * inv)) over a row (transformers' two roundings)
template <typename T>
inline void scale_row(T* o, const T* x, const T* w, int64_t e, float inv) {
  int64_t j = 0;
  for (; j + W <= e; j += W) store_w(o + j, load_w(w + j) * round_w<T>(load_w(x + j) * inv));
  for (; j < e; ++j) o[j] = r<T>(f(w[j]) * f(r<T>(f(x[j]) * inv)));
}

template <typename T>
void add_rms_norm_kernel(T* x, T* res, const T* w, int64_t rows, int64_t e, int64_t sx, int64_t sr, float eps) {
  for_rows(rows, e, [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      T* xi = x + i * sx;
      T* ri = res + i * sr;
      vf acc = splat(0.f);
      int64_t j = 0;
      for (; j + W <= e; j += W) {
        const vf h = round_w<T>(load_w(xi + j) + load_w(ri + j));  // the residual sum, rounded to the dtype
        store_w(ri + j, h);
        acc += h * h;
      }
      float ss = sum_lanes(acc);
      for (; j < e; ++j) {
        const T h = r<T>(f(xi[j]) + f(ri[j]));
        ri[j] = h;
        ss += f(h) * f(h);
      }
      scale_row(xi, ri, w, e, 1.f / std::sqrt(ss / static_cast<float>(e) + eps));
    }
  });
}

template <typename T>
void rms_norm_kernel(T* out, const T* x, const T* w, int64_t rows, int64_t e, int64_t sx, float eps) {
  for_rows(rows, e, [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      const T* xi = x + i * sx;
      vf acc = splat(0.f);
      int64_t j = 0;
      for (; j + W <= e; j += W) {
        const vf v = load_w(xi + j);
        acc += v * v;
      }
      float ss = sum_lanes(acc);
      for (; j < e; ++j) ss += f(xi[j]) * f(xi[j]);
      scale_row(out + i * e, xi, w, e, 1.f / std::sqrt(ss / static_cast<float>(e) + eps));
    }
  });
}

// ---- rotary (neox: rotate halves), transformers' q * cos + rotate_half(q) * sin ------------
template <typename T>
inline void rope_head(T* x, const T* c, const T* s, int64_t half) {
  int64_t j = 0;
  for (; j + W <= half; j += W) {  // the same roundings on W lanes (the scalar conversions below
    // stayed scalar: bf16 rotary was ~4% of an embedding step on an AMX Xeon)
    const vf x1 = load_w(x + j), x2 = load_w(x + j + half);
    const vf a1 = round_w<T>(x1 * load_w(c + j)), b1 = round_w<T>(-x2 * load_w(s + j));
    const vf a2 = round_w<T>(x2 * load_w(c + j + half)), b2 = round_w<T>(x1 * load_w(s + j + half));
    store_w(x + j, a1 + b1);
    store_w(x + j + half, a2 + b2);
  }
  for (; j < half; ++j) {
    const float x1 = f(x[j]), x2 = f(x[j + half]);
    // the same roundings as eager: each product rounded to T, then the sum
    const float a1 = f(r<T>(x1 * f(c[j]))), b1 = f(r<T>(-x2 * f(s[j])));
    const float a2 = f(r<T>(x2 * f(c[j + half]))), b2 = f(r<T>(x1 * f(s[j + half])));
    x[j] = r<T>(a1 + b1);
    x[j + half] = r<T>(a2 + b2);
  }
}

// n K/V values into a cache row: copied, or rounded to a narrower cache dtype (kv_cache_dtype
// float16 / bfloat16 / float8: round to nearest even through c10's conversions, as torch's
// .to(); float8 e4m3fn saturates at +-448, e5m2 overflows to inf).
template <typename T, typename C>
inline void store_kv(C* dst, const T* src, int64_t n) {
  if constexpr (std::is_same_v<T, C>) {
    std::memcpy(dst, src, sizeof(T) * n);
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<C>(f(src[j]));
  }
}

template <typename T, typename C>
void rotary_kernel(T* qkv, const T* cos, const T* sin, int64_t rows, int64_t row_stride, int64_t nrot, int64_t d,
                   C* kc, C* vc, const int64_t* slots, int64_t nq, int64_t nkv) {
  const int64_t half = d / 2;
  for_rows(rows, nrot * d, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      T* row = qkv + t * row_stride;
      const T* c = cos + t * d;
      const T* s = sin + t * d;
      for (int64_t h = 0; h < nrot; ++h) rope_head(row + h * d, c, s, half);
      if (kc != nullptr) {
        const int64_t slot = slots[t];
        store_kv(kc + slot * nkv * d, row + nq * d, nkv * d);
        store_kv(vc + slot * nkv * d, row + (nq + nkv) * d, nkv * d);
      }
    }
  });
}

// ---- SiLU-and-multiply ----------------------------------------------------------------

template <typename V>
inline V exp_cephes(V x) {  // Cephes expf, ~2 ulp over [-87.3, 88.3] (clamped outside)
  x = x < -87.3f ? splat(-87.3f) : x;
  x = x > 88.3f ? splat(88.3f) : x;
  V fx = x * 1.44269504088896341f + 0.5f;
  const vi fi = __builtin_convertvector(fx, vi);  // truncation; floor below
  V fl = __builtin_convertvector(fi, V);
  fx = fl > fx ? fl - 1.f : fl;
  x = x - fx * 0.693359375f;
  x = x - fx * -2.12194440e-4f;
  const V z = x * x;
  V y = splat(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.f;
  const vi bits = (__builtin_convertvector(fx, vi) + 127) << 23;
  return y * reinterpret_cast<const V&>(bits);
}

inline float exp_scalar(float x) {  // the same polynomial, one lane (row tails)
  vf v = splat(x);
  return exp_cephes(v)[0];
}

template <typename T>
inline void store_silu_mul(T* o, const vf& act, const vf& u) {
  store_w(o, round_w<T>(act) * u);  // silu(gate) rounded to T
}

#if defined(__AVX512F__)
// silu(g) = g / (1 + e^-g) on 16 lanes for bfloat16 rows: e^-g by exp16 (avx512_exp.h: the
// same Cephes polynomial, its range reduction by roundscale and 2^n by scalef; the portable
// version's floor through two conversions and a select made this loop ~40% slower than
// float32's: 12% of an embedding step on an AMX Xeon, BENCHMARKS section 37), fused
// multiply-adds. Against torch's bf16 silu * up: the same bits on 3M random elements, as
// before. float32 rows keep the portable code (its unfused roundings are closer to torch's).
inline vf silu_fast(vf gv) {
  __m512 g;
  std::memcpy(&g, &gv, sizeof g);
  __m512 x = _mm512_sub_ps(_mm512_setzero_ps(), g);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));  // NaN: g carries it
  const __m512 d = _mm512_add_ps(exp16(x), _mm512_set1_ps(1.f));  // 1 + e^-g
  // g / d as g times 1 / d by rcp14 and one Newton step (~23 bits, within ~1 float32 ulp of
  // the quotient; the row tails below divide): ~10% of the loop's time in one A/B, noisy
  const __m512 y0 = _mm512_rcp14_ps(d);
  const __m512 act = _mm512_mul_ps(g, _mm512_fmadd_ps(_mm512_fnmadd_ps(d, y0, _mm512_set1_ps(1.f)), y0, y0));
  vf out;
  std::memcpy(&out, &act, sizeof out);
  return out;
}
#endif

template <typename T>
inline vf silu_w(const vf& gv) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) return silu_fast(gv);
#endif
  return gv / (1.f + exp_cephes(-gv));
}

template <typename T>
void silu_mul_kernel(T* out, const T* gu, int64_t rows, int64_t inter, int64_t sg) {
  for_rows(rows, inter, [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      const T* g = gu + i * sg;
      const T* u = g + inter;
      T* o = out + i * inter;
      int64_t j = 0;
      for (; j + W <= inter; j += W) {
        const vf gv = load_w(g + j), uv = load_w(u + j);
        const vf act = silu_w<T>(gv);
        store_silu_mul(o + j, act, uv);
      }
      for (; j < inter; ++j) {
        const float gf = f(g[j]);
        o[j] = r<T>(f(r<T>(gf / (1.f + exp_scalar(-gf)))) * f(u[j]));
      }
    }
  });
}

template <typename T>
void argmax_kernel(const T* x, int64_t* out, int64_t rows, int64_t v, int64_t sx) {
  auto body = [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      const T* xi = x + i * sx;
      // pass 1: the maximum, W lanes; pass 2: its first index. NaN counts as the maximum
      // (torch.argmax's rule).
      vf m = splat(-INFINITY);
      vi nan = vi{};
      int64_t j = 0;
      for (; j + W <= v; j += W) {
        vf y;
        y = load_w(xi + j);
        m = y > m ? y : m;
        nan |= (y != y);
      }
      float mx = -INFINITY;
      bool has_nan = false;
      for (int k = 0; k < W; ++k) {
        mx = std::max(mx, m[k]);
        has_nan |= nan[k] != 0;
      }
      for (int64_t t = j; t < v; ++t) {
        const float y = f(xi[t]);
        has_nan |= y != y;
        mx = std::max(mx, y);
      }
      int64_t idx = 0;
      for (int64_t t = 0; t < v; ++t) {
        const float y = f(xi[t]);
        if (has_nan ? (y != y) : (y == mx)) {
          idx = t;
          break;
        }
      }
      out[i] = idx;
    }
  };
  if (rows == 1) {
    body(0, 1);
  } else {
    at::parallel_for(0, rows, 1, body);
  }
}

// ---- sampling at a temperature (no top-k / top-p / min-p) ------------------------------
// Row i draws the first token whose running sum of exp((x - max) / T) reaches u[i] times the
// row's total: the same inverse-CDF rule as the PyTorch path (softmax, cumsum,
// searchsorted), in three passes over the row and no [B, V] temporaries. The total is the
// sum of 64-element chunk sums taken in order, and the search walks the same chunks, so the
// target always falls inside the row; -inf logits get probability 0 exactly.
constexpr int64_t kChunk = 64;

template <typename T>
void sample_row(const T* x, int64_t v, float temp, float u, float* e, float* chunk, int64_t* out) {
  vf m = splat(-INFINITY);
  int64_t j = 0;
  for (; j + W <= v; j += W) {
    vf y;
    y = load_w(x + j);
    m = y > m ? y : m;
  }
  float mx = -INFINITY;
  for (int k = 0; k < W; ++k) mx = std::max(mx, m[k]);
  for (int64_t t = j; t < v; ++t) mx = std::max(mx, f(x[t]));
  const float inv = 1.f / temp;
  const int64_t nchunks = (v + kChunk - 1) / kChunk;
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t a = c * kChunk, b = std::min(v, a + kChunk);
    vf acc = splat(0.f);
    int64_t t = a;
    for (; t + W <= b; t += W) {
      vf y;
      y = load_w(x + t);
      vf ex = exp_cephes((y - mx) * inv);
      ex = y > splat(-INFINITY) ? ex : splat(0.f);
      std::memcpy(e + t, &ex, sizeof ex);
      acc += ex;
    }
    float sum = 0.f;
    for (int k = 0; k < W; ++k) sum += acc[k];
    for (; t < b; ++t) {
      const float y = f(x[t]);
      sum += (e[t] = y > -INFINITY ? exp_scalar((y - mx) * inv) : 0.f);
    }
    chunk[c] = sum;
  }
  float total = 0.f;
  for (int64_t c = 0; c < nchunks; ++c) total += chunk[c];
  const float target = u * total;
  float run = 0.f;
  int64_t c = 0;
  for (; c < nchunks - 1 && run + chunk[c] < target; ++c) run += chunk[c];
  const int64_t a = c * kChunk, b = std::min(v, a + kChunk);
  int64_t pick = -1, last = a;
  for (int64_t t = a; t < b; ++t) {
    if (e[t] > 0.f) last = t;
    run += e[t];
    if (e[t] > 0.f && run >= target) {
      pick = t;
      break;
    }
  }
  *out = pick >= 0 ? pick : last;  // rounding inside the chunk: its last live token
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name, ": a CPU [rows, n] tensor with unit inner stride");
}

#define DISPATCH(dtype, ...)                                              \
  if ((dtype) == at::kFloat) {                                            \
    using T = float;                                                      \
    __VA_ARGS__();                                                        \
  } else if ((dtype) == at::kBFloat16) {                                  \
    using T = at::BFloat16;                                               \
    __VA_ARGS__();                                                        \
  } else {                                                                \
    TORCH_CHECK(false, "pagedserve fused ops: float32 or bfloat16 only"); \
  }

}  // namespace

void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && weight.is_contiguous() && weight.numel() == x.size(1), "shapes");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(), "dtypes");
  DISPATCH(x.scalar_type(), [&] {
    add_rms_norm_kernel<T>(x.data_ptr<T>(), residual.data_ptr<T>(), weight.data_ptr<T>(), x.size(0), x.size(1),
                           x.stride(0), residual.stride(0), (float)eps);
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && x.scalar_type() == weight.scalar_type(), "weight");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  DISPATCH(x.scalar_type(), [&] {
    rms_norm_kernel<T>(out.data_ptr<T>(), x.data_ptr<T>(), weight.data_ptr<T>(), x.size(0), x.size(1), x.stride(0),
                       (float)eps);
  });
  return out;
}

static void rotary_impl(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t nq, int64_t nkv, int64_t d,
                        torch::Tensor* kc, torch::Tensor* vc, torch::Tensor* slots) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(qkv.size(1) >= (nq + 2 * nkv) * d && d % 2 == 0, "qkv row too short for the heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == qkv.size(0) * d && sin.numel() == cos.numel(),
              "cos/sin: contiguous [T, head_dim]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "cos/sin dtype");
  if (kc != nullptr) {
    TORCH_CHECK(kc->is_contiguous() && vc->is_contiguous() && kc->dim() == 4 && kc->size(2) == nkv && kc->size(3) == d,
                "kv cache [blocks, block_size, kv_heads, head_dim], contiguous");
    const auto kt = kc->scalar_type();
    TORCH_CHECK((kt == qkv.scalar_type() || kt == at::kHalf || kt == at::kBFloat16 || kt == at::kFloat8_e4m3fn ||
                 kt == at::kFloat8_e5m2) &&
                    vc->scalar_type() == kt && vc->sizes() == kc->sizes(),
                "kv cache dtype (the model's, float16, bfloat16, float8_e4m3fn or float8_e5m2) / shape");
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->is_contiguous() && slots->numel() == qkv.size(0), "slots");
  }
  DISPATCH(qkv.scalar_type(), [&] {
    auto run = [&](auto* cache_type) {
      using C = std::remove_pointer_t<decltype(cache_type)>;
      rotary_kernel<T, C>(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), qkv.size(0), qkv.stride(0), nq + nkv,
                          d, kc ? kc->data_ptr<C>() : nullptr, vc ? vc->data_ptr<C>() : nullptr,
                          slots ? slots->data_ptr<int64_t>() : nullptr, nq, nkv);
    };
    const auto kt = kc ? kc->scalar_type() : qkv.scalar_type();
    if (kt == qkv.scalar_type()) run(static_cast<T*>(nullptr));
    else if (kt == at::kHalf) run(static_cast<at::Half*>(nullptr));
    else if (kt == at::kFloat8_e4m3fn) run(static_cast<c10::Float8_e4m3fn*>(nullptr));
    else if (kt == at::kFloat8_e5m2) run(static_cast<c10::Float8_e5m2*>(nullptr));
    else run(static_cast<at::BFloat16*>(nullptr));
  });
}

void rotary_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t nq, int64_t nkv, int64_t d) {
  rotary_impl(qkv, cos, sin, nq, nkv, d, nullptr, nullptr, nullptr);
}

void rotary_cache_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t nq, int64_t nkv, int64_t d,
                   torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  rotary_impl(qkv, cos, sin, nq, nkv, d, &k_cache, &v_cache, &slots);
}

torch::Tensor silu_and_mul(torch::Tensor gu) {
  check_rows(gu, "gate_up");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gate_up: even width");
  const int64_t inter = gu.size(1) / 2;
  auto out = torch::empty({gu.size(0), inter}, gu.options());
  DISPATCH(gu.scalar_type(), [&] { silu_mul_kernel<T>(out.data_ptr<T>(), gu.data_ptr<T>(), gu.size(0), inter, gu.stride(0)); });
  return out;
}

torch::Tensor argmax_rows(torch::Tensor x) {
  check_rows(x, "x");
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  DISPATCH(x.scalar_type(), [&] { argmax_kernel<T>(x.data_ptr<T>(), out.data_ptr<int64_t>(), x.size(0), x.size(1), x.stride(0)); });
  return out;
}

torch::Tensor sample_rows(torch::Tensor x, torch::Tensor temperature, torch::Tensor u) {
  check_rows(x, "logits");
  const int64_t rows = x.size(0), v = x.size(1);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.is_contiguous() && temperature.numel() == rows,
              "temperature: float32 [rows]");
  TORCH_CHECK(u.scalar_type() == at::kFloat && u.is_contiguous() && u.numel() == rows, "u: float32 [rows]");
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  const float* tp = temperature.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t sx = x.stride(0);
  DISPATCH(x.scalar_type(), [&] {  // bf16 logits are read as their exact float values
    const T* xp = x.data_ptr<T>();
    auto body = [&](int64_t b, int64_t end) {
      std::vector<float> e(v), chunk((v + kChunk - 1) / kChunk);
      for (int64_t i = b; i < end; ++i) sample_row(xp + i * sx, v, tp[i], up[i], e.data(), chunk.data(), op + i);
    };
    if (rows == 1) {
      body(0, 1);
    } else {
      at::parallel_for(0, rows, 1, body);
    }
  });
  return out;
}

std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#elif defined(__SSE4_1__)
  return "sse4";
#else
  return "generic";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("rms_norm", &rms_norm);
  m.def("rotary_", &rotary_);
  m.def("rotary_cache_", &rotary_cache_);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("argmax_rows", &argmax_rows);
  m.def("sample_rows", &sample_rows);
  m.def("isa", &isa);
}
