// AVX512-BF16 kernels: many-row products of bfloat16 models (prefill, batched decode, the
// speculative verification rows, the LM head) with packed weights. Included once by
// quant_kernels.cpp inside namespace avx512_bf16 and a target region that adds avx512bf16 to
// the AVX-512 set; the AVX-512 build's helpers (dequant_rows, scale_min_k4, h2f) come from
// `using namespace avx512`. No include guard on purpose.
//
// Numerics: the weights are not rounded. A block type's element is D * q + Mn with a small
// integer quant q (|q| <= 128: exact in bfloat16) and a float scale D and minimum Mn per group
// of GS elements (32; Q6_K 16). The kernel multiplies the bf16 activations (the model's dtype)
// by the exact quants on vdpbf16ps, float32 sums per group, then acc += D * sum + Mn * sum(x):
// the float kernels' products, summed in another order (and vdpbf16ps treats float32
// denormals as zero). The oneDNN route (dequant_rows_bf16x2) splits each float weight into
// two bfloat16s, hi + lo (16 bits of mantissa), multiplied as one product over 2K.

// ---- integer quants and group scales -------------------------------------------------------
static inline int quant_group_size(int type) {
  switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: case T_Q4_K: case T_Q5_K: return 32;
    case T_Q6_K: return 16;
    default: return 0;  // float rows: the float path
  }
}
static inline bool quant_has_min(int type) {
  return type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K;
}

// One packed row of K elements -> quants q[K] (element i = D[i / GS] * q[i] + Mn[i / GS]).
static void row_quants(int type, const uint8_t* src, int64_t K, int8_t* q, float* D, float* Mn) {
  switch (type) {
    case T_Q4_0: case T_Q4_1: {
      const int64_t BB = type == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
      const int off = type == T_Q4_0 ? 8 : 0;
      for (int64_t i = 0; i < K / 32; ++i, q += 32) {
        const uint8_t* blk = src + i * BB;
        const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
        const uint8_t* qs = blk + (type == T_Q4_0 ? 2 : 4);
        D[i] = h2f(hdr[0]);
        Mn[i] = type == T_Q4_1 ? h2f(hdr[1]) : 0.f;
        for (int j = 0; j < 16; ++j) {
          q[j] = (int8_t)((qs[j] & 15) - off);
          q[j + 16] = (int8_t)((qs[j] >> 4) - off);
        }
      }
      return;
    }
    case T_Q5_0: case T_Q5_1: {
      const int64_t BB = type == T_Q5_0 ? sizeof(bq5_0) : sizeof(bq5_1);
      const int off = type == T_Q5_0 ? 16 : 0;
      for (int64_t i = 0; i < K / 32; ++i, q += 32) {
        const uint8_t* blk = src + i * BB;
        const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
        const uint8_t* qh8 = blk + (type == T_Q5_0 ? 2 : 4);
        const uint8_t* qs = qh8 + 4;
        uint32_t qh;
        std::memcpy(&qh, qh8, 4);
        D[i] = h2f(hdr[0]);
        Mn[i] = type == T_Q5_1 ? h2f(hdr[1]) : 0.f;
        for (int j = 0; j < 16; ++j) {
          q[j] = (int8_t)(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - off);
          q[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off);
        }
      }
      return;
    }
    case T_Q8_0: {
      const bq8_0* b = reinterpret_cast<const bq8_0*>(src);
      for (int64_t i = 0; i < K / 32; ++i, q += 32) {
        D[i] = h2f(b[i].d);
        Mn[i] = 0.f;
        std::memcpy(q, b[i].qs, 32);
      }
      return;
    }
    case T_Q4_K: case T_Q5_K: {
      const bool five = type == T_Q5_K;
      const int64_t BB = five ? sizeof(bq5_K) : sizeof(bq4_K);
      for (int64_t i = 0; i < K / 256; ++i) {
        const uint8_t* blk = src + i * BB;
        const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
        const uint8_t* scales = blk + 4;
        const uint8_t* qh = five ? blk + 16 : nullptr;
        const uint8_t* qs = blk + (five ? 48 : 16);
        const float d = h2f(hdr[0]), dmin = h2f(hdr[1]);
        for (int j = 0; j < 4; ++j, qs += 32) {
          for (int h = 0; h < 2; ++h, q += 32) {
            int sc, m;
            scale_min_k4(2 * j + h, scales, &sc, &m);
            const int64_t g = i * 8 + 2 * j + h;
            D[g] = d * sc;  // the float kernels' d1 = d * sc, m1 = dmin * m
            Mn[g] = -(dmin * m);
            const int s = 2 * j + h;
            for (int l = 0; l < 32; ++l) {
              const int v = h ? qs[l] >> 4 : qs[l] & 15;
              q[l] = (int8_t)(five ? v | (((qh[l] >> s) & 1) << 4) : v);
            }
          }
        }
      }
      return;
    }
    case T_Q6_K: {
      const bq6_K* b = reinterpret_cast<const bq6_K*>(src);
      for (int64_t i = 0; i < K / 256; ++i) {
        const float d = h2f(b[i].d);
        const uint8_t* ql = b[i].ql;
        const uint8_t* qh = b[i].qh;
        const int8_t* sc = b[i].scales;
        int8_t* y = q + i * 256;
        float* Dg = D + i * 16;
        for (int n = 0; n < 2; ++n, y += 128, ql += 64, qh += 32, sc += 8, Dg += 8) {
          for (int l = 0; l < 32; ++l) {
            y[l] = (int8_t)(((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32);
            y[l + 32] = (int8_t)(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
            y[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            y[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
          }
          // groups of 16: elements 32 * t + 16 * u take sc[u + 2 * t] (the float kernel's d * sc)
          for (int t = 0; t < 4; ++t)
            for (int u = 0; u < 2; ++u) Dg[2 * t + u] = d * (float)sc[u + 2 * t];
        }
        for (int g = 0; g < 16; ++g) Mn[i * 16 + g] = 0.f;
      }
      return;
    }
    default: return;
  }
}

#include "avx512_transpose.h"  // transpose16x16_epi32

// 32 int8 quants -> 32 bfloat16 (exact)
static inline __m512i quants_bf16_32(const int8_t* q) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// Q4_0 / Q4_1 / Q8_0: a block's 32 quants as bfloat16 straight from the packed bytes (the
// AVX-512 float kernels' unpacking; Q4_0's centred), its scale and minimum
template <int TYPE>
static inline __m512i block_bf16(const uint8_t* blk, float* d, float* mn) {
  __m512 f[2];
  unpack32<TYPE>(blk, f);
  const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
  *d = h2f(hdr[0]);
  *mn = TYPE == T_Q4_1 ? h2f(hdr[1]) : 0.f;
  return (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);
}

// A group of 16 output columns (ncols valid) in the layout the micro-kernel reads: for each
// pair of elements (2p, 2p + 1), 64 bytes whose 32-bit lane c holds column c's two quants as
// bf16; D / Mn [K / GS][16] floats. Per 32-element block: the 16 columns' quants in registers,
// one 16 x 16 transpose of their dwords, 16 stores. Scratch q8: [16 * K] bytes (other types'
// quants, unpacked a row at a time).
template <int TYPE>
static void bf16_repack16_t(int type, const uint8_t* W, int64_t rb, int64_t K, int ncols, int8_t* q8, uint8_t* Q,
                            float* D, float* Mn) {
  constexpr bool FAST = TYPE == T_Q4_0 || TYPE == T_Q4_1 || TYPE == T_Q8_0;
  constexpr int64_t BB = TYPE == T_Q8_0 ? sizeof(bq8_0) : TYPE == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
  const int gsz = quant_group_size(type);
  const int64_t ng = K / gsz;
  if (!FAST) {
    thread_local std::vector<float> dtmp, mtmp;
    dtmp.resize(ng);
    mtmp.resize(ng);
    for (int c = 0; c < 16; ++c) {
      if (c < ncols) {
        row_quants(type, W + c * rb, K, q8 + c * K, dtmp.data(), mtmp.data());
      } else {
        std::memset(q8 + c * K, 0, K);
        std::fill(dtmp.begin(), dtmp.end(), 0.f);
        std::fill(mtmp.begin(), mtmp.end(), 0.f);
      }
      for (int64_t g = 0; g < ng; ++g) {
        D[g * 16 + c] = dtmp[g];
        Mn[g * 16 + c] = mtmp[g];
      }
    }
  }
  for (int64_t b = 0; b < K / 32; ++b) {
    __m512i e[16];
    for (int c = 0; c < 16; ++c) {
      if (!FAST) {
        e[c] = quants_bf16_32(q8 + c * K + b * 32);
      } else if (c < ncols) {
        e[c] = block_bf16<TYPE>(W + c * rb + b * BB, &D[b * 16 + c], &Mn[b * 16 + c]);
      } else {
        e[c] = _mm512_setzero_si512();
        D[b * 16 + c] = Mn[b * 16 + c] = 0.f;
      }
    }
    transpose16x16_epi32(e);
    for (int s = 0; s < 16; ++s) _mm512_storeu_si512(Q + (b * 16 + s) * 64, e[s]);
  }
}

static void bf16_repack16(int type, const uint8_t* W, int64_t rb, int64_t K, int ncols, int8_t* q8, uint8_t* Q,
                          float* D, float* Mn) {
  switch (type) {
    case T_Q4_0: return bf16_repack16_t<T_Q4_0>(type, W, rb, K, ncols, q8, Q, D, Mn);
    case T_Q4_1: return bf16_repack16_t<T_Q4_1>(type, W, rb, K, ncols, q8, Q, D, Mn);
    case T_Q8_0: return bf16_repack16_t<T_Q8_0>(type, W, rb, K, ncols, q8, Q, D, Mn);
    default: return bf16_repack16_t<-1>(type, W, rb, K, ncols, q8, Q, D, Mn);
  }
}

// R activation rows x G groups of 16 columns over all K: X bf16 rows `ldx` apart, XS their
// group sums (rows `ldxs` apart; MIN only); `Q`, `D`, `Mn` the first group (groups `gs` bytes
// / `gf` floats apart); out float rows `ldo` apart; `ncols` valid columns in the last group.
template <int GS, bool MIN, int R, int G>
static void bf16_micro(const uint16_t* X, int64_t ldx, const float* XS, int64_t ldxs, const uint8_t* Q,
                       const float* D, const float* Mn, int64_t gs, int64_t gf, int64_t K, float* out, int64_t ldo,
                       int ncols) {
  __m512 acc[R][G];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < G; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t ng = K / GS;
  for (int64_t grp = 0; grp < ng; ++grp) {
    __m512 s[R][G];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < G; ++c) s[r][c] = _mm512_setzero_ps();
    const uint8_t* qg = Q + grp * (GS / 2) * 64;
    const uint16_t* xg = X + grp * GS;
#pragma GCC unroll 16
    for (int p = 0; p < GS / 2; ++p) {
      __m512bh w[G];
#pragma GCC unroll 8
      for (int c = 0; c < G; ++c) w[c] = (__m512bh)_mm512_loadu_si512(qg + c * gs + p * 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t xv;
        std::memcpy(&xv, xg + r * ldx + 2 * p, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(xv);
#pragma GCC unroll 8
        for (int c = 0; c < G; ++c) s[r][c] = _mm512_dpbf16_ps(s[r][c], w[c], xb);
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < G; ++c) {
      const __m512 dv = _mm512_loadu_ps(D + c * gf + grp * 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(s[r][c], dv, acc[r][c]);
      if (MIN) {
        const __m512 mv = _mm512_loadu_ps(Mn + c * gf + grp * 16);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(mv, _mm512_set1_ps(XS[r * ldxs + grp]), acc[r][c]);
      }
    }
  }
  const __mmask16 tail = (__mmask16)((1u << ncols) - 1u);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < G; ++c) {
      float* o = out + r * ldo + c * 16;
      if (c == G - 1 && ncols < 16)
        _mm512_mask_storeu_ps(o, tail, acc[r][c]);
      else
        _mm512_storeu_ps(o, acc[r][c]);
    }
}

constexpr int BF_MR = 4;  // activation rows per micro-kernel call
constexpr int BF_G = 3;   // groups of 16 columns per call (12 accumulators + 12 group sums)

template <int GS, bool MIN, int G>
static void bf16_rows(const uint16_t* X, const float* XS, int64_t K, int64_t m0, int64_t m1, const uint8_t* Q,
                      const float* D, const float* Mn, int64_t gs, int64_t gf, float* out, int64_t ldo, int ncols) {
  const int64_t ldxs = K / GS;
#define QK_BF16_MICRO(RR)                                                                                   \
  bf16_micro<GS, MIN, RR, G>(X + m * K, K, XS ? XS + m * ldxs : nullptr, ldxs, Q, D, Mn, gs, gf, K, out + m * ldo, \
                             ldo, ncols)
  int64_t m = m0;
  for (; m + BF_MR <= m1; m += BF_MR) QK_BF16_MICRO(BF_MR);
  switch (m1 - m) {
    case 3: QK_BF16_MICRO(3); break;
    case 2: QK_BF16_MICRO(2); break;
    case 1: QK_BF16_MICRO(1); break;
    default: break;
  }
#undef QK_BF16_MICRO
}

template <int GS, bool MIN>
static void gemm_bf16_cols_t(int type, const uint8_t* W, int64_t rb, int64_t K, const uint16_t* X, const float* XS,
                             int64_t M, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  constexpr int64_t NC = 16 * BF_G;  // columns repacked at a time: 48 * K * 2 bytes (L2)
  const int64_t gs = K / 2 * 64, gf = K / GS * 16;
  // blocks of activation rows that stay in L2 (~512 KB of bf16) while every chunk passes over them
  const int64_t MB = std::max<int64_t>(64, ((int64_t(512) << 10) / (2 * K)) / BF_MR * BF_MR);
  thread_local std::vector<uint8_t> qbuf;
  thread_local std::vector<float> dbuf, mbuf;
  thread_local std::vector<int8_t> q8;
  qbuf.resize(BF_G * gs);
  dbuf.resize(BF_G * gf);
  mbuf.resize(BF_G * gf);
  q8.resize(16 * K);
  for (int64_t mb = 0; mb < M; mb += MB) {
    const int64_t me = std::min(M, mb + MB);
    for (int64_t c0 = n0; c0 < n1; c0 += NC) {
      const int64_t nc = std::min(NC, n1 - c0), ng = (nc + 15) / 16;
      for (int64_t j = 0; j < ng; ++j)
        bf16_repack16(type, W + (c0 + 16 * j) * rb, rb, K, (int)std::min<int64_t>(16, nc - 16 * j), q8.data(),
                      qbuf.data() + j * gs, dbuf.data() + j * gf, mbuf.data() + j * gf);
      const int last = (int)(nc - 16 * (ng - 1));
      float* o = out + c0;
      switch (ng) {
        case 3: bf16_rows<GS, MIN, 3>(X, XS, K, mb, me, qbuf.data(), dbuf.data(), mbuf.data(), gs, gf, o, ldo, last); break;
        case 2: bf16_rows<GS, MIN, 2>(X, XS, K, mb, me, qbuf.data(), dbuf.data(), mbuf.data(), gs, gf, o, ldo, last); break;
        default: bf16_rows<GS, MIN, 1>(X, XS, K, mb, me, qbuf.data(), dbuf.data(), mbuf.data(), gs, gf, o, ldo, last); break;
      }
    }
  }
}

// out[:, n0:n1] (float, rows `ldo` apart, already offset by the segment's first column) =
// X [M, K] bf16 @ dequant(W rows n0..n1).T for a block type (quant_group_size > 0); XS [M, K/GS]
// the activations' group sums (types with a minimum).
static void gemm_bf16_cols(int type, const uint8_t* W, int64_t rb, int64_t K, const uint16_t* X, const float* XS,
                           int64_t M, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  if (quant_group_size(type) == 16) return gemm_bf16_cols_t<16, false>(type, W, rb, K, X, XS, M, out, ldo, n0, n1);
  if (quant_has_min(type)) return gemm_bf16_cols_t<32, true>(type, W, rb, K, X, XS, M, out, ldo, n0, n1);
  gemm_bf16_cols_t<32, false>(type, W, rb, K, X, XS, M, out, ldo, n0, n1);
}

// Rows [r0, r1) of the activations' group sums (float32, in element order): XS [M, K / GS]
static void group_sums(const uint16_t* X, int64_t K, int GS, int64_t r0, int64_t r1, float* XS) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < K / GS; ++g) {
      float s = 0.f;
      for (int j = 0; j < GS; ++j) {
        const uint32_t u = (uint32_t)X[r * K + g * GS + j] << 16;
        float f;
        std::memcpy(&f, &u, 4);
        s += f;
      }
      XS[r * (K / GS) + g] = s;
    }
}

// The oneDNN route's weights: rows [r0, r1) of a packed matrix dequantized to float and split
// into bf16 hi = bf16(w) and lo = bf16(w - hi): out row r = [hi (K), lo (K)], `ldo` apart.
static void dequant_rows_bf16x2(int type, const uint8_t* W, int64_t rb, int64_t K, int64_t r0, int64_t r1,
                                uint16_t* out, int64_t ldo) {
  thread_local std::vector<float> buf;
  buf.resize(K);
  float* f = buf.data();
  for (int64_t r = r0; r < r1; ++r) {
    dequant_rows(type, W + r * rb, rb, K, nullptr, 0, 1, f);
    uint16_t* o = out + (r - r0) * ldo;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mk = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1u);
      const __m512 v = _mm512_maskz_loadu_ps(mk, f + k);
      const __m256bh hi = _mm512_cvtneps_pbh(v);
      const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)hi), 16));
      const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(v, hf));
      _mm256_mask_storeu_epi16(o + k, mk, (__m256i)hi);
      _mm256_mask_storeu_epi16(o + K + k, mk, (__m256i)lo);
    }
  }
}
