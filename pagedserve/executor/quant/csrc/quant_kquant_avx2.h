// Few-row products of K-quant rows (Q4_K, Q5_K, Q6_K) and of Q5_0 / Q5_1 rows with float
// activations, in AVX2 + FMA instructions: included by quant_avx2.h and quant_avx512.h inside
// their namespaces and target regions (an AVX-512 CPU runs them too: at 1-8 rows they wait on
// memory, not on vector width). Q5_0 / Q5_1 are llama.cpp's stand-ins for Q4_K / Q5_K in a
// K-quant mix where a row is not a multiple of 256 (SmolLM2's 576, Qwen2.5-0.5B's 896).
// The quants become float registers once per sub-block and meet every activation row there; no
// dequantized row goes through memory (the generic path's dequantize-then-dot ran at 3-6 GB/s).
//
// Per sub-block (32 elements: Q4_K / Q5_K; 16: Q6_K) and activation row:
//   acc += (d * sc) * sum(x * q)          [and Q4_K / Q5_K: accm += (dmin * m) * sum(x)]
// with sum(x) over the sub-block from g.xsum (blocks of 32, as Q4_1's); d * sc and dmin * m are
// exact in float32 (an fp16 times a 6-bit integer, or Q6_K's int8). The result is acc - accm.
// Every activation row goes through the same operations whatever the tile's row count, so a
// row's result does not depend on its neighbours (a speculative verification of k tokens gives
// each row the bits a 1-row step gives it). No include guard on purpose (one copy per namespace).

// Four groups of 8 consecutive bytes widened to dwords
static inline void widen32(const uint8_t* p, __m256i* b) {
  for (int k = 0; k < 4; ++k) b[k] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * k)));
}

// acc[t] += vs * sum(f[k] * x[t][8k..8k+8)), k < NV, for the tile's rows
template <int MT, int NV>
static inline void kq_rows(const __m256* f, __m256 vs, const float* X, int64_t K, int64_t e, __m256* acc) {
  for (int t = 0; t < MT; ++t) {
    const float* x = X + t * K + e;
    __m256 s = _mm256_mul_ps(f[0], _mm256_loadu_ps(x));
    for (int k = 1; k < NV; ++k) s = _mm256_fmadd_ps(f[k], _mm256_loadu_ps(x + 8 * k), s);
    acc[t] = _mm256_fmadd_ps(s, vs, acc[t]);
  }
}

// Q4_K / Q5_K: per super-block of 256, four chunks of 32 bytes; chunk j's low nibbles are
// sub-block 2j, its high nibbles sub-block 2j + 1 (Q5_K: their fifth bits are bits 2j and 2j + 1
// of qh[l])
template <int TYPE, int MT>
static void kq45_tile(const GemmArgs& g, int64_t n, int64_t m0) {
  using B = std::conditional_t<TYPE == T_Q5_K, bq5_K, bq4_K>;
  const B* row = reinterpret_cast<const B*>(g.W + n * g.rb);
  const float* X = g.X + m0 * g.K;
  const int64_t nsb = g.K / 32;
  const __m256i m4 = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
  __m256 acc[MT];
  float accm[MT];
  for (int t = 0; t < MT; ++t) {
    acc[t] = _mm256_setzero_ps();
    accm[t] = 0.f;
  }
  for (int64_t i = 0; i < g.K / 256; ++i) {
    const B& b = row[i];
    const float d = h2f(b.d), dmin = h2f(b.dmin);
    __m256i qh[4];
    if constexpr (TYPE == T_Q5_K) widen32(b.qh, qh);
    for (int j = 0; j < 4; ++j) {
      int sc1, mn1, sc2, mn2;
      scale_min_k4(2 * j, b.scales, &sc1, &mn1);
      scale_min_k4(2 * j + 1, b.scales, &sc2, &mn2);
      __m256i q[4];
      widen32(b.qs + 32 * j, q);
      __m256 lo[4], hi[4];
      for (int k = 0; k < 4; ++k) {
        __m256i l = _mm256_and_si256(q[k], m4), h = _mm256_srli_epi32(q[k], 4);
        if constexpr (TYPE == T_Q5_K) {
          const __m256i bits = _mm256_srl_epi32(qh[k], _mm_cvtsi32_si128(2 * j));
          l = _mm256_or_si256(l, _mm256_slli_epi32(_mm256_and_si256(bits, one), 4));
          h = _mm256_or_si256(h, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 1), one), 4));
        }
        lo[k] = _mm256_cvtepi32_ps(l);
        hi[k] = _mm256_cvtepi32_ps(h);
      }
      const int64_t e = i * 256 + 64 * j;
      kq_rows<MT, 4>(lo, _mm256_set1_ps(d * (float)sc1), X, g.K, e, acc);
      kq_rows<MT, 4>(hi, _mm256_set1_ps(d * (float)sc2), X, g.K, e + 32, acc);
      const float m1 = dmin * (float)mn1, m2 = dmin * (float)mn2;
      const int64_t s = i * 8 + 2 * j;
      for (int t = 0; t < MT; ++t) {  // explicit FMAs: no contraction that differs with MT
        const float* xs = g.xsum + (m0 + t) * nsb + s;
        accm[t] = std::fma(m2, xs[1], std::fma(m1, xs[0], accm[t]));
      }
    }
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = hsum8(acc[t]) - accm[t];
}

// Q6_K: per half of a super-block (128 elements), byte l < 32 of ql / ql + 32 / qh makes
// elements l, l + 32, l + 64, l + 96: low nibbles of ql[l] and ql[l + 32] (+ qh bits 0-1, 2-3),
// then their high nibbles (+ qh bits 4-5, 6-7), each minus 32; sub-blocks of 16 elements
template <int MT>
static void kq6_tile(const GemmArgs& g, int64_t n, int64_t m0) {
  const bq6_K* row = reinterpret_cast<const bq6_K*>(g.W + n * g.rb);
  const float* X = g.X + m0 * g.K;
  const __m256i m4 = _mm256_set1_epi32(15), m3 = _mm256_set1_epi32(3), c32 = _mm256_set1_epi32(32);
  __m256 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < g.K / 256; ++i) {
    const bq6_K& b = row[i];
    const float d = h2f(b.d);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = b.ql + 64 * half;
      const uint8_t* qh = b.qh + 32 * half;
      const int8_t* sc = b.scales + 8 * half;
      for (int p = 0; p < 2; ++p) {  // bytes l in [16p, 16p + 16): sub-block p of each quarter
        __m256 f[4][2];  // [quarter][8 bytes]
        for (int k = 0; k < 2; ++k) {
          const int l = 16 * p + 8 * k;
          const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ql + l)));
          const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ql + 32 + l)));
          const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qh + l)));
          const __m256i q[4] = {
              _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi32(_mm256_and_si256(h, m3), 4)),
              _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2), m3), 4)),
              _mm256_or_si256(_mm256_srli_epi32(a, 4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 4), m3), 4)),
              _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_slli_epi32(_mm256_srli_epi32(h, 6), 4)),
          };
          for (int r = 0; r < 4; ++r) f[r][k] = _mm256_cvtepi32_ps(_mm256_sub_epi32(q[r], c32));
        }
        const int64_t e = i * 256 + 128 * half + 16 * p;
        for (int r = 0; r < 4; ++r) kq_rows<MT, 2>(f[r], _mm256_set1_ps(d * (float)sc[2 * r + p]), X, g.K, e + 32 * r, acc);
      }
    }
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = hsum8(acc[t]);
}

// Q5_0 / Q5_1: per block of 32, acc += d * sum(x * q) [Q5_1: accm += m * sum(x), from g.xsum];
// q = the nibble with its fifth bit (bit e of qh for element e) above it, less 16 for Q5_0.
// Elements 0-15 are the low nibbles of bytes 0-15, elements 16-31 their high nibbles.
template <int TYPE, int MT>
static void q5_tile(const GemmArgs& g, int64_t n, int64_t m0) {
  constexpr bool has_min = TYPE == T_Q5_1;
  using B = std::conditional_t<has_min, bq5_1, bq5_0>;
  const B* row = reinterpret_cast<const B*>(g.W + n * g.rb);
  const float* X = g.X + m0 * g.K;
  const int64_t nb = g.K / 32;
  const __m256i m4 = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1), off = _mm256_set1_epi32(has_min ? 0 : 16);
  const __m256i at0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm256_set1_epi32(8);
  __m256 acc[MT];
  float accm[MT];
  for (int t = 0; t < MT; ++t) {
    acc[t] = _mm256_setzero_ps();
    accm[t] = 0.f;
  }
  for (int64_t i = 0; i < nb; ++i) {
    const B& b = row[i];
    uint32_t qh;
    std::memcpy(&qh, b.qh, 4);
    const __m256i vqh = _mm256_set1_epi32(static_cast<int>(qh));
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs)));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs + 8)));
    const __m256i nib[4] = {_mm256_and_si256(lo, m4), _mm256_and_si256(hi, m4), _mm256_srli_epi32(lo, 4),
                            _mm256_srli_epi32(hi, 4)};
    __m256 f[4];
    __m256i at = at0;  // the elements' indices: their bits of qh
    for (int k = 0; k < 4; ++k, at = _mm256_add_epi32(at, eight)) {
      const __m256i fifth = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(vqh, at), one), 4);
      f[k] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(nib[k], fifth), off));
    }
    kq_rows<MT, 4>(f, _mm256_set1_ps(h2f(b.d)), X, g.K, i * 32, acc);
    if constexpr (has_min) {
      const float mn = h2f(b.m);
      for (int t = 0; t < MT; ++t) accm[t] = std::fma(mn, g.xsum[(m0 + t) * nb + i], accm[t]);
    }
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = hsum8(acc[t]) + accm[t];
}

template <int TYPE>
static void gemm_tiles(const GemmArgs& g, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    row_tiles(g.M, [&](auto mt, int64_t m0) {
      if constexpr (TYPE == T_Q6_K)
        kq6_tile<decltype(mt)::value>(g, n, m0);
      else if constexpr (TYPE == T_Q5_0 || TYPE == T_Q5_1)
        q5_tile<TYPE, decltype(mt)::value>(g, n, m0);
      else
        kq45_tile<TYPE, decltype(mt)::value>(g, n, m0);
    });
}

// The few-row products of the types here (K-quants, Q5_0, Q5_1); false for the others
// (quant_loops.h's gemm_rows)
static bool gemm_avx2_tiles(const GemmArgs& g, int64_t n0, int64_t n1) {
  switch (g.type) {
    case T_Q4_K: gemm_tiles<T_Q4_K>(g, n0, n1); return true;
    case T_Q5_K: gemm_tiles<T_Q5_K>(g, n0, n1); return true;
    case T_Q6_K: gemm_tiles<T_Q6_K>(g, n0, n1); return true;
    case T_Q5_0: gemm_tiles<T_Q5_0>(g, n0, n1); return true;
    case T_Q5_1: gemm_tiles<T_Q5_1>(g, n0, n1); return true;
    default: return false;
  }
}
