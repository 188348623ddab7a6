// AVX512-VNNI products of act_q8 ("gguf_q8": int8 activations) on the row-interleaved copies of
// Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K weights (quant_rows16_layout.h: per group of 16 rows and block
// of 32, the 16 rows' d, Q4_1's m, then the quants; the K-quants' per super-block, below): decode,
// verification rows and, as fast as the packed rows' many-row kernel, prefill (rows16_q8_rows).
// Included once by quant_kernels.cpp inside namespace avx512_vnni_rows16 within the AVX512-VNNI
// target region (GemmQ8Args, the block types and the layout's names are the file's). No include
// guard on purpose.
//
// The packed rows' few-row tiles (quant_vnni.h) are horizontal: one output row's block at a
// time, 8 lanes of partial sums, a scale and a lane sum per row; from 2 rows on their time grows
// with the rows (a [2048, 5632] Q4_1 layer, Zen 4: 371 us at 1 row, 645 at 2, 1,024 at 4). Here
// a 512-bit register holds one dword of each of 16 output rows: one vpdpbusd adds 4 products
// to each, against 4 activation quants broadcast, so a block of 32 costs 8 vpdpbusd per
// activation row for 16 output rows, and the scales of 16 rows load as one vector.
//
// Q4 (chunk c of 64 bytes; byte 16 L + 8 h + 2 i + s holds row 4 L + i's elements e = 4 c + 2 h
// + 16 s, low nibble, and e + 1, high nibble): one vpshufb per chunk gathers each row's four
// bytes into its dword (lane L's dword i: bytes 2 i, 2 i + 1, 2 i + 8, 2 i + 9), whose low
// nibbles are elements (4 c, 4 c + 16, 4 c + 2, 4 c + 18) and high ones (4 c + 1, 4 c + 17, 4 c
// + 3, 4 c + 19); the activation quants are laid out once per call in that order (q4_copy_order,
// quant_rows16_q8_avx2.h, both kernels'), so dword 2 c of a block meets the low nibbles and dword
// 2 c + 1 the high ones. The nibbles go in unsigned (0 .. 15, Q4_0's too).
// Q8_0 (byte [j][r] = row r's qs[j]): 64 bytes hold elements 4 k .. 4 k + 3 of the 16 rows; a
// dword permute and a vpshufb transpose them to a dword a row (elements in order), xor 0x80
// makes them unsigned (q + 128), and the block's sum starts from -128 * sum(x quants) (xc).
//
// Numerics: per output row and block the exact integer sum s = sum(q x) (as every act_q8 kernel:
// nibbles x int8 at most 32 * 15 * 127, no saturation anywhere), then the many-row kernels'
// float steps (quant_vnni.h's q8_micro16, lane for lane): acc = fma(float(s), d_w * d_x, acc),
// then for Q4_0 / Q4_1 acc = fma(m_w, d_x * sum(x quants), acc) with Q4_0's m_w = -8 d_w (its
// nibbles uncentred), Q4_1's m. So a row's bits equal the many-row kernel's on the packed rows
// (tests), do not depend on the number of rows computed with it (a k-token verification
// computes what 1-row decode steps do), and prefill and decode round alike. They differ from
// the packed rows' few-row tiles, which sum 8 lanes of partial sums per row.

// Per 128-bit lane: dword i <- bytes 2 i, 2 i + 1, 2 i + 8, 2 i + 9 (a Q4 chunk's row 4 L + i)
static inline __m512i q4_row_dwords() {
  return _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
}

// out[m0 + t][16 g .. 16 g + 15] for group g and MT activation rows from m0; a.xq in the copy's
// order (Q4: avx2_rows16::q4_copy_order), a.xc Q8_0's start values.
// The software prefetch (prefetch_ahead) pays from 2 rows (Q8_0: 5), where each byte takes more
// arithmetic; below it the hardware prefetchers do better alone. Zen 4, weights from memory, us
// a layer without / with it: [2048, 5632] Q4_1 1 row 152 / 174, 2 rows 220 / 177, 8 rows 484 /
// 336; Q8_0 1 row 298 / 353, 4 rows 344 / 352, 8 rows 600 / 473 (BENCHMARKS section 63).
template <int TYPE, int MT>
static void rows16_q8_tile(const GemmQ8Args& a, const uint8_t* WI, int64_t g, int64_t m0) {
  const int64_t nb = a.K / 32, BB = rows16_block_bytes(TYPE), hdr = rows16_quants_at(TYPE), kd = a.K / 4;
  const __m512i m4 = _mm512_set1_epi8(15), rows = q4_row_dwords();
  const __m512i q8_dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i q8_bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  const int32_t* x = reinterpret_cast<const int32_t*>(a.xq) + m0 * kd;  // row t's block i: x + t kd + 8 i
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    if constexpr (MT >= (TYPE == T_Q8_0 ? 5 : 2)) prefetch_ahead(WI, g, nb, i, BB);
    const uint8_t* p = WI + (g * nb + i) * BB;
    const uint8_t* q = p + hdr;
    __m512i s0[MT], s1[MT];  // two chains a row (even / odd dwords), summed exactly at the end
    for (int t = 0; t < MT; ++t) {
      s0[t] = TYPE == T_Q8_0 ? _mm512_set1_epi32(a.xc[(m0 + t) * nb + i]) : _mm512_setzero_si512();
      s1[t] = _mm512_setzero_si512();
    }
    for (int64_t c = 0; c < 4; ++c) {
      __m512i w0, w1;
      if constexpr (TYPE == T_Q8_0) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        auto row_major = [&](int64_t k) {
          const __m512i v = _mm512_loadu_si512(q + 64 * k);
          return _mm512_xor_si512(_mm512_shuffle_epi8(_mm512_permutexvar_epi32(q8_dwords, v), q8_bytes), flip);
        };
        w0 = row_major(2 * c), w1 = row_major(2 * c + 1);
      } else {
        const __m512i v = _mm512_shuffle_epi8(_mm512_loadu_si512(q + 64 * c), rows);
        w0 = _mm512_and_si512(v, m4), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      }
      for (int t = 0; t < MT; ++t) {
        const int32_t* xb = x + t * kd + 8 * i + 2 * c;
        s0[t] = _mm512_dpbusd_epi32(s0[t], w0, _mm512_set1_epi32(xb[0]));
        s1[t] = _mm512_dpbusd_epi32(s1[t], w1, _mm512_set1_epi32(xb[1]));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 mn = TYPE == T_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)))
                                     : _mm512_mul_ps(d, _mm512_set1_ps(-8.f));  // (Q4_0's; exact)
    for (int t = 0; t < MT; ++t) {
      const int64_t r = (m0 + t) * nb + i;
      const __m512 sc = _mm512_mul_ps(d, _mm512_set1_ps(a.xd[r]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0[t], s1[t])), sc, acc[t]);
      if (TYPE != T_Q8_0) acc[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.xs[r]), acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16, acc[t]);
}

// 16 bytes at p (the 16 rows' 6-bit scales or mins) as floats
static inline __m512 u8x16_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Q4_K / Q5_K (per super-block: d, dmin, the sub-blocks' scales and mins a byte each, then each
// sub-block's quants as Q4_1's chunks, Q5_K's after its 8 fifth-bit masks): each sub-block of 32
// a Q4_1 / Q5_1 block as the integer kernels take it (kmin_sub_scales: scale d sc, min -dmin m,
// both exact in float), its quants 0 .. 15 (Q5_K: plus 16 where the mask's bit is set, before
// the gather) against the activations in q4_copy_order; per sub-block the many-row kernel's
// float steps, as for Q4_1. Prefetch as the other kernels' K-quant tiles (prefetch_sub_block),
// from 2 rows as above.
template <int TYPE, int MT>
static void rows16_q8_tile_k(const GemmQ8Args& a, const uint8_t* WI, int64_t g, int64_t m0) {
  constexpr bool five = TYPE == T_Q5_K;
  const int64_t ns = a.K / 256, nb = a.K / 32, BB = rows16_block_bytes(TYPE), kd = a.K / 4;
  const int64_t sub = five ? Q5K_SUB : Q4K_SUB, qat = five ? 64 : 0;  // a sub-block's bytes, its nibbles
  const __m512i m4 = _mm512_set1_epi8(15), rows = q4_row_dwords(), b16 = _mm512_set1_epi8(16);
  const int32_t* x = reinterpret_cast<const int32_t*>(a.xq) + m0 * kd;
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < ns; ++i) {
    const uint8_t* p = WI + (g * ns + i) * BB;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    for (int64_t sb = 0; sb < 8; ++sb) {
      if constexpr (MT >= 2) prefetch_sub_block(p, BB, 8, sb);
      const uint8_t* q = p + Q4K_HDR + sub * sb;
      const int64_t b = i * 8 + sb;  // the block of 32 along K
      __m512i s0[MT], s1[MT];
      for (int t = 0; t < MT; ++t) s0[t] = s1[t] = _mm512_setzero_si512();
      for (int64_t c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(q + qat + 64 * c);
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if constexpr (five) {
          uint64_t k[2];
          std::memcpy(k, q + 16 * c, 16);  // masks 2 c (low nibbles) and 2 c + 1 (high ones)
          lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(k[0]), lo, b16);
          hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(k[1]), hi, b16);
        }
        const __m512i w0 = _mm512_shuffle_epi8(lo, rows), w1 = _mm512_shuffle_epi8(hi, rows);
        for (int t = 0; t < MT; ++t) {
          const int32_t* xb = x + t * kd + 8 * b + 2 * c;
          s0[t] = _mm512_dpbusd_epi32(s0[t], w0, _mm512_set1_epi32(xb[0]));
          s1[t] = _mm512_dpbusd_epi32(s1[t], w1, _mm512_set1_epi32(xb[1]));
        }
      }
      const __m512 dw = _mm512_mul_ps(d, u8x16_ps(p + 64 + 16 * sb));
      const __m512 mn = _mm512_xor_ps(_mm512_mul_ps(dmin, u8x16_ps(p + 192 + 16 * sb)), _mm512_set1_ps(-0.f));
      for (int t = 0; t < MT; ++t) {
        const int64_t r = (m0 + t) * nb + b;
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0[t], s1[t])), _mm512_mul_ps(dw, _mm512_set1_ps(a.xd[r])), acc[t]);
        acc[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.xs[r]), acc[t]);
      }
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16, acc[t]);
}

// Groups g0 .. g1 of the copy WI (16 output rows each) for all a.M activation rows
static void gemm_rows16_q8(const GemmQ8Args& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  auto groups = [&](auto T) {
    for_each_tile(a.M, g0, g1, [&](auto MT, int64_t g, int64_t m0) {
      constexpr int TYPE = decltype(T)::value;
      if constexpr (TYPE == T_Q4_K || TYPE == T_Q5_K)
        rows16_q8_tile_k<TYPE, decltype(MT)::value>(a, WI, g, m0);
      else
        rows16_q8_tile<TYPE, decltype(MT)::value>(a, WI, g, m0);
    });
  };
  switch (a.type) {
    case T_Q4_0: return groups(std::integral_constant<int, T_Q4_0>{});
    case T_Q4_1: return groups(std::integral_constant<int, T_Q4_1>{});
    case T_Q4_K: return groups(std::integral_constant<int, T_Q4_K>{});
    case T_Q5_K: return groups(std::integral_constant<int, T_Q5_K>{});
    default: return groups(std::integral_constant<int, T_Q8_0>{});
  }
}
