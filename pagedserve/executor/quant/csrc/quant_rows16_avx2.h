// AVX2 few-row products (decode at batch 1-11, speculative verification rows) on the
// row-interleaved copies (quant_rows16_layout.h) of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K /
// Q5_K weights and Q6_K's byte layout (its six-bit one needs AVX512-VBMI), float activations:
// the CPUs without AVX-512 (Zen 2 / Zen 3, Intel's client cores). Included once by
// quant_kernels.cpp inside namespace avx2_rows16 within the AVX2 target region (the block
// structs, GemmArgs and the type codes are the file's, the layout's names come with `using
// namespace rows16_layout`). No include guard on purpose.
//
// A group of 16 rows is two halves of 8, each one 256-bit register's dwords. A tile of 1-2
// rows walks the group's blocks once for both halves (an activation's broadcast serves both);
// one of 3-4 rows once per half (both at once spill), the second walk finding the stream in
// L1 / L2 (a half is 32 bytes of each 64-byte line; a group's stream is K / 32 blocks of 288-544
// bytes, the K-quants' K / 256 super-blocks of 2,368-4,384). Per half, the AVX-512 kernel's
// (quant_rows16.h) steps on 8 lanes instead of
// 16: the same nibble lookups (vpshufb works per 128-bit lane, and a lane's 4 dwords are 4 rows
// in both), Q5's fifth bits as a byte mask and a blend instead of a mask register, and per
// lane the same FMAs in the same order, so the same bits as the AVX-512 float kernel.
// Tiles of up to 4 activation rows: 3 chains a row (lo, hi, acc) and the lookup's constants
// fill the 16 registers.

constexpr int ROWS16_AVX2_MAXT = 4;

struct Tables {
  __m256i lo, hi;
};
static inline Tables nibble_tables(int t) {
  const Q4Bytes& b = q4_bytes();
  return {_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(b.lo[t]))),
          _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(b.hi[t])))};
}
// a type's (lookup without the fifth bit, lookup with it): q4_table, q5_high_table
static inline Tables q4_tables(int type) { return nibble_tables(q4_table(type)); }
static inline Tables q5_high_tables(int type) { return nibble_tables(q5_high_table(type)); }

// 0xFF in each byte b (0 .. 31) whose bit b of m is set
static inline __m256i byte_mask(uint32_t m) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bits = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int(m)), spread);  // byte b: m's byte b / 8
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bits), bits);
}

// Half H of chunk c (its 32 bytes, v), low (high = false) or high nibbles -> w[0], w[1]: for j =
// 4 c + high and j + 2, lane r = bfloat16 q[j] | bfloat16 q[j + 16] << 16 of row 8 H + r
struct Q4Half {
  Tables t;
  void operator()(__m256i v, int64_t, bool high, int64_t, __m256i w[2]) const {
    const __m256i nib = _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
    const __m256i l = _mm256_shuffle_epi8(t.lo, nib), h = _mm256_shuffle_epi8(t.hi, nib);
    w[0] = _mm256_unpacklo_epi8(l, h);
    w[1] = _mm256_unpackhi_epi8(l, h);
  }
};
// Q5: the nibbles whose fifth bit is set looked up in t16 (the chunk's masks: the block's 8
// words at `masks`, this half's 32 bits of each)
struct Q5Half {
  Tables t, t16;
  const uint8_t* masks;
  void operator()(__m256i v, int64_t c, bool high, int64_t H, __m256i w[2]) const {
    uint32_t m;
    std::memcpy(&m, masks + 8 * (2 * c + high) + 4 * H, 4);
    const __m256i k = byte_mask(m);
    const __m256i nib = _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
    const __m256i l = _mm256_blendv_epi8(_mm256_shuffle_epi8(t.lo, nib), _mm256_shuffle_epi8(t16.lo, nib), k);
    const __m256i h = _mm256_blendv_epi8(_mm256_shuffle_epi8(t.hi, nib), _mm256_shuffle_epi8(t16.hi, nib), k);
    w[0] = _mm256_unpacklo_epi8(l, h);
    w[1] = _mm256_unpackhi_epi8(l, h);
  }
};

// lo[h][t] += ql[h] * x[t K + jl], hi[h][t] += qh[h] * x[t K + jh] for NH halves (quant_rows16.h's
// fma_rows on 8 lanes; a broadcast serves every half)
template <int NH, int MT>
static inline void fma_rows(const __m256 (&ql)[NH], const __m256 (&qh)[NH], const float* x, int64_t K, int64_t jl,
                            int64_t jh, __m256 (&lo)[NH][MT], __m256 (&hi)[NH][MT]) {
  for (int t = 0; t < MT; ++t) {
    const __m256 xl = _mm256_set1_ps(x[t * K + jl]), xh = _mm256_set1_ps(x[t * K + jh]);
    for (int h = 0; h < NH; ++h) {
      lo[h][t] = _mm256_fmadd_ps(ql[h], xl, lo[h][t]);
      hi[h][t] = _mm256_fmadd_ps(qh[h], xh, hi[h][t]);
    }
  }
}

// A block of 32's pairs (j, j + 16) in Q4's 4 chunks at q, halves H0 .. H0 + NH - 1, j in order
// (quant_rows16.h's chunk_fmas); half(v, c, high, H, w)
template <int NH, int MT, class Half>
static inline void chunk_fmas(const float* x, int64_t K, const uint8_t* q, int64_t H0, const Half& half,
                              __m256 (&lo)[NH][MT], __m256 (&hi)[NH][MT]) {
  const __m256i top = _mm256_set1_epi32(int(0xFFFF0000u));
  for (int64_t c = 0; c < 4; ++c) {
    __m256i w[NH][4];
    for (int h = 0; h < NH; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c + 32 * (H0 + h)));
      __m256i a[2], b[2];
      half(v, c, false, H0 + h, a);
      half(v, c, true, H0 + h, b);
      w[h][0] = a[0], w[h][1] = b[0], w[h][2] = a[1], w[h][3] = b[1];
    }
    for (int64_t jj = 0; jj < 4; ++jj) {
      const int64_t j = 4 * c + jj;
      __m256 ql[NH], qh[NH];
      for (int h = 0; h < NH; ++h) {
        ql[h] = _mm256_castsi256_ps(_mm256_slli_epi32(w[h][jj], 16));
        qh[h] = _mm256_castsi256_ps(_mm256_and_si256(w[h][jj], top));
      }
      fma_rows<NH, MT>(ql, qh, x, K, j, j + 16, lo, hi);
    }
  }
}

// 8 bytes at p as floats (signed: Q8_0's / Q6_K's quants and Q6_K's scales; unsigned: the
// K-quants' scales and mins), 8 fp16 at p as floats
static inline __m256 i8x8_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline __m256 u8x8_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline __m256 f16x8_ps(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Halves a tile of MT rows computes in one walk: both for 1-2 rows (their broadcasts serve both;
// 6-12 chains), else one (1 row, Q4_1 [1536, 576]: 30 -> 23 us with both; 3 rows 39 -> 54 us)
template <int MT>
constexpr int halves_a_walk() { return MT <= 2 ? 2 : 1; }

// out[m0 + t][16 g .. 16 g + 15] for group g and MT activation rows from m0: Q4_0 / Q4_1 / Q5_0 /
// Q5_1 / Q8_0 (quant_rows16.h's rows16_tile), NH halves a walk
template <int TYPE, int MT>
static void rows16_tile(const GemmArgs& a, const uint8_t* WI, int64_t g, int64_t m0) {
  constexpr int NH = halves_a_walk<MT>();
  const int64_t nb = a.K / 32, BB = rows16_block_bytes(TYPE), hdr = rows16_quants_at(TYPE);
  const Tables tb = q4_tables(TYPE), tb16 = q5_high_tables(TYPE);  // (unused for Q8_0; the second: Q5's)
  for (int64_t H0 = 0; H0 < 2; H0 += NH) {
    __m256 acc[NH][MT];
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < MT; ++t) acc[h][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i) {
      if (H0 == 0) prefetch_ahead(WI, g, nb, i, BB);
      const uint8_t* p = WI + (g * nb + i) * BB;
      const float* x = a.X + m0 * a.K + i * 32;
      __m256 lo[NH][MT], hi[NH][MT];
      for (int h = 0; h < NH; ++h)
        for (int t = 0; t < MT; ++t) lo[h][t] = hi[h][t] = _mm256_setzero_ps();
      if constexpr (TYPE == T_Q8_0) {
        for (int64_t j = 0; j < 16; ++j) {
          __m256 ql[NH], qh[NH];
          for (int h = 0; h < NH; ++h) {
            ql[h] = i8x8_ps(p + hdr + j * 16 + 8 * (H0 + h));
            qh[h] = i8x8_ps(p + hdr + (j + 16) * 16 + 8 * (H0 + h));
          }
          fma_rows<NH, MT>(ql, qh, x, a.K, j, j + 16, lo, hi);
        }
      } else if constexpr (rows16_q5(TYPE)) {
        chunk_fmas<NH, MT>(x, a.K, p + hdr, H0, Q5Half{tb, tb16, p + rows16_scales_bytes(TYPE)}, lo, hi);
      } else {
        chunk_fmas<NH, MT>(x, a.K, p + hdr, H0, Q4Half{tb}, lo, hi);
      }
      for (int h = 0; h < NH; ++h) {
        const __m256 d = f16x8_ps(p + 16 * (H0 + h));
        for (int t = 0; t < MT; ++t) acc[h][t] = _mm256_fmadd_ps(_mm256_add_ps(lo[h][t], hi[h][t]), d, acc[h][t]);
        if (rows16_has_min(TYPE)) {
          const __m256 mn = f16x8_ps(p + 32 + 16 * (H0 + h));
          for (int t = 0; t < MT; ++t)
            acc[h][t] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.xsum[(m0 + t) * nb + i]), acc[h][t]);
        }
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < MT; ++t) _mm256_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16 + 8 * (H0 + h), acc[h][t]);
  }
}

// The K-quants (quant_rows16.h's rows16_tile_k, NH halves a walk): Q4_K / Q5_K per sub-block of
// 32 acc += (lo + hi) * (d sc) - (dmin m) * (the sub-block's activation sum); Q6_K (byte layout)
// per sub-block of 16, lo over the pairs' first elements, hi over their second, acc += (lo + hi) * (d sc)
template <int TYPE, int MT>
static void rows16_tile_k(const GemmArgs& a, const uint8_t* WI, int64_t g, int64_t m0) {
  constexpr int NH = halves_a_walk<MT>();
  constexpr bool q6k = TYPE == T_Q6_K;
  constexpr int64_t NSUB = q6k ? 16 : 8;
  const int64_t ns = a.K / 256, BB = rows16_block_bytes(TYPE), nb = a.K / 32;
  const int64_t sub = TYPE == T_Q4_K ? Q4K_SUB : TYPE == T_Q5_K ? Q5K_SUB : Q6K_SUB;
  const int64_t hdr = q6k ? Q6K_HDR : Q4K_HDR;
  const Tables tb = q4_tables(T_Q4_1), tb16 = q5_high_tables(T_Q5_1);  // unsigned 0 .. 15, 16 .. 31
  for (int64_t H0 = 0; H0 < 2; H0 += NH) {
    __m256 acc[NH][MT];
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < MT; ++t) acc[h][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < ns; ++i) {
      const uint8_t* p = WI + (g * ns + i) * BB;
      __m256 d[NH], dmin[NH];  // the super-block's, per half (Q6_K: no dmin)
      for (int h = 0; h < NH; ++h) {
        d[h] = f16x8_ps(p + 16 * (H0 + h));
        dmin[h] = q6k ? d[h] : f16x8_ps(p + 32 + 16 * (H0 + h));
      }
      for (int64_t sb = 0; sb < NSUB; ++sb) {
        if (H0 == 0) prefetch_sub_block(p, BB, NSUB, sb);
        const uint8_t* q = p + hdr + sub * sb;
        __m256 lo[NH][MT], hi[NH][MT];
        for (int h = 0; h < NH; ++h)
          for (int t = 0; t < MT; ++t) lo[h][t] = hi[h][t] = _mm256_setzero_ps();
        if constexpr (q6k) {
          const float* x = a.X + m0 * a.K + i * 256 + sb * 16;
          for (int64_t pr = 0; pr < 8; ++pr) {
            __m256 ql[NH], qh[NH];
            for (int h = 0; h < NH; ++h) {
              ql[h] = i8x8_ps(q + 32 * pr + 8 * (H0 + h));
              qh[h] = i8x8_ps(q + 32 * pr + 16 + 8 * (H0 + h));
            }
            fma_rows<NH, MT>(ql, qh, x, a.K, 2 * pr, 2 * pr + 1, lo, hi);
          }
          for (int h = 0; h < NH; ++h) {
            const __m256 scale = _mm256_mul_ps(d[h], i8x8_ps(p + 32 + 16 * sb + 8 * (H0 + h)));
            for (int t = 0; t < MT; ++t)
              acc[h][t] = _mm256_fmadd_ps(_mm256_add_ps(lo[h][t], hi[h][t]), scale, acc[h][t]);
          }
        } else {
          const int64_t b = i * 8 + sb;  // the block of 32 along K
          const float* x = a.X + m0 * a.K + b * 32;
          if constexpr (TYPE == T_Q5_K)  // the sub-block's masks, then its nibbles
            chunk_fmas<NH, MT>(x, a.K, q + 64, H0, Q5Half{tb, tb16, q}, lo, hi);
          else
            chunk_fmas<NH, MT>(x, a.K, q, H0, Q4Half{tb}, lo, hi);
          for (int h = 0; h < NH; ++h) {
            const int64_t row = 8 * (H0 + h);  // this half's first row
            const __m256 scale = _mm256_mul_ps(d[h], u8x8_ps(p + 64 + 16 * sb + row));
            const __m256 mn = _mm256_mul_ps(dmin[h], u8x8_ps(p + 192 + 16 * sb + row));
            for (int t = 0; t < MT; ++t) {
              acc[h][t] = _mm256_fmadd_ps(_mm256_add_ps(lo[h][t], hi[h][t]), scale, acc[h][t]);
              acc[h][t] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(a.xsum[(m0 + t) * nb + b]), acc[h][t]);
            }
          }
        }
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < MT; ++t) _mm256_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16 + 8 * (H0 + h), acc[h][t]);
  }
}

// Group by group, every row tile of it in turn (the later tiles find the group in L1 / L2)
template <int TYPE>
static void rows16_groups(const GemmArgs& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g)
    for_each_tile<ROWS16_AVX2_MAXT>(a.M, g, g + 1, [&](auto MT, int64_t g, int64_t m0) {
      if constexpr (TYPE == T_Q4_K || TYPE == T_Q5_K || TYPE == T_Q6_K)
        rows16_tile_k<TYPE, decltype(MT)::value>(a, WI, g, m0);
      else
        rows16_tile<TYPE, decltype(MT)::value>(a, WI, g, m0);
    });
}

// Groups g0 .. g1 of a copy in the byte layouts (not Q6_K's six bits)
static void gemm_rows16(const GemmArgs& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  with_rows16_type(a.type, [&](auto T) { rows16_groups<decltype(T)::value>(a, WI, g0, g1); });
}
