// AVX2 products of act_q8 ("gguf_q8": int8 activations) on the row-interleaved copies of Q4_0 /
// Q4_1 / Q4_K / Q5_K weights and Q6_K's byte layout (quant_rows16_layout.h; Q6_K's own tile is
// rows16_q8_q6k, below): the CPUs without AVX512-VNNI, the AVX2
// level's counterpart of quant_rows16_vnni.h (its comment holds: one vpshufb a chunk gathers each
// row's four bytes of a Q4 chunk into its dword, the activation quants come in q4_copy_order, the
// K-quants' sub-blocks are Q4_1 / Q5_1 blocks). Included by quant_kernels.cpp inside namespace
// avx2_rows16 within the AVX2 target region, after quant_rows16_avx2.h (byte_mask, u8x8_ps,
// f16x8_ps), and once more for AVX-VNNI (namespace avx_vnni_rows16, QK_AVX_VNNI 1): there the Q4
// kernels' steps are one vpdpbusd each into 32-bit sums (quant_avx2_q8.h's dot_add, the same
// integers); Q6_K's tile keeps its 16-bit sums, scaled in vpmaddwd. No include guard on purpose.
//
// A group of 16 rows is two halves of 8 (the float kernel's, quant_rows16_avx2.h), a half one
// 256-bit register's dwords. vpmaddubsw (unsigned nibbles x signed quants, pairs summed in 16
// bits: at most 2 * 15 * 127, Q5_K's 2 * 31 * 127) stands for vpdpbusd; a block's 8 products
// are summed in 16 bits (at most 8 * 3,810; Q5_K's widened to 32 bits after each 4, 4 * 7,874)
// and then in 32 (vpmaddwd by ones): exact, the integer sums of every act_q8 kernel. The float
// steps are the many-row kernels', so a row's bits equal the AVX2 and VNNI many-row kernels' and
// quant_rows16_vnni.h's (tests). Tiles of up to 4 rows; 1-2 rows walk the group's blocks once for
// both halves, 3-4 once per half (the second walk finds the stream in L1 / L2), as the float one;
// Q5_K (two more registers a half and row) from 2 rows once per half. At 1 row its walk per half
// took 1.14-1.23x the packed rows' tile ([2048, 5632] 327 vs 291 us), both halves at once 0.77-0.85x.

#include "quant_dot_u8s8.h"  // dot_add, dot_widen, kVnni

// Blocks [b0, b1) of activation quants (32 each) into the copies' Q4 order: per block, for c < 4
// the bytes 4 c, 4 c + 16, 4 c + 2, 4 c + 18, 4 c + 1, 4 c + 17, 4 c + 3, 4 c + 19 (the order of
// a chunk's nibbles once gathered a row a dword: low nibbles, then high ones). Both kernels'.
static void q4_copy_order(const int8_t* xq, int64_t b0, int64_t b1, int8_t* out) {
  const __m128i pairs = _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
  for (int64_t b = b0; b < b1; ++b) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + b * 32));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + b * 32 + 16));
    // (x0, x16, x1, x17, ..): element pairs (e, e + 16), then pairs 0, 2, 1, 3 of each four
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + b * 32), _mm_shuffle_epi8(_mm_unpacklo_epi8(lo, hi), pairs));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + b * 32 + 16), _mm_shuffle_epi8(_mm_unpackhi_epi8(lo, hi), pairs));
  }
}

// -32 * sum of each 16-quant half of x's 32-quant blocks (Q6_K's start values: the VNNI many-row
// kernel's and both Q6_K copy kernels'): two per block, [M, K/16]. vpsadbw sums 8 bytes of x ^
// 0x80 (x + 128) a lane.
static void q8_half_corr(const int8_t* xq, int64_t b0, int64_t b1, int32_t* xc) {
  for (int64_t b = b0; b < b1; ++b) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
    const __m256i s = _mm256_sad_epu8(_mm256_xor_si256(x, _mm256_set1_epi8((char)0x80)), _mm256_setzero_si256());
    const __m128i lo = _mm256_castsi256_si128(s), hi = _mm256_extracti128_si256(s, 1);  // the halves' 2 x 8 bytes
    xc[2 * b] = -32 * (_mm_cvtsi128_si32(_mm_add_epi64(lo, _mm_unpackhi_epi64(lo, lo))) - 16 * 128);
    xc[2 * b + 1] = -32 * (_mm_cvtsi128_si32(_mm_add_epi64(hi, _mm_unpackhi_epi64(hi, hi))) - 16 * 128);
  }
}

// Halves H0 .. H0 + NH - 1 of group g for MT activation rows from m0
template <int TYPE, int MT, int H0, int NH>
static void rows16_q8_halves(const GemmQ8Args& a, const uint8_t* WI, int64_t g, int64_t m0) {
  constexpr bool kq = TYPE == T_Q4_K || TYPE == T_Q5_K, five = TYPE == T_Q5_K;
  const int64_t nb = a.K / 32, kd = a.K / 4, BB = rows16_block_bytes(TYPE);
  const int64_t sub = five ? Q5K_SUB : Q4K_SUB, qat = five ? 64 : kq ? 0 : rows16_quants_at(TYPE);
  const __m256i m4 = _mm256_set1_epi8(15), b16 = _mm256_set1_epi8(16);
  const __m256i rows = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
  const int32_t* x = reinterpret_cast<const int32_t*>(a.xq) + m0 * kd;
  __m256 acc[NH][MT];
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < MT; ++t) acc[h][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    // the block's header (the super-block's, K-quants) and its quants' first chunk
    const uint8_t* p = kq ? WI + (g * (nb / 8) + b / 8) * BB : WI + (g * nb + b) * BB;
    const uint8_t* q = kq ? p + Q4K_HDR + sub * (b % 8) : p;
    if (H0 == 0 && MT >= 2) {
      if constexpr (kq)
        prefetch_sub_block(p, BB, 8, b % 8);
      else
        prefetch_ahead(WI, g, nb, b, BB);
    }
    __m256i s[NH][MT], wide[NH][MT];  // 16-bit sums; Q5_K's first half in 32 bits
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < MT; ++t) s[h][t] = _mm256_setzero_si256();
    for (int64_t c = 0; c < 4; ++c) {
      for (int h = 0; h < NH; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + qat + 64 * c + 32 * (H0 + h)));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if constexpr (five) {  // masks 2 c and 2 c + 1, this half's 32 bits of each
          uint32_t k[2];
          std::memcpy(&k[0], q + 8 * (2 * c) + 4 * (H0 + h), 4);
          std::memcpy(&k[1], q + 8 * (2 * c + 1) + 4 * (H0 + h), 4);
          lo = _mm256_or_si256(lo, _mm256_and_si256(byte_mask(k[0]), b16));
          hi = _mm256_or_si256(hi, _mm256_and_si256(byte_mask(k[1]), b16));
        }
        const __m256i w0 = _mm256_shuffle_epi8(lo, rows), w1 = _mm256_shuffle_epi8(hi, rows);
        for (int t = 0; t < MT; ++t) {
          const int32_t* xb = x + t * kd + 8 * b + 2 * c;
          const __m256i x0 = _mm256_set1_epi32(xb[0]), x1 = _mm256_set1_epi32(xb[1]);
          if constexpr (kVnni)  // 32-bit sums (dot_add)
            s[h][t] = dot_add(dot_add(s[h][t], w0, x0), w1, x1);
          else
            s[h][t] = _mm256_add_epi16(s[h][t], _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1)));
        }
      }
      if (five && c == 1)
        for (int h = 0; h < NH; ++h)
          for (int t = 0; t < MT; ++t) {
            wide[h][t] = dot_widen(s[h][t]);
            s[h][t] = _mm256_setzero_si256();
          }
    }
    for (int h = 0; h < NH; ++h) {
      const int64_t H = H0 + h;
      __m256 dw, mn;
      if constexpr (kq) {
        const int64_t sb = b % 8;
        const __m256 d = f16x8_ps(p + 16 * H);
        const __m256 dmin = f16x8_ps(p + 32 + 16 * H);
        dw = _mm256_mul_ps(d, u8x8_ps(p + 64 + 16 * sb + 8 * H));
        mn = _mm256_xor_ps(_mm256_mul_ps(dmin, u8x8_ps(p + 192 + 16 * sb + 8 * H)), _mm256_set1_ps(-0.f));
      } else {
        dw = f16x8_ps(p + 16 * H);
        mn = TYPE == T_Q4_1 ? f16x8_ps(p + 32 + 16 * H)
                            : _mm256_mul_ps(dw, _mm256_set1_ps(-8.f));  // (Q4_0's; exact)
      }
      for (int t = 0; t < MT; ++t) {
        const int64_t r = (m0 + t) * nb + b;
        __m256i i32 = dot_widen(s[h][t]);
        if (five) i32 = _mm256_add_epi32(wide[h][t], i32);
        const __m256 sc = _mm256_mul_ps(dw, _mm256_broadcast_ss(a.xd + r));
        acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), sc, acc[h][t]);
        acc[h][t] = _mm256_fmadd_ps(mn, _mm256_broadcast_ss(a.xs + r), acc[h][t]);
      }
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < MT; ++t) _mm256_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16 + 8 * (H0 + h), acc[h][t]);
}

// Q6_K's byte layout (byte [e][r] = row r's quant - 32 per sub-block of 16; AVX2 CPUs have no
// six-bit copy): a step takes elements 4 s .. 4 s + 3 of the 16 rows (64 bytes) and transposes
// them to a dword a row, each half's 8 rows in one register (two 128-bit lane swaps for both
// halves, then per half an unpack, a qword permute and a vpshufb), + 32 makes them unsigned (0
// .. 63): vpmaddubsw pairs at most 2 * 63 * 127, two steps summed in 16 bits, then in 32. Each
// half block starts from -32 * sum(its x quants) (a.xc), is multiplied by its int8 scale, and the
// block's two halves summed exactly; then the many-row kernel's float steps. So the bits equal
// the VNNI many-row kernel's, and quant_rows16_q6k_vnni.h's.
template <int MT>
static void rows16_q8_q6k(const GemmQ8Args& a, const uint8_t* WI, int64_t g, int64_t m0) {
  constexpr int NH = 2;
  const int64_t ns = a.K / 256, nb = a.K / 32, kd = a.K / 4, BB = Q6K_HDR + 16 * Q6K_SUB;
  const __m256i ones = _mm256_set1_epi16(1), b32 = _mm256_set1_epi8(32);
  const __m256i rows = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
  const int32_t* x = reinterpret_cast<const int32_t*>(a.xq) + m0 * kd;
  __m256 acc[NH][MT];
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < MT; ++t) acc[h][t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < ns; ++i) {
    const uint8_t* p = WI + (g * ns + i) * BB;
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t b = i * 8 + j;  // the block of 32: sub-blocks 2 j and 2 j + 1
      if (MT >= 2) prefetch_sub_block(p, BB, 8, j);
      __m256i s32[NH][MT];  // the block's sum, its halves times their scales
      for (int64_t hb = 0; hb < 2; ++hb) {
        const uint8_t* q = p + Q6K_HDR + Q6K_SUB * (2 * j + hb);
        __m256i s16[NH][MT], wide[NH][MT];
        for (int h = 0; h < NH; ++h)
          for (int t = 0; t < MT; ++t) s16[h][t] = _mm256_setzero_si256();
        for (int64_t st = 0; st < 4; ++st) {
          const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * st));  // elements 4 st, + 1
          const __m256i r2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * st + 32));  // + 2, + 3
          const __m256i e02 = _mm256_add_epi8(_mm256_permute2x128_si256(r1, r2, 0x20), b32);
          const __m256i e13 = _mm256_add_epi8(_mm256_permute2x128_si256(r1, r2, 0x31), b32);
          for (int h = 0; h < NH; ++h) {  // rows 8 H .. 8 H + 7: (e0, e1 | e2, e3) pairs, then a dword a row
            const __m256i u = h == 0 ? _mm256_unpacklo_epi8(e02, e13) : _mm256_unpackhi_epi8(e02, e13);
            const __m256i w = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(u, 0xD8), rows);
            for (int t = 0; t < MT; ++t)
              s16[h][t] = _mm256_add_epi16(s16[h][t], _mm256_maddubs_epi16(w, _mm256_set1_epi32(x[t * kd + 8 * b + 4 * hb + st])));
          }
          if (st % 2 == 1)
            for (int h = 0; h < NH; ++h)
              for (int t = 0; t < MT; ++t) {
                const __m256i s = _mm256_madd_epi16(s16[h][t], ones);
                wide[h][t] = st == 1 ? s : _mm256_add_epi32(wide[h][t], s);
                s16[h][t] = _mm256_setzero_si256();
              }
        }
        for (int h = 0; h < NH; ++h) {
          const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 32 + 16 * (2 * j + hb) + 8 * h)));
          for (int t = 0; t < MT; ++t) {
            const __m256i centred = _mm256_add_epi32(wide[h][t], _mm256_set1_epi32(a.xc[((m0 + t) * nb + b) * 2 + hb]));
            const __m256i scaled = _mm256_mullo_epi32(centred, sc);
            s32[h][t] = hb == 0 ? scaled : _mm256_add_epi32(s32[h][t], scaled);
          }
        }
      }
      for (int h = 0; h < NH; ++h) {
        const __m256 d = f16x8_ps(p + 16 * h);
        for (int t = 0; t < MT; ++t) {
          const __m256 sc = _mm256_mul_ps(d, _mm256_broadcast_ss(a.xd + (m0 + t) * nb + b));
          acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[h][t]), sc, acc[h][t]);
        }
      }
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < MT; ++t) _mm256_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16 + 8 * h, acc[h][t]);
}

// Groups g0 .. g1 of the copy WI (16 output rows each) for all a.M activation rows (a.xq in
// q4_copy_order)
static void gemm_rows16_q8(const GemmQ8Args& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  auto groups = [&](auto T) {
    constexpr int TYPE = decltype(T)::value;
    for_each_tile<4>(a.M, g0, g1, [&](auto MT, int64_t g, int64_t m0) {
      constexpr int mt = decltype(MT)::value;
      if constexpr (TYPE == T_Q6_K) {
        rows16_q8_q6k<mt>(a, WI, g, m0);
      } else if constexpr (mt == 1 || (mt == 2 && TYPE != T_Q5_K)) {
        rows16_q8_halves<TYPE, mt, 0, 2>(a, WI, g, m0);
      } else {
        rows16_q8_halves<TYPE, mt, 0, 1>(a, WI, g, m0);
        rows16_q8_halves<TYPE, mt, 1, 1>(a, WI, g, m0);
      }
    });
  };
  switch (a.type) {
    case T_Q4_0: return groups(std::integral_constant<int, T_Q4_0>{});
    case T_Q4_1: return groups(std::integral_constant<int, T_Q4_1>{});
    case T_Q4_K: return groups(std::integral_constant<int, T_Q4_K>{});
    case T_Q6_K: return groups(std::integral_constant<int, T_Q6_K>{});
    default: return groups(std::integral_constant<int, T_Q5_K>{});
  }
}
