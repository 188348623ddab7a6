// AVX-512 few-row products (decode at batch 1-11, speculative verification rows) on a
// row-interleaved copy of Q4_0 / Q4_1 / Q8_0 weights. Included once by quant_kernels.cpp inside
// namespace avx512_rows16 within the AVX-512 target region (the block structs, GemmArgs and the
// type codes are the file's). No include guard on purpose.
//
// The packed rows' layout makes a few-row product horizontal: each output row is a dot product
// over its blocks, 32 weights at a time, summed across lanes at the end, with one scale
// conversion and per-row bookkeeping per block. Interleaving 16 output rows per block turns it
// vertical: a vector holds one element of 16 rows, multiplied by one broadcast activation, no
// lane sums, and each block's 16 scales load as one vector. Per (group of 16 rows, block of 32
// along K), the same bytes as the 16 rows' blocks:
//   d[16] (fp16) | m[16] (fp16, Q4_1 only) | quants: Q4_0 / Q4_1 16 x 16 bytes, byte [j][r] =
//   row r's qs[j] (low nibble: element j, high nibble: element j + 16); Q8_0 32 x 16 bytes,
//   byte [j][r] = row r's qs[j].
// Numerics, per output row and block: lo = sum_{j < 16} q[j] x[j] and hi = sum_{j < 16} q[j + 16]
// x[j + 16] (float FMAs in j order), acc += (lo + hi) * d, then acc += m * sum(x of the block)
// for Q4_1; the quants exactly as the packed kernels take them (Q4_0's minus 8). A row's bits
// do not depend on the number of rows or groups computed with it (so a k-token verification
// computes what 1-row decode steps do); they differ from the packed rows' kernel's, which sums
// in another order.

static inline int64_t rows16_block_bytes(int type) {
  switch (type) {
    case T_Q4_0: return 16 * (int64_t)sizeof(bq4_0);
    case T_Q4_1: return 16 * (int64_t)sizeof(bq4_1);
    case T_Q8_0: return 16 * (int64_t)sizeof(bq8_0);
    default: return 0;
  }
}

// packed rows [16 * groups, rb] -> interleaved groups g0 .. g1 (out: the whole copy)
static void interleave16(int type, const uint8_t* W, int64_t rb, int64_t K, int64_t g0, int64_t g1, uint8_t* out) {
  const int64_t nb = K / 32, bb = rb / nb, BB = rows16_block_bytes(type), hdr = type == T_Q4_1 ? 64 : 32;
  const int64_t nq = type == T_Q8_0 ? 32 : 16, qoff = type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : 2;
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t i = 0; i < nb; ++i) {
      uint8_t* p = out + (g * nb + i) * BB;
      for (int64_t r = 0; r < 16; ++r) {
        const uint8_t* blk = W + (g * 16 + r) * rb + i * bb;
        std::memcpy(p + 2 * r, blk, 2);                                // d
        if (type == T_Q4_1) std::memcpy(p + 32 + 2 * r, blk + 2, 2);  // m
        for (int64_t j = 0; j < nq; ++j) p[hdr + j * 16 + r] = blk[qoff + j];
      }
    }
}

// quants of element pair (j, j + 16) of 16 rows as floats: Q4 from one byte each, Q8_0 two bytes
template <int TYPE>
static inline void quants16(const uint8_t* q, int64_t j, __m512& lo, __m512& hi) {
  if (TYPE == T_Q8_0) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * 16))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (j + 16) * 16))));
    return;
  }
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * 16)));
  __m512i l = _mm512_and_si512(w, _mm512_set1_epi32(15)), h = _mm512_srli_epi32(w, 4);
  if (TYPE == T_Q4_0) {
    l = _mm512_sub_epi32(l, _mm512_set1_epi32(8));
    h = _mm512_sub_epi32(h, _mm512_set1_epi32(8));
  }
  lo = _mm512_cvtepi32_ps(l);
  hi = _mm512_cvtepi32_ps(h);
}

// Blocks ahead whose bytes a tile prefetches (16 x 20 bytes a Q4_1 block: 2.5 KB ahead; past a
// group's end they are the next group's, which follows in memory). The copy streams from DRAM
// in a decode step, and the prefetchers alone left it at ~14 GB/s of the ~31 a plain read gets
// here (2-vCPU Zen 4). Engine steps of the default model (bf16), this copy's bf16 kernel / its
// float one (PAGEDSERVE_CPU_ISA=avx512), prefetch off -> on, medians of 10 alternations: 1 row 9.44 -> 8.78 / 10.65 -> 10.04 ms, 4 rows 11.24 ->
// 10.76 / 15.8 -> 16.1, 7 rows 16.95 -> 14.5 / 24.6 -> 23.7 (BENCHMARKS section 44).
constexpr int64_t ROWS16_PREFETCH_BLOCKS = 8;

// the cache lines of block i + ROWS16_PREFETCH_BLOCKS of groups g0 .. g0 + G - 1 (a hint: an
// address past the copy's end does not fault)
template <int G>
static inline void prefetch_ahead(const uint8_t* WI, int64_t g0, int64_t nb, int64_t i, int64_t BB) {
  for (int g = 0; g < G; ++g) {
    const char* p = reinterpret_cast<const char*>(WI + ((g0 + g) * nb + i + ROWS16_PREFETCH_BLOCKS) * BB);
    for (int64_t c = 0; c < BB; c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
  }
}

// out[m0 + t][16 g .. 16 g + 15] for G groups from g0 and MT activation rows from m0
template <int TYPE, int G, int MT>
static void rows16_tile(const GemmArgs& a, const uint8_t* WI, int64_t g0, int64_t m0) {
  const int64_t nb = a.K / 32, BB = rows16_block_bytes(TYPE), hdr = TYPE == T_Q4_1 ? 64 : 32;
  __m512 acc[G][MT];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < MT; ++t) acc[g][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    prefetch_ahead<G>(WI, g0, nb, i, BB);
    __m512 lo[G][MT], hi[G][MT];
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < MT; ++t) lo[g][t] = hi[g][t] = _mm512_setzero_ps();
    for (int64_t j = 0; j < 16; ++j)
      for (int g = 0; g < G; ++g) {
        __m512 ql, qh;
        quants16<TYPE>(WI + ((g0 + g) * nb + i) * BB + hdr, j, ql, qh);
        for (int t = 0; t < MT; ++t) {
          const float* x = a.X + (m0 + t) * a.K + i * 32;
          lo[g][t] = _mm512_fmadd_ps(ql, _mm512_set1_ps(x[j]), lo[g][t]);
          hi[g][t] = _mm512_fmadd_ps(qh, _mm512_set1_ps(x[j + 16]), hi[g][t]);
        }
      }
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = WI + ((g0 + g) * nb + i) * BB;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      for (int t = 0; t < MT; ++t) acc[g][t] = _mm512_fmadd_ps(_mm512_add_ps(lo[g][t], hi[g][t]), d, acc[g][t]);
      if (TYPE == T_Q4_1) {
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
        for (int t = 0; t < MT; ++t) acc[g][t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.xsum[(m0 + t) * nb + i]), acc[g][t]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < MT; ++t) _mm512_storeu_ps(a.out + (m0 + t) * a.ldo + (g0 + g) * 16, acc[g][t]);
}

// Every (group, row tile) of groups g0 .. g1 and M activation rows, as tile(G, MT, g, m0) with G
// and MT std::integral_constants: tiles of up to 8 rows; pairs of groups for 1-2 rows (four
// multiply chains in flight), one group for 3-8. Both interleaved kernels walk their tiles so
// (quant_rows16_bf16.h too).
template <class Tile>
static void for_each_tile(int64_t M, int64_t g0, int64_t g1, const Tile& tile) {
  using std::integral_constant;
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t mt = std::min<int64_t>(8, M - m0);
    auto each = [&](auto G, auto MT) {
      int64_t g = g0;
      for (; g + decltype(G)::value <= g1; g += decltype(G)::value) tile(G, MT, g, m0);
      for (; g < g1; ++g) tile(integral_constant<int, 1>{}, MT, g, m0);
    };
    switch (mt) {
      case 1: each(integral_constant<int, 2>{}, integral_constant<int, 1>{}); break;
      case 2: each(integral_constant<int, 2>{}, integral_constant<int, 2>{}); break;
      case 3: each(integral_constant<int, 1>{}, integral_constant<int, 3>{}); break;
      case 4: each(integral_constant<int, 1>{}, integral_constant<int, 4>{}); break;
      case 5: each(integral_constant<int, 1>{}, integral_constant<int, 5>{}); break;
      case 6: each(integral_constant<int, 1>{}, integral_constant<int, 6>{}); break;
      case 7: each(integral_constant<int, 1>{}, integral_constant<int, 7>{}); break;
      default: each(integral_constant<int, 1>{}, integral_constant<int, 8>{}); break;
    }
    m0 += mt;
  }
}

template <int TYPE>
static void rows16_groups(const GemmArgs& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  for_each_tile(a.M, g0, g1, [&](auto G, auto MT, int64_t g, int64_t m0) {
    rows16_tile<TYPE, decltype(G)::value, decltype(MT)::value>(a, WI, g, m0);
  });
}

static void gemm_rows16(const GemmArgs& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  switch (a.type) {
    case T_Q4_0: return rows16_groups<T_Q4_0>(a, WI, g0, g1);
    case T_Q4_1: return rows16_groups<T_Q4_1>(a, WI, g0, g1);
    default: return rows16_groups<T_Q8_0>(a, WI, g0, g1);
  }
}
