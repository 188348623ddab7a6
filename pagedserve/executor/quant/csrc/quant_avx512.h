// The AVX-512 F/BW/VL/DQ kernels, included by quant_kernels.cpp inside `namespace avx512` and its
// target region: few-row Q4_0 / Q4_1 / Q8_0 products with each block expanded into two 16-float
// registers, per block and row acc += d * sum(x * q) (+ m * sum(x) for Q4_1, from g.xsum); the
// K-quants, Q5_0 and Q5_1 on quant_kquant_avx2.h's fused tiles (AVX2 instructions); other types through a
// dequantized row and dot(); gguf_q8 few rows in AVX2 instructions
// (quant_avx2_q8.h). Many rows go to quant_avx2.h's kernels (dispatch in quant_kernels.cpp). The
// row-interleaved (quant_rows16.h), VNNI (quant_vnni.h) and BF16 (quant_bf16.h) kernels build on
// this namespace. No include guard on purpose.

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

#include "quant_dequant.h"
#include "quant_avx2_q8.h"

static inline float dot(const float* a, const float* b, int64_t K) {
  int64_t i = 0;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; i + 32 <= K; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), a1);
  }
  float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  for (; i < K; ++i) s += a[i] * b[i];
  return s;
}

// ---- fused kernels: Q4_0, Q4_1, Q8_0 --------------------------------------------------------
template <int TYPE>
static inline void unpack32(const uint8_t* blk, __m512* f) {
  if (TYPE == T_Q8_0) {
    const int8_t* qs = reinterpret_cast<const bq8_0*>(blk)->qs;
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16))));
  } else {
    const uint8_t* qs = TYPE == T_Q4_0 ? reinterpret_cast<const bq4_0*>(blk)->qs : reinterpret_cast<const bq4_1*>(blk)->qs;
    const __m128i m4 = _mm_set1_epi8(15);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
    if (TYPE == T_Q4_0) {
      const __m128i e8 = _mm_set1_epi8(8);
      f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(lo, e8)));
      f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(hi, e8)));
    } else {
      f[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
      f[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
    }
  }
}

template <int TYPE, int MT>
static void gemm_fused_tile(const GemmArgs& g, int64_t n, int64_t m0) {
  constexpr int64_t BB = TYPE == T_Q8_0 ? sizeof(bq8_0) : TYPE == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
  const int64_t nb = g.K / 32;
  const uint8_t* row = g.W + n * g.rb;
  __m512 acc[MT];
  float accm[MT];
  for (int t = 0; t < MT; ++t) {
    acc[t] = _mm512_setzero_ps();
    accm[t] = 0.f;
  }
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* blk = row + i * BB;
    __m512 f[2];
    unpack32<TYPE>(blk, f);
    const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
    const __m512 vd = _mm512_set1_ps(h2f(hdr[0]));
    for (int t = 0; t < MT; ++t) {
      const float* x = g.X + (m0 + t) * g.K + i * 32;
      __m512 s = _mm512_mul_ps(f[0], _mm512_loadu_ps(x));
      s = _mm512_fmadd_ps(f[1], _mm512_loadu_ps(x + 16), s);
      acc[t] = _mm512_fmadd_ps(s, vd, acc[t]);
    }
    if (TYPE == T_Q4_1) {
      const float mn = h2f(hdr[1]);
      for (int t = 0; t < MT; ++t) accm[t] += mn * g.xsum[(m0 + t) * nb + i];
    }
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = _mm512_reduce_add_ps(acc[t]) + accm[t];
}

// Q4_0 / Q4_1 / Q8_0 rows through the same register unpacking as the fused kernel
template <int TYPE>
static void deq_fast(const uint8_t* src, float* y, int64_t K) {
  constexpr int64_t BB = TYPE == T_Q8_0 ? sizeof(bq8_0) : TYPE == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
  for (int64_t i = 0; i < K / 32; ++i, y += 32) {
    const uint8_t* blk = src + i * BB;
    const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
    __m512 f[2];
    unpack32<TYPE>(blk, f);
    const __m512 d = _mm512_set1_ps(h2f(hdr[0]));
    if (TYPE == T_Q4_1) {
      const __m512 m = _mm512_set1_ps(h2f(hdr[1]));
      for (int j = 0; j < 2; ++j) _mm512_storeu_ps(y + j * 16, _mm512_fmadd_ps(f[j], d, m));
    } else {
      for (int j = 0; j < 2; ++j) _mm512_storeu_ps(y + j * 16, _mm512_mul_ps(f[j], d));
    }
  }
}

#include "quant_kquant_avx2.h"
#include "quant_loops.h"
