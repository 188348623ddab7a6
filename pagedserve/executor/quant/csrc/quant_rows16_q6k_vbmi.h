// Few-row products of bf16 models on Q6_K's six-bit row-interleaved copy (quant_rows16.h's
// Q6_K layout, six bits a quant: the packed blocks' size), on CPUs with AVX512-VBMI beside
// AVX512-BF16 (Zen 4, Sapphire Rapids and later; Cooper Lake has no VBMI and keeps the byte
// layout, quant_rows16_bf16.h's tile_q6k). Included once by quant_kernels.cpp inside namespace
// avx512_bf16_vbmi within the VBMI target region. No include guard on purpose.
//
// A run of 24 bytes holds one element pair of 16 rows, row r's fields 2 r and 2 r + 1 (bits
// 12 r .. 12 r + 11). Decoding a run into the 16 dwords vdpbf16ps takes (lane r: bf16(q[2 p] -
// 32) | bf16(q[2 p + 1] - 32) << 16), three permutes after the load, no widening:
//   vpermb          the 3 bytes of rows 2 j, 2 j + 1 into qword j;
//   vpmultishiftqb  the low byte of word w of the qword gets the bits from 6 w (field w in bits
//                   0-5; the high bytes are not read);
//   vpermt2w        word v of a 64-word table (the low 6 bits of each word index it): bf16(v - 32).
// These are the words i8_pair_quants builds from the byte layout, taken in the same order by the
// same chains: the same bits as tile_q6k (tested against it), with 23% fewer bytes read. (Two
// vpermb lookups, low and high bytes, measured 4-8% slower at 4-8 rows on a Zen 4.)

struct SixBitTables {
  __m512i gather;  // qword j's bytes 0-2 = the run's bytes 3 j .. 3 j + 2
  __m512i lo, hi;  // word v: bf16(v - 32), v = 0 .. 31 and 32 .. 63
};

static inline SixBitTables six_bit_tables() {
  alignas(64) uint8_t gather[64];
  alignas(64) uint16_t words[64];
  for (int b = 0; b < 64; ++b) {
    const int j = b / 8, k = b % 8;
    gather[b] = uint8_t(k < 3 ? 3 * j + k : 0);
    const float f = float(b - 32);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    words[b] = uint16_t(u >> 16);  // exact: a small integer
  }
  return {_mm512_load_si512(gather), _mm512_load_si512(words), _mm512_load_si512(words + 32)};
}

// The pair's dwords from the run's 24 bytes at q (LAST: a masked load, none past the copy's end;
// else 32 bytes, the next run's first 8 unused)
template <bool LAST>
static inline __m512bh six_bit_pair(const uint8_t* q, const SixBitTables& tb) {
  const __m256i bytes = LAST ? _mm256_maskz_loadu_epi8(0xFFFFFFu, q) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m512i src = _mm512_castsi256_si512(bytes);
  // the low byte of word w of every qword: the bits from 6 w (one qword, broadcast)
  const __m512i shifts = _mm512_set1_epi64(0x0012'000C'0006'0000ll);
  const __m512i f = _mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(tb.gather, src));
  return (__m512bh)_mm512_permutex2var_epi16(tb.lo, f, tb.hi);  // a word's low 6 bits index
}

// tile_q6k on the six-bit layout: per sub-block of 16 elements its 8 runs, pair p into chain
// p & 1, then acc += (s_even + s_odd) * (d sc)
template <int MT>
static void tile_q6k_six(const avx512_bf16_rows16::Rows16Bf16Args& a, const uint8_t* WI, int64_t g, int64_t m0,
                         const SixBitTables& tb) {
  using avx512_rows16::Q6K_HDR, avx512_rows16::Q6K_SUB6;
  const int64_t ns = a.K / 256, BB = Q6K_HDR + 16 * Q6K_SUB6;
  constexpr int64_t AHEAD = 8 * 320;
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < ns; ++i) {
    const uint8_t* p = WI + (g * ns + i) * BB;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int64_t sb = 0; sb < 16; ++sb) {
      const char* pf = reinterpret_cast<const char*>(p + sb * (BB / 16) + AHEAD);
      for (int64_t c = 0; c < 256; c += 64) _mm_prefetch(pf + c, _MM_HINT_T0);
      const __m512 scale = _mm512_mul_ps(
          d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * sb)))));
      __m512 s[2][MT];
      for (int e = 0; e < 2; ++e)
        for (int t = 0; t < MT; ++t) s[e][t] = _mm512_setzero_ps();
      const uint8_t* q = p + Q6K_HDR + Q6K_SUB6 * sb;
      const uint32_t* x = a.X2 + (i * 256 + sb * 16) / 2;
#pragma GCC unroll 8
      for (int64_t pr = 0; pr < 8; ++pr) {
        const __m512bh wq = pr < 7 ? six_bit_pair<false>(q + 24 * pr, tb) : six_bit_pair<true>(q + 24 * pr, tb);
        for (int t = 0; t < MT; ++t)
          s[pr & 1][t] = avx512_bf16_rows16::dp_bcast(s[pr & 1][t], wq, x + (m0 + t) * (a.K / 2) + pr);
      }
      for (int t = 0; t < MT; ++t) acc[t] = _mm512_fmadd_ps(_mm512_add_ps(s[0][t], s[1][t]), scale, acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16, acc[t]);
}

// Groups g0 .. g1 of every activation row, in the other kernels' tiles
static void gemm_q6k_six(const avx512_bf16_rows16::Rows16Bf16Args& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  const SixBitTables tb = six_bit_tables();
  avx512_rows16::for_each_tile(a.M, g0, g1, [&](auto MT, int64_t g, int64_t m0) {
    tile_q6k_six<decltype(MT)::value>(a, WI, g, m0, tb);
  });
}
