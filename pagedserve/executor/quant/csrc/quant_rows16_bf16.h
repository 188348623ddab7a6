// AVX512-BF16 few-row products of bfloat16 models (decode at batch 1-8, speculative
// verification rows) on the row-interleaved copy of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights that
// quant_rows16_layout.h writes (its layout comment holds: per group of 16 rows and block of 32, the 16
// rows' d, Q4_1's m, then the quants: Q4's in chunks of four element pairs, Q8_0's byte [j][r] =
// row r's qs[j]; Q4_K per super-block of 256: d, dmin, the sub-blocks' scales and mins, then
// each sub-block's quants as Q4_1's (Q5_K's as Q5_1's, with its fifth bits' masks); Q6_K's
// quants a byte each per sub-block of 16 where the CPU has no AVX512-VBMI, else six bits, read by
// quant_rows16_q6k_vbmi.h). Included once by quant_kernels.cpp inside namespace
// avx512_bf16_rows16 within the AVX512-BF16 target region. No include guard on purpose.
//
// quant_rows16.h multiplies float activations by float quants, two FMAs of 16 lanes per row for
// each element pair (j, j + 16) of a block. Here the activations stay in the model's bf16 and
// one vdpbf16ps per row takes the pair at once: lane r holds row r's quants q[j], q[j + 16] as
// two bfloat16s (exact: |q| <= 128), the broadcast dword the activations x[j], x[j + 16]
// (pair_activations lays them out so). Q4 quants become bf16 through the copy's chunk layout:
// one 64-byte load, its nibbles looked up as bf16 bytes (vpshufb) and interleaved, gives four
// element pairs of 16 rows (avx512_rows16::chunk_words); Q8_0's through float. Half the multiply
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
  const uint32_t* XP;  // [M, K / 2] activation pairs (pair_activations; not for Q6_K)
  const uint32_t* X2;  // [M, K / 2] the activations as they are: pairs x[2 p], x[2 p + 1] (Q6_K)
  const float* xsum;   // [M, K / 32] block sums of the activations (Q4_1, Q5_1, Q4_K, Q5_K)
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

// Two int8 elements of 16 rows (16 bytes each, row r at byte r): lane r = bf16 lo[r] | bf16 hi[r] << 16
static inline __m512bh i8_pair_quants(const uint8_t* lo8, const uint8_t* hi8) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo8))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi8))));
  // small integers: their float's top half is their bf16, exactly
  return (__m512bh)_mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(lo), 16),
                                   _mm512_and_si512(_mm512_castps_si512(hi), _mm512_set1_epi32(int(0xFFFF0000u))));
}

// acc += the pairs of w times the pair *x in every lane: vdpbf16ps with an embedded broadcast
// (one instruction; the intrinsics' _mm512_set1_epi32 from memory compiles to a vpbroadcastd
// before it). The same products in the same order. Zen 4, Q4_1 [1536, 576] and [576, 1536],
// builds alternating: 3-8 rows 5-14% faster (7 rows, hot: 53.1 -> 49.4 and 69.8 -> 60.9 us a
// layer), 1-2 rows unchanged (BENCHMARKS section 48).
static inline __m512 dp_bcast(__m512 acc, __m512bh w, const uint32_t* x) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

// s[e][t] += pair j of block i's 32 elements in activation row m0 + t, for each chunk of Q4
// quants at q (quant_rows16_layout.h's chunk layout): the low nibbles' pairs (j = 4 c, 4 c + 2: chain
// 0), then the high ones' (chain 1), a chain taking its pairs in j order; half the words live at
// a time, so 8 rows' chains stay in registers. half(v, c, high, w): chunk c's words
// (avx512_rows16::Q4Half, or Q5Half under the chunk's masks).
template <int MT, class Half>
static inline void chunk_pairs(const Rows16Bf16Args& a, const uint8_t* q, const Half& half, int64_t m0, int64_t i,
                               __m512 (&s)[2][MT]) {
  auto dot_pair = [&](int64_t j, __m512bh wq, __m512* se) {
    for (int t = 0; t < MT; ++t) se[t] = dp_bcast(se[t], wq, a.XP + (m0 + t) * (a.K / 2) + i * 16 + j);
  };
#pragma GCC unroll 4
  for (int64_t c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(q + 64 * c);
    __m512i w[2];
    half(v, c, false, w);
    dot_pair(4 * c, (__m512bh)w[0], s[0]);
    dot_pair(4 * c + 2, (__m512bh)w[1], s[0]);
    half(v, c, true, w);
    dot_pair(4 * c + 1, (__m512bh)w[0], s[1]);
    dot_pair(4 * c + 3, (__m512bh)w[1], s[1]);
  }
}

// s[p & 1][t] += pair p < NP of 16 rows' int8 quants at q ([element][row], exact in bf16: pair
// p's elements at q + STEP p and HI bytes further) against activation row m0 + t's dword p from x
// (rows K / 2 dwords apart): two chains, p even / odd. Q8_0: its (j, j + 16) pairs against
// pair_activations' dwords; Q6_K: its (2 p, 2 p + 1) pairs against the activations' own.
template <int MT, int NP, int STEP, int HI>
static inline void i8_pairs(const Rows16Bf16Args& a, const uint8_t* q, const uint32_t* x, int64_t m0,
                            __m512 (&s)[2][MT]) {
#pragma GCC unroll 16
  for (int64_t pr = 0; pr < NP; ++pr) {
    const __m512bh wq = i8_pair_quants(q + STEP * pr, q + STEP * pr + HI);
    for (int t = 0; t < MT; ++t) s[pr & 1][t] = dp_bcast(s[pr & 1][t], wq, x + (m0 + t) * (a.K / 2) + pr);
  }
}

// out[m0 + t][16 g .. 16 g + 15] for group g and MT activation rows from m0 (one stream, as
// quant_rows16.h's tiles)
template <int TYPE, int MT>
static void tile(const Rows16Bf16Args& a, const uint8_t* WI, int64_t g, int64_t m0) {
  const int64_t nb = a.K / 32, BB = rows16_layout::rows16_block_bytes(TYPE), hdr = rows16_layout::rows16_quants_at(TYPE);
  const avx512_rows16::Q4Tables tb = avx512_rows16::q4_tables(TYPE);        // (unused for Q8_0)
  const avx512_rows16::Q4Tables tb16 = avx512_rows16::q5_high_tables(TYPE);  // Q5's fifth bits
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    rows16_layout::prefetch_ahead(WI, g, nb, i, BB);  // the float kernel's, same distance
    const uint8_t* p = WI + (g * nb + i) * BB;
    __m512 s[2][MT];
    for (int e = 0; e < 2; ++e)
      for (int t = 0; t < MT; ++t) s[e][t] = _mm512_setzero_ps();
    if constexpr (TYPE == T_Q8_0)
      i8_pairs<MT, 16, 16, 256>(a, p + hdr, a.XP + i * 16, m0, s);
    else if constexpr (rows16_layout::rows16_q5(TYPE))
      chunk_pairs<MT>(a, p + hdr, avx512_rows16::Q5Half{tb, tb16, p + rows16_layout::rows16_scales_bytes(TYPE)}, m0, i, s);
    else
      chunk_pairs<MT>(a, p + hdr, avx512_rows16::Q4Half{tb}, m0, i, s);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int t = 0; t < MT; ++t) acc[t] = _mm512_fmadd_ps(_mm512_add_ps(s[0][t], s[1][t]), d, acc[t]);
    if (rows16_layout::rows16_has_min(TYPE)) {
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
      for (int t = 0; t < MT; ++t) acc[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.xsum[(m0 + t) * nb + i]), acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16, acc[t]);
}

// Q4_K's and Q5_K's tile (quant_rows16_layout.h's layouts): per super-block d and dmin, then per
// sub-block of 32 its pairs' sums (Q4_K: Q4_1's chunk loop on its nibbles; Q5_K: Q5_1's, the
// nibbles looked up by the fifth bits' masks: quants 0 .. 31) and Q4_1's arithmetic with d = d * sc and m = -dmin * m, both exact in
// float32 (11 x 6 bits): acc += (s_even + s_odd) * (d sc), then acc -= (dmin m) * (the sub-block's
// activation sum), the packed kernels' w = d sc q - dmin m. Prefetch: a fixed distance ahead in
// the group's stream, the lines of an eighth of a super-block each sub-block.
template <int TYPE, int MT>
static void tile_k_min(const Rows16Bf16Args& a, const uint8_t* WI, int64_t g, int64_t m0) {
  const int64_t nb = a.K / 32, ns = a.K / 256, BB = rows16_layout::rows16_block_bytes(TYPE);
  const int64_t sub = TYPE == T_Q4_K ? rows16_layout::Q4K_SUB : rows16_layout::Q5K_SUB;
  const avx512_rows16::Q4Tables tb = avx512_rows16::q4_tables(T_Q4_1);         // unsigned nibbles 0 .. 15
  const avx512_rows16::Q4Tables tb16 = avx512_rows16::q5_high_tables(T_Q5_1);  // Q5_K's 16 .. 31
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < ns; ++i) {
    const uint8_t* p = WI + (g * ns + i) * BB;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    for (int64_t sb = 0; sb < 8; ++sb) {
      rows16_layout::prefetch_sub_block(p, BB, 8, sb);
      const int64_t b = i * 8 + sb;  // the block of 32 along K
      auto bytes16 = [&](int64_t off) {
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + off))));
      };
      const __m512 scale = _mm512_mul_ps(d, bytes16(64 + 16 * sb)), mn = _mm512_mul_ps(dmin, bytes16(192 + 16 * sb));
      __m512 s[2][MT];
      for (int e = 0; e < 2; ++e)
        for (int t = 0; t < MT; ++t) s[e][t] = _mm512_setzero_ps();
      const uint8_t* q = p + rows16_layout::Q4K_HDR + sub * sb;
      if constexpr (TYPE == T_Q4_K)
        chunk_pairs<MT>(a, q, avx512_rows16::Q4Half{tb}, m0, b, s);
      else  // the sub-block's masks, then its nibbles
        chunk_pairs<MT>(a, q + 64, avx512_rows16::Q5Half{tb, tb16, q}, m0, b, s);
      for (int t = 0; t < MT; ++t) {
        acc[t] = _mm512_fmadd_ps(_mm512_add_ps(s[0][t], s[1][t]), scale, acc[t]);
        acc[t] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(a.xsum[(m0 + t) * nb + b]), acc[t]);
      }
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16, acc[t]);
}

// Q6_K's tile (quant_rows16_layout.h's Q6_K layout): per sub-block of 16 elements, i8_pairs over its
// quants (q - 32), then acc += (s_even + s_odd) * (d * sc), d * sc exact in float32 (11 x 8
// bits): the packed kernels' w = d sc (q - 32).
template <int MT>
static void tile_q6k(const Rows16Bf16Args& a, const uint8_t* WI, int64_t g, int64_t m0) {
  const int64_t ns = a.K / 256, BB = rows16_layout::rows16_block_bytes(T_Q6_K);
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < ns; ++i) {
    const uint8_t* p = WI + (g * ns + i) * BB;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int64_t sb = 0; sb < 16; ++sb) {
      rows16_layout::prefetch_sub_block(p, BB, 16, sb);
      const __m512 scale = avx512_rows16::q6k_scale(p, d, sb);
      __m512 s[2][MT];
      for (int e = 0; e < 2; ++e)
        for (int t = 0; t < MT; ++t) s[e][t] = _mm512_setzero_ps();
      i8_pairs<MT, 8, 32, 16>(a, p + rows16_layout::Q6K_HDR + rows16_layout::Q6K_SUB * sb, a.X2 + (i * 256 + sb * 16) / 2, m0, s);
      for (int t = 0; t < MT; ++t) acc[t] = _mm512_fmadd_ps(_mm512_add_ps(s[0][t], s[1][t]), scale, acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16, acc[t]);
}

// Groups g0 .. g1 of every activation row, in the float kernel's tiles
template <int TYPE>
static void groups(const Rows16Bf16Args& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  rows16_layout::for_each_tile(a.M, g0, g1, [&](auto MT, int64_t g, int64_t m0) {
    if constexpr (TYPE == T_Q4_K || TYPE == T_Q5_K)
      tile_k_min<TYPE, decltype(MT)::value>(a, WI, g, m0);
    else if constexpr (TYPE == T_Q6_K)
      tile_q6k<decltype(MT)::value>(a, WI, g, m0);
    else
      tile<TYPE, decltype(MT)::value>(a, WI, g, m0);
  });
}

static void gemm_rows16_bf16(const Rows16Bf16Args& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  rows16_layout::with_rows16_type(a.type, [&](auto T) { groups<decltype(T)::value>(a, WI, g0, g1); });
}
