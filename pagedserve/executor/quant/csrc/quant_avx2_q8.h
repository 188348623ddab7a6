// The gguf_q8 few-row code in AVX2 instructions (activation quantization, a block's quants as
// bytes, the vpmaddubsw dot products), included by quant_avx2.h and, unchanged, by
// quant_avx512.h: on AVX-512 CPUs the integer gains come from VNNI (quant_vnni.h), not from wider
// vpmaddubsw. quant_kernels.cpp compiles it once more for AVX-VNNI (QK_AVX_VNNI 1: namespace
// avx_vnni), where u8 x s8 sums are vpdpbusd's (quant_dot_u8s8.h's dot_add). Needs h2f() and the block
// structs. No include guard on purpose.

#include "quant_dot_u8s8.h"  // dot_add, dot_widen, kVnni

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---- activation-quantized products (the named option "gguf_q8", as llama.cpp's q8 dot products) ----
// Blocks [b0, b1) of 32 floats -> int8 quants round-half-even(x / d) in [-127, 127], d =
// max|x| / 127 (0 for an all-zero block), s = d * sum(quants). x * (1 / d) is clamped to
// +-127 and a NaN product becomes 0, so non-finite or tiny (d below FLT_MIN: 1 / d = inf)
// blocks give bounded quants, never -128 (the sign trick's blind spot); such inputs give
// finite garbage, not NaN. The vector and scalar code give the same bits for every input.
static void quantize_q8_blocks(const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, float* s) {
  for (int64_t b = b0; b < b1; ++b) {
    const float* v = x + b * 32;
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 f[4], mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      f[j] = _mm256_loadu_ps(v + 8 * j);
      mx = _mm256_max_ps(_mm256_andnot_ps(sign, f[j]), mx);  // a NaN is skipped, as std::max does
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float dd = amax / 127.f, id = dd > 0.f ? 1.f / dd : 0.f;
    const __m256 iv = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    __m256i i[4];
    for (int j = 0; j < 4; ++j) {
      __m256 y = _mm256_mul_ps(f[j], iv);
      y = _mm256_and_ps(y, _mm256_cmp_ps(y, y, _CMP_ORD_Q));          // NaN -> 0
      y = _mm256_min_ps(_mm256_max_ps(y, lo), hi);                     // +-inf -> +-127
      i[j] = _mm256_cvtps_epi32(y);                                    // MXCSR: round half to even
    }
    // 32 x int32 -> 32 x int8 in order (packs interleave 128-bit lanes; the permute undoes it)
    const __m256i p16 = _mm256_packs_epi32(i[0], i[1]), p16b = _mm256_packs_epi32(i[2], i[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, p16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), p8);
    const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    const int32_t sum = _mm_cvtsi128_si32(s4);
    d[b] = dd;
    s[b] = dd * (float)sum;
  }
}

// A Q4_0 / Q4_1 / Q8_0 block's 32 quants as bytes in element order, for the integer kernels:
// Q8_0's signed bytes as stored; nibbles as unsigned 0..15 (Q4_0's not centred)
template <int TYPE>
static inline __m256i quant_bytes32(const uint8_t* blk) {
  if (TYPE == T_Q8_0)
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const bq8_0*>(blk)->qs));
  const uint8_t* qs = TYPE == T_Q4_0 ? reinterpret_cast<const bq4_0*>(blk)->qs : reinterpret_cast<const bq4_1*>(blk)->qs;
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1),
                          _mm256_set1_epi8(15));
}

// Q6_K's 32-quant block j (0..7) of a super-block, uncentred (q in 0..63; its value is q - 32)
// as bytes in element order. ggml's layout: in 128-element half n = j / 4, quarter jj = j % 4, element l's
// low four bits are ql[64n + 32(jj % 2) + l] >> 4(jj / 2), its high two qh[32n + l] >> 2jj. The
// block's halves of 16 elements have the int8 scales sc[2j] and sc[2j + 1] (times d).
static inline __m256i q6k_block_q(const bq6_K& b, int j) {
  const int n = j / 4, jj = j % 4;
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * n + 32 * (jj % 2)));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * n));
  const __m256i lo = _mm256_and_si256(jj / 2 ? _mm256_srli_epi16(l, 4) : l, _mm256_set1_epi8(15));
  const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * jj), _mm256_set1_epi8(3)), 4);
  return _mm256_or_si256(lo, hi);
}

// Q6_K's quants centred (q - 32, in [-32, 31]): signed bytes, for the vpmaddubsw kernels
static inline __m256i q6k_centred(__m256i q) { return _mm256_sub_epi8(q, _mm256_set1_epi8(32)); }

// Q5_K's fifth bits of sub-block sb (bit sb of qh[l], ggml's layout) as 16 in byte l, to OR onto
// its nibbles: 0..31, unsigned
static inline __m256i q5k_high(__m256i qh, int sb) {
  return _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, sb), 4), _mm256_set1_epi8(16));
}

// Block i of a weight row's 32-quant blocks in the integer kernels: its quants as bytes
// (quant_bytes32's: Q4_0's uncentred; Q6_K's too, q6k_block_q), its scale and its minimum
// (Q4_1's, Q4_K's and Q5_K's, else 0); Q6_K's scale is d, its halves' int8 scales sa and sb.
// Q4_K's block i is sub-block i % 8 of super-block i / 8, an exact Q4_1 block (kmin_sub_scales):
// the low (even) or high nibbles of 32 bytes of its qs; Q5_K's the same with a fifth bit from qh
// (q5k_high), a Q5_1 block. The many-row repacks and the few-row tiles of the other types (Q4_K's
// and Q5_K's few-row tile walks each super-block in pairs of sub-blocks instead, one load of qs a
// pair: a block at a time made Q4_K's 1.1-1.5x slower at 1-4 rows).
struct Q8Block {
  __m256i q;
  float d, mn;
  int sa = 1, sb = 1;
};
template <int TYPE>
static inline Q8Block q8_weight_block(const uint8_t* row, int64_t i) {
  Q8Block b;
  if constexpr (TYPE == T_Q6_K) {
    const bq6_K& kb = reinterpret_cast<const bq6_K*>(row)[i / 8];
    const int j = int(i % 8);
    b.q = q6k_block_q(kb, j);
    b.d = h2f(kb.d);
    b.mn = 0.f;
    b.sa = kb.scales[2 * j];
    b.sb = kb.scales[2 * j + 1];
  } else if constexpr (TYPE == T_Q4_K || TYPE == T_Q5_K) {
    using B = std::conditional_t<TYPE == T_Q5_K, bq5_K, bq4_K>;
    const B& kb = reinterpret_cast<const B*>(row)[i / 8];
    const int sb = int(i % 8);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb.qs + 32 * (sb / 2)));
    b.q = _mm256_and_si256(sb % 2 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(15));
    if constexpr (TYPE == T_Q5_K)
      b.q = _mm256_or_si256(b.q, q5k_high(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb.qh)), sb));
    kmin_sub_scales(kb, sb, &b.d, &b.mn);
  } else {
    constexpr int64_t BB = TYPE == T_Q8_0 ? sizeof(bq8_0) : TYPE == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
    const uint8_t* blk = row + i * BB;
    const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
    b.q = quant_bytes32<TYPE>(blk);
    b.d = h2f(hdr[0]);
    b.mn = TYPE == T_Q4_1 ? h2f(hdr[1]) : 0.f;
  }
  return b;
}

// 8 x 8 dwords transposed (the many-row repacks: column c's dword s -> step s's lane c)
static inline void transpose8x8_epi32(const __m256i* e, __m256i* o) {
  const __m256i t0 = _mm256_unpacklo_epi32(e[0], e[1]), t1 = _mm256_unpackhi_epi32(e[0], e[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(e[2], e[3]), t3 = _mm256_unpackhi_epi32(e[2], e[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(e[4], e[5]), t5 = _mm256_unpackhi_epi32(e[4], e[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(e[6], e[7]), t7 = _mm256_unpackhi_epi32(e[6], e[7]);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
  o[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
  o[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
  o[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
  o[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
  o[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  o[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  o[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  o[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// Weights with a minimum term (Q4_1, Q4_K: nibbles; Q5_K: 0..31) are unsigned bytes; the others
// (Q4_0 and Q6_K centred, Q8_0) signed bytes, which lend their sign to x in vpmaddubsw / vpdpbusd
constexpr bool q8_has_min(int type) { return type == T_Q4_1 || type == T_Q4_K || type == T_Q5_K; }

// The many-row kernels' m_w * (d_x * sum(x quants)) term: the minimum of those, and Q4_0's
// -8 * d (its quants repacked uncentred); Q8_0's and Q6_K's repacked quants need none
constexpr bool q8_many_min_term(int type) { return q8_has_min(type) || type == T_Q4_0; }

// One weight block (w: its 32 quants as bytes) in the few-row integer tiles, for MT activation
// rows from m0: acc[t] += (dw * xd) * sum(w * xq) (vpmaddubsw multiplies unsigned by signed
// bytes: SIGNED weights lend their sign to x), then (MIN: Q4_1's, Q4_K's and Q5_K's minimum term)
// accm[t] = fma(mn, xs, accm[t]) (written out: the VNNI tiles must round it alike, and the
// compiler's own contraction differs between loops). `mul`: the 16-bit factors of vpmaddwd,
// 1, or Q6_K's scales of elements 0-15 (low 128 bits) and 16-31 (q6k_mul16): each 32-bit lane is
// then sc * (its 4 products), exact (pairs at most 2 * 32 * 127). Without SCALED (mul is ones)
// the products are dot_add's (a pair at most 2 * 128 * 127: signed weights' magnitudes).
template <int MT, bool SIGNED, bool MIN, bool SCALED = false>
static inline void q8_block_step(const GemmQ8Args& g, __m256i w, float dw, float mn, int64_t m0, int64_t blk,
                                 __m256 (&acc)[MT], float (&accm)[MT], __m256i mul = _mm256_set1_epi16(1)) {
  const int64_t nb = g.K / 32;
  const __m256i wu = SIGNED ? _mm256_sign_epi8(w, w) : w;
  for (int t = 0; t < MT; ++t) {
    const int64_t r = (m0 + t) * nb + blk;
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.xq + r * 32));
    if (SIGNED) x = _mm256_sign_epi8(x, w);
    const __m256i p = SCALED ? _mm256_madd_epi16(_mm256_maddubs_epi16(wu, x), mul)
                             : dot_widen(dot_add(_mm256_setzero_si256(), wu, x));
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * g.xd[r]), acc[t]);
  }
  if (MIN)
    for (int t = 0; t < MT; ++t) accm[t] = std::fma(mn, g.xs[(m0 + t) * nb + blk], accm[t]);
}

// The activations were quantized per 32-element block to int8 (Q8A: scale xd = max|x| / 127,
// quants xq, and xs = xd * sum(xq) for Q4_1's min term); each weight block's quants meet them in
// integer multiply-adds, then acc += (d_w * xd) * dot + m_w * xs. Q4_0, Q4_1, Q8_0 only.
template <int TYPE, int MT>
static void gemm_q8_tile(const GemmQ8Args& g, int64_t n, int64_t m0) {
  const int64_t nb = g.K / 32;
  const uint8_t* row = g.W + n * g.rb;
  __m256 acc[MT];
  float accm[MT];
  for (int t = 0; t < MT; ++t) {
    acc[t] = _mm256_setzero_ps();
    accm[t] = 0.f;
  }
  for (int64_t i = 0; i < nb; ++i) {
    Q8Block b = q8_weight_block<TYPE>(row, i);
    if (TYPE == T_Q4_0) b.q = _mm256_sub_epi8(b.q, _mm256_set1_epi8(8));
    q8_block_step<MT, !q8_has_min(TYPE), q8_has_min(TYPE)>(g, b.q, b.d, b.mn, m0, i, acc, accm);
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = hsum8(acc[t]) + accm[t];
}

// A Q4_K or Q5_K super-block's 8 sub-block scales and minimums as floats, d * sc and -dmin * m
// (each the product kmin_sub_scales makes, so the same bits): the 6-bit fields gathered four
// bytes at a time (sc in u[0..1], m in u[2..3]; llama.cpp's unpacking), widened and scaled in one
// vector each
template <class B>
static inline void kmin_scales8(const B& b, float* dw, float* mn) {
  uint32_t u[4];
  std::memcpy(u, b.scales, 12);
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  const uint32_t m03 = u[1] & k1;
  u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  u[2] = m03;
  u[0] &= k1;
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)u[1], (int)u[0])));
  const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)u[3], (int)u[2])));
  _mm256_storeu_ps(dw, _mm256_mul_ps(_mm256_set1_ps(h2f(b.d)), sc));
  _mm256_storeu_ps(mn, _mm256_mul_ps(_mm256_set1_ps(-h2f(b.dmin)), m));
}

// Q4_K / Q5_K with int8 activations: each super-block's 8 sub-blocks are Q4_1 / Q5_1 blocks
// (kmin_sub_scales; kmin_scales8 for one row), two of them a 32-byte load of qs (low, high
// nibbles; Q5_K's fifth bits from one load of qh a super-block, q5k_high); per sub-block the
// steps of gemm_q8_tile<T_Q4_1>. quant_vnni.h's gemm_q8_tile1_kmin walks them alike.
template <int TYPE, int MT>
static void gemm_q8_tile_kmin(const GemmQ8Args& g, int64_t n, int64_t m0) {
  using B = std::conditional_t<TYPE == T_Q5_K, bq5_K, bq4_K>;
  const int64_t ns = g.K / 256;
  const B* row = reinterpret_cast<const B*>(g.W + n * g.rb);
  __m256 acc[MT];
  float accm[MT];
  for (int t = 0; t < MT; ++t) {
    acc[t] = _mm256_setzero_ps();
    accm[t] = 0.f;
  }
  const __m256i m4 = _mm256_set1_epi8(15);
  for (int64_t i = 0; i < ns; ++i) {
    // one row: the 8 scales at once (Q4_K: 1.2x faster at 1 row; 1.03-1.1x slower at 2, 3 and 5
    // rows, which decode each sub-block's as they go)
    alignas(32) float dw8[8], mn8[8];
    if constexpr (MT == 1) kmin_scales8(row[i], dw8, mn8);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (TYPE == T_Q5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[i].qh));
    for (int p = 0; p < 4; ++p) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[i].qs + 32 * p));
      __m256i w[2] = {_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4)};
      if constexpr (TYPE == T_Q5_K)
        for (int h = 0; h < 2; ++h) w[h] = _mm256_or_si256(w[h], q5k_high(qh, 2 * p + h));
      for (int h = 0; h < 2; ++h) {
        float dw, mn;
        if constexpr (MT == 1) {
          dw = dw8[2 * p + h];
          mn = mn8[2 * p + h];
        } else {
          kmin_sub_scales(row[i], 2 * p + h, &dw, &mn);
        }
        q8_block_step<MT, false, true>(g, w[h], dw, mn, m0, i * 8 + 2 * p + h, acc, accm);
      }
    }
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = hsum8(acc[t]) + accm[t];
}

// Q6_K's per-half scales as vpmaddwd factors: sa in the low 128 bits (elements 0-15), sb above
static inline __m256i q6k_mul16(int sa, int sb) {
  return _mm256_set_m128i(_mm_set1_epi16((short)sb), _mm_set1_epi16((short)sa));
}

// Q6_K with int8 activations: each 32-quant block centred (q6k_centred: signed, |q| <= 32), its
// two halves' sums times their int8 scales in vpmaddwd (q6k_mul16), then the float step of
// gemm_q8_tile with d: acc += float(sa * sum_a + sb * sum_b) * (d * xd) per lane. The scales and
// d are read per super-block. AVX512-VNNI CPUs run this tile too (its vpdpbusd + vpmulld took
// 1.02-1.45x the time at 1-5 rows).
template <int MT>
static void gemm_q8_tile_q6k(const GemmQ8Args& g, int64_t n, int64_t m0) {
  const int64_t ns = g.K / 256;
  const bq6_K* row = reinterpret_cast<const bq6_K*>(g.W + n * g.rb);
  __m256 acc[MT];
  float accm[MT];
  for (int t = 0; t < MT; ++t) {
    acc[t] = _mm256_setzero_ps();
    accm[t] = 0.f;
  }
  for (int64_t i = 0; i < ns; ++i) {
    const float d = h2f(row[i].d);
    for (int j = 0; j < 8; ++j) {
      const __m256i mul = q6k_mul16(row[i].scales[2 * j], row[i].scales[2 * j + 1]);
      q8_block_step<MT, true, false, true>(g, q6k_centred(q6k_block_q(row[i], j)), d, 0.f, m0, i * 8 + j, acc, accm,
                                         mul);
    }
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = hsum8(acc[t]) + accm[t];  // (+0.f, as every tile ends)
}
