// AVX-512 few-row products (decode at batch 1-11, speculative verification rows) on a
// row-interleaved copy of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K (its byte layout)
// weights, float activations; the copies' layouts and numerics: quant_rows16_layout.h. Included
// once by quant_kernels.cpp inside namespace avx512_rows16 within the AVX-512 target region (the
// block structs, GemmArgs and the type codes are the file's, the layout's names come with
// `using namespace rows16_layout`). No include guard on purpose.

// The low and high bytes of the bfloat16 of each nibble value plus an offset, per 128-bit lane
// (vpshufb tables): Q4_1's 0 .. 15, Q4_0's 0 - 8 .. 15 - 8; Q5's two halves 0 .. 15 and 16 ..
// 31 (Q5_0: both minus 16)
struct Q4Tables {
  __m512i lo, hi;
};
static inline Q4Tables nibble_tables(int t) {
  const Q4Bytes& b = q4_bytes();
  return {_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(b.lo[t]))),
          _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(b.hi[t])))};
}
// a type's (lookup without the fifth bit, lookup with it): q4_table, q5_high_table
static inline Q4Tables q4_tables(int type) { return nibble_tables(q4_table(type)); }
static inline Q4Tables q5_high_tables(int type) { return nibble_tables(q5_high_table(type)); }

// Chunk c of a Q4 block's interleaved quants (64 bytes, v), its low (high = false) or high
// nibbles -> w[0], w[1]: for j = 4 c + high and j + 2, lane r = bfloat16 q[j] | bfloat16
// q[j + 16] << 16 of row r (exact)
static inline void q4_half(__m512i v, const Q4Tables& t, bool high, __m512i w[2]) {
  const __m512i m4 = _mm512_set1_epi8(15);
  const __m512i nib = _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, m4);
  const __m512i l = _mm512_shuffle_epi8(t.lo, nib), h = _mm512_shuffle_epi8(t.hi, nib);
  w[0] = _mm512_unpacklo_epi8(l, h);  // bytes 2 i + s of each lane: h = 0
  w[1] = _mm512_unpackhi_epi8(l, h);  // bytes 8 + 2 i + s: h = 1
}

// q4_half of a Q5 block: the nibbles whose fifth bit is set (mask k: bit b for the nibble in
// byte b) looked up in t16 instead of t
static inline void q5_half(__m512i v, const Q4Tables& t, const Q4Tables& t16, __mmask64 k, bool high, __m512i w[2]) {
  const __m512i m4 = _mm512_set1_epi8(15);
  const __m512i nib = _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, m4);
  const __m512i l = _mm512_mask_shuffle_epi8(_mm512_shuffle_epi8(t.lo, nib), k, t16.lo, nib);
  const __m512i h = _mm512_mask_shuffle_epi8(_mm512_shuffle_epi8(t.hi, nib), k, t16.hi, nib);
  w[0] = _mm512_unpacklo_epi8(l, h);
  w[1] = _mm512_unpackhi_epi8(l, h);
}

// Chunk c's Q5 masks (low nibbles', high nibbles') at `masks` (the copy's 8 words)
static inline __mmask64 q5_mask(const uint8_t* masks, int64_t c, int high) {
  uint64_t m;
  std::memcpy(&m, masks + 8 * (2 * c + high), 8);
  return _cvtu64_mask64(m);
}

// Chunk c's words from its low (high = false) or high nibbles, for both kernels' chunk loops:
// Q4's by the lookup alone, Q5's under the chunk's masks (the block's 8 words at `masks`)
struct Q4Half {
  Q4Tables t;
  void operator()(__m512i v, int64_t, bool high, __m512i w[2]) const { q4_half(v, t, high, w); }
};
struct Q5Half {
  Q4Tables t, t16;
  const uint8_t* masks;
  void operator()(__m512i v, int64_t c, bool high, __m512i w[2]) const {
    q5_half(v, t, t16, q5_mask(masks, c, high), high, w);
  }
};

// The whole chunk c -> w[jj], jj < 4: j = 4 c + jj
template <class Half>
static inline void chunk_words(const uint8_t* chunk, int64_t c, const Half& half, __m512i w[4]) {
  const __m512i v = _mm512_loadu_si512(chunk);
  __m512i a[2], b[2];
  half(v, c, false, a);
  half(v, c, true, b);
  w[0] = a[0], w[1] = b[0], w[2] = a[1], w[3] = b[1];
}

// Q8_0's quants of element pair (j, j + 16) of 16 rows as floats
static inline void q8_quants16(const uint8_t* q, int64_t j, __m512& lo, __m512& hi) {
  lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * 16))));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (j + 16) * 16))));
}

// lo[t] += ql * x[t K + jl], hi[t] += qh * x[t K + jh] for the MT activation rows at x (rows K
// apart): one element pair of 16 weight rows, the float kernel's two chains
template <int MT>
static inline void fma_rows(__m512 ql, __m512 qh, const float* x, int64_t K, int64_t jl, int64_t jh,
                            __m512 (&lo)[MT], __m512 (&hi)[MT]) {
  for (int t = 0; t < MT; ++t) {
    lo[t] = _mm512_fmadd_ps(ql, _mm512_set1_ps(x[t * K + jl]), lo[t]);
    hi[t] = _mm512_fmadd_ps(qh, _mm512_set1_ps(x[t * K + jh]), hi[t]);
  }
}

// lo[t] / hi[t] += the pairs (j, j + 16) of a block of 32 (its quants at q in Q4's 4 chunks, words
// by half) times activation row m0 + t's x[j] / x[j + 16] (x: the block's first element in row
// m0), j in order, as the sums' order is part of the numerics
template <int MT, class Half>
static inline void chunk_fmas(const float* x, int64_t K, const uint8_t* q, const Half& half, __m512 (&lo)[MT],
                              __m512 (&hi)[MT]) {
  const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int64_t c = 0; c < 4; ++c) {
    __m512i w[4];
    chunk_words(q + 64 * c, c, half, w);
    for (int64_t jj = 0; jj < 4; ++jj) {
      const int64_t j = 4 * c + jj;
      const __m512 ql = _mm512_castsi512_ps(_mm512_slli_epi32(w[jj], 16));  // a bf16 pair's halves
      const __m512 qh = _mm512_castsi512_ps(_mm512_and_si512(w[jj], top));  // widen exactly
      fma_rows<MT>(ql, qh, x, K, j, j + 16, lo, hi);
    }
  }
}

// out[m0 + t][16 g .. 16 g + 15] for group g and MT activation rows from m0
template <int TYPE, int MT>
static void rows16_tile(const GemmArgs& a, const uint8_t* WI, int64_t g, int64_t m0) {
  const int64_t nb = a.K / 32, BB = rows16_block_bytes(TYPE), hdr = rows16_quants_at(TYPE);
  const Q4Tables tb = q4_tables(TYPE), tb16 = q5_high_tables(TYPE);  // (unused for Q8_0; the second: Q5's)
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    prefetch_ahead(WI, g, nb, i, BB);
    const uint8_t* p = WI + (g * nb + i) * BB;
    const float* x = a.X + m0 * a.K + i * 32;
    __m512 lo[MT], hi[MT];
    for (int t = 0; t < MT; ++t) lo[t] = hi[t] = _mm512_setzero_ps();
    if constexpr (TYPE == T_Q8_0) {
      for (int64_t j = 0; j < 16; ++j) {
        __m512 ql, qh;
        q8_quants16(p + hdr, j, ql, qh);
        fma_rows<MT>(ql, qh, x, a.K, j, j + 16, lo, hi);
      }
    } else if constexpr (rows16_q5(TYPE)) {
      chunk_fmas<MT>(x, a.K, p + hdr, Q5Half{tb, tb16, p + rows16_scales_bytes(TYPE)}, lo, hi);
    } else {
      chunk_fmas<MT>(x, a.K, p + hdr, Q4Half{tb}, lo, hi);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int t = 0; t < MT; ++t) acc[t] = _mm512_fmadd_ps(_mm512_add_ps(lo[t], hi[t]), d, acc[t]);
    if (rows16_has_min(TYPE)) {
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
      for (int t = 0; t < MT; ++t) acc[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.xsum[(m0 + t) * nb + i]), acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16, acc[t]);
}

// 16 bytes at p as floats (unsigned: Q4_K's / Q5_K's scales and mins; signed: Q6_K's)
static inline __m512 u8x16_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline __m512 i8x16_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Q6_K's sub-block sb: the 16 rows' d * sc (exact in float32: 11 x 8 bits), d the super-block's
static inline __m512 q6k_scale(const uint8_t* p, __m512 d, int64_t sb) { return _mm512_mul_ps(d, i8x16_ps(p + 32 + 16 * sb)); }

// The K-quants' copies (the layouts above) on float activations: float32 engines on AVX-512 CPUs
// without AVX512-BF16 (Skylake-SP .. Ice Lake), where the bf16 kernel's tiles do not run. Per
// super-block d (and dmin), per sub-block the chains of rows16_tile and the packed kernels' w =
// d sc q - dmin m: acc += (lo + hi) * (d sc), acc -= (dmin m) * (the sub-block's activation sum)
// (Q4_K / Q5_K, sub-blocks of 32: Q4_1's / Q5_1's chunk loop); Q6_K (its byte layout only; the
// six-bit one is read by the bf16 kernel), sub-blocks of 16: lo over the pairs' first elements
// (2 p), hi over their second (2 p + 1), acc += (lo + hi) * (d sc). Prefetch: the bf16 tiles'.
template <int TYPE, int MT>
static void rows16_tile_k(const GemmArgs& a, const uint8_t* WI, int64_t g, int64_t m0) {
  constexpr bool q6k = TYPE == T_Q6_K;
  constexpr int64_t NSUB = q6k ? 16 : 8;
  const int64_t ns = a.K / 256, BB = rows16_block_bytes(TYPE), nb = a.K / 32;
  const int64_t sub = TYPE == T_Q4_K ? Q4K_SUB : TYPE == T_Q5_K ? Q5K_SUB : Q6K_SUB;
  const int64_t hdr = q6k ? Q6K_HDR : Q4K_HDR;
  const Q4Tables tb = q4_tables(T_Q4_1), tb16 = q5_high_tables(T_Q5_1);  // unsigned 0 .. 15, 16 .. 31
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < ns; ++i) {
    const uint8_t* p = WI + (g * ns + i) * BB;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int64_t sb = 0; sb < NSUB; ++sb) {
      prefetch_sub_block(p, BB, NSUB, sb);
      const uint8_t* q = p + hdr + sub * sb;
      __m512 lo[MT], hi[MT];
      for (int t = 0; t < MT; ++t) lo[t] = hi[t] = _mm512_setzero_ps();
      if constexpr (q6k) {
        const float* x = a.X + m0 * a.K + i * 256 + sb * 16;
        for (int64_t pr = 0; pr < 8; ++pr) {
          const __m512 ql = i8x16_ps(q + 32 * pr), qh = i8x16_ps(q + 32 * pr + 16);
          fma_rows<MT>(ql, qh, x, a.K, 2 * pr, 2 * pr + 1, lo, hi);
        }
        const __m512 scale = q6k_scale(p, d, sb);
        for (int t = 0; t < MT; ++t) acc[t] = _mm512_fmadd_ps(_mm512_add_ps(lo[t], hi[t]), scale, acc[t]);
      } else {
        const int64_t b = i * 8 + sb;  // the block of 32 along K
        const float* x = a.X + m0 * a.K + b * 32;
        if constexpr (TYPE == T_Q5_K)  // the sub-block's masks, then its nibbles
          chunk_fmas<MT>(x, a.K, q + 64, Q5Half{tb, tb16, q}, lo, hi);
        else
          chunk_fmas<MT>(x, a.K, q, Q4Half{tb}, lo, hi);
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
        const __m512 scale = _mm512_mul_ps(d, u8x16_ps(p + 64 + 16 * sb));
        const __m512 mn = _mm512_mul_ps(dmin, u8x16_ps(p + 192 + 16 * sb));
        for (int t = 0; t < MT; ++t) {
          acc[t] = _mm512_fmadd_ps(_mm512_add_ps(lo[t], hi[t]), scale, acc[t]);
          acc[t] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(a.xsum[(m0 + t) * nb + b]), acc[t]);
        }
      }
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16, acc[t]);
}

template <int TYPE>
static void rows16_groups(const GemmArgs& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  for_each_tile(a.M, g0, g1, [&](auto MT, int64_t g, int64_t m0) {
    if constexpr (TYPE == T_Q4_K || TYPE == T_Q5_K || TYPE == T_Q6_K)
      rows16_tile_k<TYPE, decltype(MT)::value>(a, WI, g, m0);
    else
      rows16_tile<TYPE, decltype(MT)::value>(a, WI, g, m0);
  });
}

static void gemm_rows16(const GemmArgs& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  with_rows16_type(a.type, [&](auto T) { rows16_groups<decltype(T)::value>(a, WI, g0, g1); });
}
