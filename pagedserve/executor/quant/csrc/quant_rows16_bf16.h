// AVX512-BF16 few-row products of bfloat16 models (decode at batch 1-8, speculative
// verification rows) on the row-interleaved copy of Q4_0 / Q4_1 / Q8_0 weights that
// quant_rows16.h reads (its layout comment holds: per group of 16 rows and block of 32, the 16
// rows' d, Q4_1's m, then byte [j][r] = row r's qs[j]). Included once by quant_kernels.cpp
// inside namespace avx512_bf16_rows16 within the AVX512-BF16 target region. No include guard on
// purpose.
//
// quant_rows16.h multiplies float activations by float quants, two FMAs of 16 lanes per row for
// each element pair (j, j + 16) of a block. Here the activations stay in the model's bf16 and
// one vdpbf16ps per row takes the pair at once: lane r holds row r's quants q[j], q[j + 16] as
// two bfloat16s (exact: |q| <= 128), the broadcast dword the activations x[j], x[j + 16]
// (pair_activations lays them out so). Q4 quants become bf16 through a 16-entry table
// (vpermw; Q4_0's minus 8 is in the table), Q8_0's through float. Half the multiply
// instructions per row and no activation widening: the many-row case that gains is the
// verification of k guesses (k + 1 rows), which costs less next to a 1-row step.
//
// Numerics, per output row and block: s_even, s_odd = vdpbf16ps chains over the pairs with j
// even / odd (each product exact in float32; the instruction's own rounding and denormal
// flushing), acc += (s_even + s_odd) * d, then acc += m * (sum of the block's activations, in
// float32, element order) for Q4_1. A row's bits do not depend on the number of rows or
// groups computed with it, so a k-token verification computes what 1-row decode steps do; they
// differ from the float kernel's (quant_rows16.h), which sums other products in another order.

struct Rows16Bf16Args {
  int type;
  int64_t K, M, ldo;
  const uint32_t* XP;  // [M, K / 2] activation pairs (pair_activations)
  const float* xsum;   // [M, K / 32] block sums of the activations (Q4_1 only)
  float* out;          // already offset by col0
};

// Rows [r0, r1) of X (bf16 [M, K]) -> XP: per block of 32, dword j = x[j] | x[j + 16] << 16
// (Q4_1's block sums: quant_bf16.h's group_sums)
static void pair_activations(const uint16_t* X, int64_t K, int64_t r0, int64_t r1, uint32_t* XP) {
  const __m512i perm = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                        21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int64_t nb = K / 32;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t i = 0; i < nb; ++i) {
      const uint16_t* x = X + r * K + i * 32;
      _mm512_storeu_si512(XP + r * (K / 2) + i * 16, _mm512_permutexvar_epi16(perm, _mm512_loadu_si512(x)));
    }
}

// Quants of element pair (j, j + 16) of 16 rows: lane r = bf16 q[j] | bf16 q[j + 16] << 16
template <int TYPE>
static inline __m512bh pair_quants(const uint8_t* q, int64_t j, __m512i table) {
  if (TYPE == T_Q8_0) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * 16))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (j + 16) * 16))));
    // small integers: their float's top half is their bf16, exactly
    return (__m512bh)_mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(lo), 16),
                                     _mm512_and_si512(_mm512_castps_si512(hi), _mm512_set1_epi32(int(0xFFFF0000u))));
  }
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * 16)));
  // low nibble -> word 0, high nibble -> word 1 of each lane, then the table's bf16 of each
  const __m512i idx = _mm512_and_si512(_mm512_or_si512(w, _mm512_slli_epi32(w, 12)), _mm512_set1_epi32(0x000F000F));
  return (__m512bh)_mm512_permutexvar_epi16(idx, table);
}

// bf16 bits of the 16 nibble values, words 0..15 (16..31 repeat them): Q4_1's 0 .. 15, Q4_0's
// 0 - 8 .. 15 - 8
alignas(64) static const uint16_t kNibbleBf16[2][32] = {
    {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120,
     0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0,
     0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170},
    {0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000,
     0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040,
     0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0},
};

// out[m0 + t][16 g .. 16 g + 15] for G groups from g0 and MT activation rows from m0
template <int TYPE, int G, int MT>
static void tile(const Rows16Bf16Args& a, const uint8_t* WI, int64_t g0, int64_t m0) {
  const int64_t nb = a.K / 32, BB = avx512_rows16::rows16_block_bytes(TYPE), hdr = TYPE == T_Q4_1 ? 64 : 32;
  const __m512i table = _mm512_load_si512(kNibbleBf16[TYPE == T_Q4_0]);  // (unused for Q8_0)
  __m512 acc[G][MT];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < MT; ++t) acc[g][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    avx512_rows16::prefetch_ahead<G>(WI, g0, nb, i, BB);  // the float kernel's, same distance
    __m512 s[2][G][MT];
    for (int e = 0; e < 2; ++e)
      for (int g = 0; g < G; ++g)
        for (int t = 0; t < MT; ++t) s[e][g][t] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int64_t j = 0; j < 16; ++j)
      for (int g = 0; g < G; ++g) {
        const __m512bh wq = pair_quants<TYPE>(WI + ((g0 + g) * nb + i) * BB + hdr, j, table);
        for (int t = 0; t < MT; ++t) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(a.XP[(m0 + t) * (a.K / 2) + i * 16 + j]));
          s[j & 1][g][t] = _mm512_dpbf16_ps(s[j & 1][g][t], wq, xv);
        }
      }
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = WI + ((g0 + g) * nb + i) * BB;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      for (int t = 0; t < MT; ++t) acc[g][t] = _mm512_fmadd_ps(_mm512_add_ps(s[0][g][t], s[1][g][t]), d, acc[g][t]);
      if (TYPE == T_Q4_1) {
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
        for (int t = 0; t < MT; ++t) acc[g][t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.xsum[(m0 + t) * nb + i]), acc[g][t]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < MT; ++t) _mm512_storeu_ps(a.out + (m0 + t) * a.ldo + (g0 + g) * 16, acc[g][t]);
}

// Groups g0 .. g1 of every activation row, in the float kernel's tiles
template <int TYPE>
static void groups(const Rows16Bf16Args& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  avx512_rows16::for_each_tile(a.M, g0, g1, [&](auto G, auto MT, int64_t g, int64_t m0) {
    tile<TYPE, decltype(G)::value, decltype(MT)::value>(a, WI, g, m0);
  });
}

static void gemm_rows16_bf16(const Rows16Bf16Args& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  switch (a.type) {
    case T_Q4_0: return groups<T_Q4_0>(a, WI, g0, g1);
    case T_Q4_1: return groups<T_Q4_1>(a, WI, g0, g1);
    default: return groups<T_Q8_0>(a, WI, g0, g1);
  }
}
