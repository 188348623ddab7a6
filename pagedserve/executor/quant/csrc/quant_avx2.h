// The AVX2 + FMA + F16C kernels, included by quant_kernels.cpp inside `namespace avx2` and its
// target region:
//   few rows, Q4_0 / Q4_1 / Q8_0: each weight block expanded into registers and used for every
//     activation row, as scale * sum(x * q) + min * sum(x); Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1:
//     quant_kquant_avx2.h's fused tiles; other types: a row dequantized, then dot();
//   many rows (gemm_many_rows, any type): chunks of weight rows dequantized into an L2-sized float
//     buffer and multiplied by a 3x4 register-blocked micro-kernel;
//   gguf_q8 (int8 activations): quant_avx2_q8.h for few rows, quant_avx2_q8_many.h for many (also
//     run on AVX-512 CPUs without VNNI).
// No include guard on purpose.

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

#include "quant_dequant.h"
#include "quant_avx2_q8.h"

static inline float dot(const float* a, const float* b, int64_t K) {
  int64_t i = 0;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= K; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
  }
  float s = hsum8(_mm256_add_ps(a0, a1));
  for (; i < K; ++i) s += a[i] * b[i];
  return s;
}

// ---- fused kernels: Q4_0, Q4_1, Q8_0 --------------------------------------------------------
// Each block's 32 quants become float registers once and are used for up to MT activation
// rows; per block and row: acc += d * sum(x * q) (+ m * sum(x) for Q4_1, from g.xsum).
template <int TYPE>
static inline void unpack32(const uint8_t* blk, __m256* f) {
  if (TYPE == T_Q8_0) {
    const int8_t* qs = reinterpret_cast<const bq8_0*>(blk)->qs;
    for (int j = 0; j < 4; ++j)
      f[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * j))));
  } else {
    // bytes widened to dwords straight from memory, then both nibbles taken per lane:
    // bytes 0-7 give elements 0-7 (low nibbles) and 16-23 (high), bytes 8-15 give 8-15 and 24-31
    const uint8_t* qs = TYPE == T_Q4_0 ? reinterpret_cast<const bq4_0*>(blk)->qs : reinterpret_cast<const bq4_1*>(blk)->qs;
    const __m256i m4 = _mm256_set1_epi32(15);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
    __m256i l0 = _mm256_and_si256(b0, m4), l1 = _mm256_and_si256(b1, m4);
    __m256i h0 = _mm256_srli_epi32(b0, 4), h1 = _mm256_srli_epi32(b1, 4);
    if (TYPE == T_Q4_0) {
      const __m256i e8 = _mm256_set1_epi32(8);
      l0 = _mm256_sub_epi32(l0, e8);
      l1 = _mm256_sub_epi32(l1, e8);
      h0 = _mm256_sub_epi32(h0, e8);
      h1 = _mm256_sub_epi32(h1, e8);
    }
    f[0] = _mm256_cvtepi32_ps(l0);
    f[1] = _mm256_cvtepi32_ps(l1);
    f[2] = _mm256_cvtepi32_ps(h0);
    f[3] = _mm256_cvtepi32_ps(h1);
  }
}

// 1-8 rows, the same arithmetic at every row count (so a row's bits do not depend on the rows
// computed with it: a k-token verification computes what 1-row decode steps do): per block and
// row s = q0 x0, then 3 FMAs over the other vectors of 8 (one dependent chain a row; a form of
// two chains was slower, section 57), acc += d * s, and Q4_1's min term m * sum(x) from the
// activations' block sums (g.xsum). Until section 57, 4-8 rows folded d and m into the weights
// first (other bits than 1-3 rows', and 8-27% faster at 4-11 rows).
template <int TYPE, int MT>
static void gemm_fused_tile(const GemmArgs& g, int64_t n, int64_t m0) {
  constexpr int64_t BB = TYPE == T_Q8_0 ? sizeof(bq8_0) : TYPE == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
  const int64_t nb = g.K / 32;
  const uint8_t* row = g.W + n * g.rb;
  __m256 acc[MT];
  float accm[MT];
  for (int t = 0; t < MT; ++t) {
    acc[t] = _mm256_setzero_ps();
    accm[t] = 0.f;
  }
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* blk = row + i * BB;
    __m256 f[4];
    unpack32<TYPE>(blk, f);
    const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
    const __m256 vd = _mm256_set1_ps(h2f(hdr[0]));
    for (int t = 0; t < MT; ++t) {
      const float* x = g.X + (m0 + t) * g.K + i * 32;
      __m256 s = _mm256_mul_ps(f[0], _mm256_loadu_ps(x));
      s = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(x + 8), s);
      s = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(x + 16), s);
      s = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(x + 24), s);
      acc[t] = _mm256_fmadd_ps(s, vd, acc[t]);
    }
    if (TYPE == T_Q4_1) {
      const float mn = h2f(hdr[1]);
      for (int t = 0; t < MT; ++t) accm[t] += mn * g.xsum[(m0 + t) * nb + i];
    }
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = hsum8(acc[t]) + accm[t];
}

// Q4_0 / Q4_1 / Q8_0 rows through the same register unpacking as the fused kernel
template <int TYPE>
static void deq_fast(const uint8_t* src, float* y, int64_t K) {
  constexpr int64_t BB = TYPE == T_Q8_0 ? sizeof(bq8_0) : TYPE == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
  for (int64_t i = 0; i < K / 32; ++i, y += 32) {
    const uint8_t* blk = src + i * BB;
    const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
    __m256 f[4];
    unpack32<TYPE>(blk, f);
    const __m256 d = _mm256_set1_ps(h2f(hdr[0]));
    if (TYPE == T_Q4_1) {
      const __m256 m = _mm256_set1_ps(h2f(hdr[1]));
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + j * 8, _mm256_fmadd_ps(f[j], d, m));
    } else {
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + j * 8, _mm256_mul_ps(f[j], d));
    }
  }
}

#include "quant_kquant_avx2.h"
#include "quant_loops.h"

// ---- many rows (AVX2): dequantize a chunk of weight rows into an L2-resident float buffer,
// then a register-blocked micro-kernel: 3 activation rows x 4 weight rows, 12 accumulators,
// 7 loads per 12 FMAs, horizontal sums at the end of K. Every type (dequant_rows). Beats the
// dequantized-tile + BLAS path at 16-64 rows (no packing of the tile, no second pass over it).
static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {  // [sum a, sum b, sum c, sum d]
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 s = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

template <int MR, int NR>
static void micro_many(const float* X, int64_t ldx, const float* Wf, int64_t K, float* out, int64_t ldo) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 x[MR];
    for (int r = 0; r < MR; ++r) x[r] = _mm256_loadu_ps(X + r * ldx + k);
    for (int c = 0; c < NR; ++c) {
      const __m256 w = _mm256_loadu_ps(Wf + c * K + k);
      for (int r = 0; r < MR; ++r) acc[r][c] = _mm256_fmadd_ps(x[r], w, acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    if constexpr (NR == 4) {
      _mm_storeu_ps(out + r * ldo, hsum4x8(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    } else {
      for (int c = 0; c < NR; ++c) out[r * ldo + c] = hsum8(acc[r][c]);
    }
  }
}

template <int MR>
static inline void micro_cols(const float* X, int64_t ldx, const float* Wf, int64_t K, float* out, int64_t ldo,
                              int64_t nc) {
  int64_t c = 0;
  for (; c + 4 <= nc; c += 4) micro_many<MR, 4>(X, ldx, Wf + c * K, K, out + c, ldo);
  switch (nc - c) {
    case 3: micro_many<MR, 3>(X, ldx, Wf + c * K, K, out + c, ldo); break;
    case 2: micro_many<MR, 2>(X, ldx, Wf + c * K, K, out + c, ldo); break;
    case 1: micro_many<MR, 1>(X, ldx, Wf + c * K, K, out + c, ldo); break;
    default: break;
  }
}

// Output columns [n0, n1) for all M rows; K a multiple of 8 (every packed type's block is).
static void gemm_many_rows(const GemmArgs& g, int64_t n0, int64_t n1) {
  const int64_t NC = std::max<int64_t>(4, std::min<int64_t>(64, ((int64_t(48) << 10) / 4 / g.K) & ~int64_t(3)));
  // blocks of activation rows that stay in L2 (~384 KB) while every weight chunk passes over
  // them; each block dequantizes the chunks again (~2% of its multiply-adds at 48+ rows)
  const int64_t MB = std::max<int64_t>(48, ((int64_t(384) << 10) / 4 / g.K) / 3 * 3);
  // F32 rows are already floats: read in place, no copy
  const bool in_place = g.type == T_F32;
  thread_local std::vector<float> buf;
  if (!in_place) buf.resize(NC * g.K);
  for (int64_t mb = 0; mb < g.M; mb += MB) {
    const int64_t me = std::min(g.M, mb + MB);
    for (int64_t c0 = n0; c0 < n1; c0 += NC) {
      const int64_t nc = std::min(NC, n1 - c0);
      const float* wf = reinterpret_cast<const float*>(g.W + c0 * g.rb);
      if (!in_place) {
        dequant_rows(g.type, g.W + c0 * g.rb, g.rb, g.K, nullptr, 0, nc, buf.data());
        wf = buf.data();
      }
      int64_t m = mb;
      for (; m + 3 <= me; m += 3) micro_cols<3>(g.X + m * g.K, g.K, wf, g.K, g.out + m * g.ldo + c0, g.ldo, nc);
      if (me - m == 2) micro_cols<2>(g.X + m * g.K, g.K, wf, g.K, g.out + m * g.ldo + c0, g.ldo, nc);
      if (me - m == 1) micro_cols<1>(g.X + m * g.K, g.K, wf, g.K, g.out + m * g.ldo + c0, g.ldo, nc);
    }
  }
}

#include "quant_avx2_q8_many.h"
