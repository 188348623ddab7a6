// Q6_K's six-bit row-interleaved copy (quant_rows16_layout.h's Q6_K layout, six bits a quant: the packed
// blocks' size) on CPUs with AVX512-VBMI (Ice Lake, Zen 4, Sapphire Rapids and later; Skylake-SP,
// Cascade Lake and Cooper Lake have none and keep the byte layout): the run decoder, and the float
// kernel's tile (float32 engines); the bf16 kernel's tile is quant_rows16_q6k_vbmi_bf16.h. Included
// once by quant_kernels.cpp inside namespace avx512_vbmi within the VBMI target region. No
// include guard on purpose.
//
// A run of 24 bytes holds one element pair of 16 rows, row r's fields 2 r and 2 r + 1 (bits
// 12 r .. 12 r + 11). Decoding a run into 16 dwords (lane r: bf16(q[2 p] - 32) | bf16(q[2 p + 1]
// - 32) << 16, the words the byte layout's kernels build) takes three permutes after the load,
// no widening:
//   vpermb          the 3 bytes of rows 2 j, 2 j + 1 into qword j;
//   vpmultishiftqb  the low byte of word w of the qword gets the bits from 6 w (field w in bits
//                   0-5; the high bytes are not read);
//   vpermt2w        word v of a 64-word table (the low 6 bits of each word index it): bf16(v - 32).
// The tiles take them in the byte layout tiles' order: the same bits (tested against them), with
// 23% fewer bytes read. (Two vpermb lookups, low and high bytes, measured 4-8% slower at 4-8 rows
// on a Zen 4 in the bf16 tile.)

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
static inline __m512i six_bit_pair(const uint8_t* q, const SixBitTables& tb) {
  const __m256i bytes = LAST ? _mm256_maskz_loadu_epi8(0xFFFFFFu, q) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m512i src = _mm512_castsi256_si512(bytes);
  // the low byte of word w of every qword: the bits from 6 w (one qword, broadcast)
  const __m512i shifts = _mm512_set1_epi64(0x0012'000C'0006'0000ll);
  const __m512i f = _mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(tb.gather, src));
  return _mm512_permutex2var_epi16(tb.lo, f, tb.hi);  // a word's low 6 bits index
}

// The six-bit run p of a sub-block at q (the last one loaded under a mask: none past the copy)
static inline __m512i six_bit_run(const uint8_t* q, int64_t p, const SixBitTables& tb) {
  return p < 7 ? six_bit_pair<false>(q + 24 * p, tb) : six_bit_pair<true>(q + 24 * p, tb);
}

// quant_rows16.h's rows16_tile_k<T_Q6_K> (float activations) on the six-bit layout: a run's words
// widened to floats as the byte layout's int8 quants are (exact), in the same order
template <int MT>
static void rows16_tile_q6k_six(const GemmArgs& a, const uint8_t* WI, int64_t g, int64_t m0, const SixBitTables& tb) {
  using rows16_layout::Q6K_HDR, rows16_layout::Q6K_SUB6;
  const int64_t ns = a.K / 256, BB = Q6K_HDR + 16 * Q6K_SUB6;
  const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < ns; ++i) {
    const uint8_t* p = WI + (g * ns + i) * BB;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int64_t sb = 0; sb < 16; ++sb) {
      rows16_layout::prefetch_sub_block(p, BB, 16, sb);
      const uint8_t* q = p + Q6K_HDR + Q6K_SUB6 * sb;
      const float* x = a.X + m0 * a.K + i * 256 + sb * 16;
      __m512 lo[MT], hi[MT];
      for (int t = 0; t < MT; ++t) lo[t] = hi[t] = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int64_t pr = 0; pr < 8; ++pr) {
        const __m512i w = six_bit_run(q, pr, tb);
        const __m512 ql = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), qh = _mm512_castsi512_ps(_mm512_and_si512(w, top));
        avx512_rows16::fma_rows<MT>(ql, qh, x, a.K, 2 * pr, 2 * pr + 1, lo, hi);
      }
      const __m512 scale = avx512_rows16::q6k_scale(p, d, sb);
      for (int t = 0; t < MT; ++t) acc[t] = _mm512_fmadd_ps(_mm512_add_ps(lo[t], hi[t]), scale, acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16, acc[t]);
}

// Groups g0 .. g1 of every activation row, in the other kernels' tiles
static void gemm_rows16_q6k_six(const GemmArgs& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  const SixBitTables tb = six_bit_tables();
  rows16_layout::for_each_tile(a.M, g0, g1, [&](auto MT, int64_t g, int64_t m0) {
    rows16_tile_q6k_six<decltype(MT)::value>(a, WI, g, m0, tb);
  });
}
