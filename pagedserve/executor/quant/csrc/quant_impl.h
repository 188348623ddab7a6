// Kernels for one instruction set. Included by quant_kernels.cpp once per ISA, inside a
// namespace and (for AVX2 / AVX-512) a target region, with QK_ISA = 0 (portable scalar),
// 1 (AVX2 + FMA + F16C) or 2 (AVX-512 F/BW/VL/DQ). No include guard on purpose.
//
// Every function computes with float activations (except the gemm_q8 family at the end, the
// named option "gguf_q8"), the same products as dequantize-then-matmul up to float rounding:
//   few rows, Q4_0 / Q4_1 / Q8_0: each weight block expanded into registers and used for every
//     activation row, as scale * sum(x * q) + min * sum(x) (1-3 rows) or with scale and min
//     folded into the expanded weights (4-8 rows);
//   few rows, other types: one weight row dequantized into a small buffer, dotted with each row;
//   many rows (AVX2, gemm_many_rows): chunks of weight rows dequantized into an L2-sized float
//     buffer and multiplied by a 3x4 register-blocked micro-kernel, any type (F32 included).

static inline float h2f(uint16_t h) {
#if QK_ISA >= 1
  return _cvtsh_ss(h);
#else
  return fp16_to_f32(h);
#endif
}

// ---- dequantization of one row of K elements (any supported type) ----------------------
static void deq_q4_0(const uint8_t* src, float* y, int64_t K) {
  const bq4_0* b = reinterpret_cast<const bq4_0*>(src);
  for (int64_t i = 0; i < K / 32; ++i, y += 32) {
    const float d = h2f(b[i].d);
    for (int j = 0; j < 16; ++j) {
      y[j] = (float)((int)(b[i].qs[j] & 15) - 8) * d;
      y[j + 16] = (float)((int)(b[i].qs[j] >> 4) - 8) * d;
    }
  }
}
static void deq_q4_1(const uint8_t* src, float* y, int64_t K) {
  const bq4_1* b = reinterpret_cast<const bq4_1*>(src);
  for (int64_t i = 0; i < K / 32; ++i, y += 32) {
    const float d = h2f(b[i].d), m = h2f(b[i].m);
    for (int j = 0; j < 16; ++j) {
      y[j] = (float)(b[i].qs[j] & 15) * d + m;
      y[j + 16] = (float)(b[i].qs[j] >> 4) * d + m;
    }
  }
}
static void deq_q5_0(const uint8_t* src, float* y, int64_t K) {
  const bq5_0* b = reinterpret_cast<const bq5_0*>(src);
  for (int64_t i = 0; i < K / 32; ++i, y += 32) {
    const float d = h2f(b[i].d);
    uint32_t qh;
    std::memcpy(&qh, b[i].qh, 4);
    for (int j = 0; j < 16; ++j) {
      const int lo = (b[i].qs[j] & 15) | (((qh >> j) & 1) << 4);
      const int hi = (b[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      y[j] = (float)(lo - 16) * d;
      y[j + 16] = (float)(hi - 16) * d;
    }
  }
}
static void deq_q5_1(const uint8_t* src, float* y, int64_t K) {
  const bq5_1* b = reinterpret_cast<const bq5_1*>(src);
  for (int64_t i = 0; i < K / 32; ++i, y += 32) {
    const float d = h2f(b[i].d), m = h2f(b[i].m);
    uint32_t qh;
    std::memcpy(&qh, b[i].qh, 4);
    for (int j = 0; j < 16; ++j) {
      const int lo = (b[i].qs[j] & 15) | (((qh >> j) & 1) << 4);
      const int hi = (b[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      y[j] = (float)lo * d + m;
      y[j + 16] = (float)hi * d + m;
    }
  }
}
static void deq_q8_0(const uint8_t* src, float* y, int64_t K) {
  const bq8_0* b = reinterpret_cast<const bq8_0*>(src);
  for (int64_t i = 0; i < K / 32; ++i, y += 32) {
    const float d = h2f(b[i].d);
    for (int j = 0; j < 32; ++j) y[j] = (float)b[i].qs[j] * d;
  }
}
static inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}
static void deq_q4_k(const uint8_t* src, float* y, int64_t K) {
  const bq4_K* b = reinterpret_cast<const bq4_K*>(src);
  for (int64_t i = 0; i < K / 256; ++i) {
    const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    const uint8_t* q = b[i].qs;
    for (int j = 0; j < 4; ++j, q += 32, y += 64) {
      int sc, m;
      scale_min_k4(2 * j, b[i].scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(2 * j + 1, b[i].scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) y[l] = d1 * (float)(q[l] & 15) - m1;
      for (int l = 0; l < 32; ++l) y[l + 32] = d2 * (float)(q[l] >> 4) - m2;
    }
  }
}
static void deq_q5_k(const uint8_t* src, float* y, int64_t K) {
  const bq5_K* b = reinterpret_cast<const bq5_K*>(src);
  for (int64_t i = 0; i < K / 256; ++i) {
    const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    const uint8_t* q = b[i].qs;
    const uint8_t* qh = b[i].qh;
    for (int j = 0; j < 4; ++j, q += 32, y += 64) {
      int sc, m;
      scale_min_k4(2 * j, b[i].scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(2 * j + 1, b[i].scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      const int s1 = 2 * j, s2 = 2 * j + 1;
      for (int l = 0; l < 32; ++l) y[l] = d1 * (float)((q[l] & 15) | (((qh[l] >> s1) & 1) << 4)) - m1;
      for (int l = 0; l < 32; ++l) y[l + 32] = d2 * (float)((q[l] >> 4) | (((qh[l] >> s2) & 1) << 4)) - m2;
    }
  }
}
static void deq_q6_k(const uint8_t* src, float* y, int64_t K) {
  const bq6_K* b = reinterpret_cast<const bq6_K*>(src);
  for (int64_t i = 0; i < K / 256; ++i) {
    const float d = h2f(b[i].d);
    const uint8_t* ql = b[i].ql;
    const uint8_t* qh = b[i].qh;
    const int8_t* sc = b[i].scales;
    for (int n = 0; n < 2; ++n, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * (float)sc[is] * (float)q1;
        y[l + 32] = d * (float)sc[is + 2] * (float)q2;
        y[l + 64] = d * (float)sc[is + 4] * (float)q3;
        y[l + 96] = d * (float)sc[is + 6] * (float)q4;
      }
    }
  }
}
static void deq_f32(const uint8_t* src, float* y, int64_t K) { std::memcpy(y, src, K * sizeof(float)); }
static void deq_f16(const uint8_t* src, float* y, int64_t K) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < K; ++i) y[i] = h2f(s[i]);
}
static void deq_bf16(const uint8_t* src, float* y, int64_t K) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < K; ++i) {
    const uint32_t u = (uint32_t)s[i] << 16;
    std::memcpy(&y[i], &u, 4);
  }
}

typedef void (*deq_fn)(const uint8_t*, float*, int64_t);
static deq_fn deq_for(int type) {
  switch (type) {
    case T_F32: return deq_f32;
    case T_F16: return deq_f16;
    case T_BF16: return deq_bf16;
    case T_Q4_0: return deq_q4_0;
    case T_Q4_1: return deq_q4_1;
    case T_Q5_0: return deq_q5_0;
    case T_Q5_1: return deq_q5_1;
    case T_Q8_0: return deq_q8_0;
    case T_Q4_K: return deq_q4_k;
    case T_Q5_K: return deq_q5_k;
    case T_Q6_K: return deq_q6_k;
    default: return nullptr;
  }
}


// The 32 quants of a Q4_0 / Q4_1 / Q8_0 block, in element order, as T (float or int8_t);
// Q4_0's are centred (-8): the scalar kernels' unpacking, float or integer products alike.
template <int TYPE, typename T>
static inline void quants32(const uint8_t* blk, T* q) {
  if (TYPE == T_Q8_0) {
    for (int j = 0; j < 32; ++j) q[j] = (T)reinterpret_cast<const bq8_0*>(blk)->qs[j];
  } else {
    const uint8_t* qs = TYPE == T_Q4_0 ? reinterpret_cast<const bq4_0*>(blk)->qs : reinterpret_cast<const bq4_1*>(blk)->qs;
    const int off = TYPE == T_Q4_0 ? 8 : 0;
    for (int j = 0; j < 16; ++j) {
      q[j] = (T)((int)(qs[j] & 15) - off);
      q[j + 16] = (T)((int)(qs[j] >> 4) - off);
    }
  }
}

// ---- dot products ------------------------------------------------------------------------
#if QK_ISA >= 1
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

static inline float dot(const float* a, const float* b, int64_t K) {
  int64_t i = 0;
  float s = 0.f;
#if QK_ISA == 2
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; i + 32 <= K; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), a1);
  }
  s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif QK_ISA == 1
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= K; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
  }
  s = hsum8(_mm256_add_ps(a0, a1));
#else
  float p[4] = {0.f, 0.f, 0.f, 0.f};
  for (; i + 4 <= K; i += 4)
    for (int j = 0; j < 4; ++j) p[j] += a[i + j] * b[i + j];
  s = (p[0] + p[1]) + (p[2] + p[3]);
#endif
  for (; i < K; ++i) s += a[i] * b[i];
  return s;
}

// Any type: dequantize a row into buf, then one dot product per activation row.
static void gemm_generic(const GemmArgs& g, int64_t n0, int64_t n1) {
  std::vector<float> buf(g.K);
  deq_fn f = deq_for(g.type);
  for (int64_t n = n0; n < n1; ++n) {
    f(g.W + n * g.rb, buf.data(), g.K);
    for (int64_t m = 0; m < g.M; ++m) g.out[m * g.ldo + n] = dot(g.X + m * g.K, buf.data(), g.K);
  }
}

// ---- fused kernels: Q4_0, Q4_1, Q8_0 --------------------------------------------------------
// Each block's 32 quants become float registers once and are used for up to MT activation
// rows; per block and row: acc += d * sum(x * q) (+ m * sum(x) for Q4_1, from g.xsum), or
// (AVX2, 4-8 rows) acc += x * (d * q + m).
#if QK_ISA == 1
template <int TYPE>
static inline void unpack32(const uint8_t* blk, __m256* f) {
  if (TYPE == T_Q8_0) {
    const int8_t* qs = reinterpret_cast<const bq8_0*>(blk)->qs;
    for (int j = 0; j < 4; ++j)
      f[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * j))));
  } else {
    // bytes widened to dwords straight from memory, then both nibbles taken per lane:
    // bytes 0-7 give elements 0-7 (low nibbles) and 16-23 (high), bytes 8-15 give 8-15 and 24-31
    const uint8_t* qs = TYPE == T_Q4_0 ? reinterpret_cast<const bq4_0*>(blk)->qs : reinterpret_cast<const bq4_1*>(blk)->qs;
    const __m256i m4 = _mm256_set1_epi32(15);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
    __m256i l0 = _mm256_and_si256(b0, m4), l1 = _mm256_and_si256(b1, m4);
    __m256i h0 = _mm256_srli_epi32(b0, 4), h1 = _mm256_srli_epi32(b1, 4);
    if (TYPE == T_Q4_0) {
      const __m256i e8 = _mm256_set1_epi32(8);
      l0 = _mm256_sub_epi32(l0, e8);
      l1 = _mm256_sub_epi32(l1, e8);
      h0 = _mm256_sub_epi32(h0, e8);
      h1 = _mm256_sub_epi32(h1, e8);
    }
    f[0] = _mm256_cvtepi32_ps(l0);
    f[1] = _mm256_cvtepi32_ps(l1);
    f[2] = _mm256_cvtepi32_ps(h0);
    f[3] = _mm256_cvtepi32_ps(h1);
  }
}

// 4-8 rows: the block's 32 weights dequantized in registers (q * d, + m for Q4_1: the same
// FMA as deq_fast), so a row's products are plain FMAs. Each activation row keeps two accumulators
// (up to 6 rows: 12 + the 4 weight vectors fill the 16 registers), so enough independent FMA
// chains are in flight to keep both FMA pipes busy (one chain of 4-5 dependent FMAs per row
// and block left a 5-row tile at half the machine's FMA rate).
// 1-3 rows (a decode at batch 1 is this, and memory-bound): folding scale and min into the
// weights would cost 4 FMAs a block for too few rows; instead each row's sum(x * q) is scaled
// once (acc += d * s) and Q4_1's min term comes from the activations' block sums (g.xsum).
template <int TYPE, int MT>
static void gemm_fused_tile_few(const GemmArgs& g, int64_t n, int64_t m0) {
  constexpr int64_t BB = TYPE == T_Q8_0 ? sizeof(bq8_0) : TYPE == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
  const int64_t nb = g.K / 32;
  const uint8_t* row = g.W + n * g.rb;
  __m256 acc[MT];
  float accm[MT];
  for (int t = 0; t < MT; ++t) {
    acc[t] = _mm256_setzero_ps();
    accm[t] = 0.f;
  }
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* blk = row + i * BB;
    __m256 f[4];
    unpack32<TYPE>(blk, f);
    const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
    const __m256 vd = _mm256_set1_ps(h2f(hdr[0]));
    for (int t = 0; t < MT; ++t) {
      const float* x = g.X + (m0 + t) * g.K + i * 32;
      __m256 s = _mm256_mul_ps(f[0], _mm256_loadu_ps(x));
      s = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(x + 8), s);
      s = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(x + 16), s);
      s = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(x + 24), s);
      acc[t] = _mm256_fmadd_ps(s, vd, acc[t]);
    }
    if (TYPE == T_Q4_1) {
      const float mn = h2f(hdr[1]);
      for (int t = 0; t < MT; ++t) accm[t] += mn * g.xsum[(m0 + t) * nb + i];
    }
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = hsum8(acc[t]) + accm[t];
}

template <int TYPE, int MT>
static void gemm_fused_tile(const GemmArgs& g, int64_t n, int64_t m0) {
  if constexpr (MT <= 3) {
    gemm_fused_tile_few<TYPE, MT>(g, n, m0);
    return;
  }
  constexpr int64_t BB = TYPE == T_Q8_0 ? sizeof(bq8_0) : TYPE == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
  constexpr int NA = MT <= 6 ? 2 : 1;
  const int64_t nb = g.K / 32;
  const uint8_t* row = g.W + n * g.rb;
  const float* X = g.X + m0 * g.K;
  __m256 acc[MT][NA];
  for (int t = 0; t < MT; ++t)
    for (int a = 0; a < NA; ++a) acc[t][a] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* blk = row + i * BB;
    __m256 f[4];
    unpack32<TYPE>(blk, f);
    const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
    const __m256 vd = _mm256_set1_ps(h2f(hdr[0]));
    if (TYPE == T_Q4_1) {
      const __m256 vm = _mm256_set1_ps(h2f(hdr[1]));
      for (int j = 0; j < 4; ++j) f[j] = _mm256_fmadd_ps(f[j], vd, vm);
    } else {
      for (int j = 0; j < 4; ++j) f[j] = _mm256_mul_ps(f[j], vd);
    }
    for (int t = 0; t < MT; ++t) {
      const float* x = X + t * g.K + i * 32;
      for (int j = 0; j < 4; ++j) acc[t][j % NA] = _mm256_fmadd_ps(f[j], _mm256_loadu_ps(x + 8 * j), acc[t][j % NA]);
    }
  }
  for (int t = 0; t < MT; ++t) {
    __m256 s = acc[t][0];
    if (NA == 2) s = _mm256_add_ps(s, acc[t][NA - 1]);
    g.out[(m0 + t) * g.ldo + n] = hsum8(s);
  }
}
#elif QK_ISA == 2
template <int TYPE>
static inline void unpack32(const uint8_t* blk, __m512* f) {
  if (TYPE == T_Q8_0) {
    const int8_t* qs = reinterpret_cast<const bq8_0*>(blk)->qs;
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16))));
  } else {
    const uint8_t* qs = TYPE == T_Q4_0 ? reinterpret_cast<const bq4_0*>(blk)->qs : reinterpret_cast<const bq4_1*>(blk)->qs;
    const __m128i m4 = _mm_set1_epi8(15);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
    if (TYPE == T_Q4_0) {
      const __m128i e8 = _mm_set1_epi8(8);
      f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(lo, e8)));
      f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(hi, e8)));
    } else {
      f[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
      f[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
    }
  }
}

template <int TYPE, int MT>
static void gemm_fused_tile(const GemmArgs& g, int64_t n, int64_t m0) {
  constexpr int64_t BB = TYPE == T_Q8_0 ? sizeof(bq8_0) : TYPE == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
  const int64_t nb = g.K / 32;
  const uint8_t* row = g.W + n * g.rb;
  __m512 acc[MT];
  float accm[MT];
  for (int t = 0; t < MT; ++t) {
    acc[t] = _mm512_setzero_ps();
    accm[t] = 0.f;
  }
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* blk = row + i * BB;
    __m512 f[2];
    unpack32<TYPE>(blk, f);
    const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
    const __m512 vd = _mm512_set1_ps(h2f(hdr[0]));
    for (int t = 0; t < MT; ++t) {
      const float* x = g.X + (m0 + t) * g.K + i * 32;
      __m512 s = _mm512_mul_ps(f[0], _mm512_loadu_ps(x));
      s = _mm512_fmadd_ps(f[1], _mm512_loadu_ps(x + 16), s);
      acc[t] = _mm512_fmadd_ps(s, vd, acc[t]);
    }
    if (TYPE == T_Q4_1) {
      const float mn = h2f(hdr[1]);
      for (int t = 0; t < MT; ++t) accm[t] += mn * g.xsum[(m0 + t) * nb + i];
    }
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = _mm512_reduce_add_ps(acc[t]) + accm[t];
}
#else
template <int TYPE, int MT>
static void gemm_fused_tile(const GemmArgs& g, int64_t n, int64_t m0) {
  constexpr int64_t BB = TYPE == T_Q8_0 ? sizeof(bq8_0) : TYPE == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
  const int64_t nb = g.K / 32;
  const uint8_t* row = g.W + n * g.rb;
  float acc[MT], accm[MT];
  for (int t = 0; t < MT; ++t) acc[t] = accm[t] = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* blk = row + i * BB;
    float q[32];
    quants32<TYPE>(blk, q);
    const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
    const float d = h2f(hdr[0]);
    for (int t = 0; t < MT; ++t) {
      const float* x = g.X + (m0 + t) * g.K + i * 32;
      float s = 0.f;
      for (int j = 0; j < 32; ++j) s += q[j] * x[j];
      acc[t] += s * d;
    }
    if (TYPE == T_Q4_1) {
      const float mn = h2f(hdr[1]);
      for (int t = 0; t < MT; ++t) accm[t] += mn * g.xsum[(m0 + t) * nb + i];
    }
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = acc[t] + accm[t];
}
#endif

// The activation rows in tiles: of 4, or one tile of 5-8 rows. `tile(MT, m0)` gets MT as a
// compile-time constant (std::integral_constant).
template <typename F>
static inline void row_tiles(int64_t M, F&& tile) {
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t left = M - m0, r = left <= 8 && left >= 5 ? left : std::min<int64_t>(4, left);
    switch (r) {
      case 8: tile(std::integral_constant<int, 8>{}, m0); break;
      case 7: tile(std::integral_constant<int, 7>{}, m0); break;
      case 6: tile(std::integral_constant<int, 6>{}, m0); break;
      case 5: tile(std::integral_constant<int, 5>{}, m0); break;
      case 4: tile(std::integral_constant<int, 4>{}, m0); break;
      case 3: tile(std::integral_constant<int, 3>{}, m0); break;
      case 2: tile(std::integral_constant<int, 2>{}, m0); break;
      default: tile(std::integral_constant<int, 1>{}, m0); break;
    }
    m0 += r;
  }
}

template <int TYPE>
static void gemm_fused(const GemmArgs& g, int64_t n0, int64_t n1) {
  // one output row at a time, all activation rows for it: the packed row is read from
  // memory once per call and stays in L1 for every tile
  for (int64_t n = n0; n < n1; ++n)
    row_tiles(g.M, [&](auto mt, int64_t m0) { gemm_fused_tile<TYPE, decltype(mt)::value>(g, n, m0); });
}

#if QK_ISA >= 1
// Q4_0 / Q4_1 / Q8_0 rows through the same register unpacking as the fused kernel
template <int TYPE>
static void deq_fast(const uint8_t* src, float* y, int64_t K) {
  constexpr int64_t BB = TYPE == T_Q8_0 ? sizeof(bq8_0) : TYPE == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
#if QK_ISA == 2
  using V = __m512;
  constexpr int NV = 2, W = 16;
#define QK_SET1 _mm512_set1_ps
#define QK_FMA _mm512_fmadd_ps
#define QK_MUL _mm512_mul_ps
#define QK_STORE _mm512_storeu_ps
#else
  using V = __m256;
  constexpr int NV = 4, W = 8;
#define QK_SET1 _mm256_set1_ps
#define QK_FMA _mm256_fmadd_ps
#define QK_MUL _mm256_mul_ps
#define QK_STORE _mm256_storeu_ps
#endif
  for (int64_t i = 0; i < K / 32; ++i, y += 32) {
    const uint8_t* blk = src + i * BB;
    const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
    V f[NV];
    unpack32<TYPE>(blk, f);
    const V d = QK_SET1(h2f(hdr[0]));
    if (TYPE == T_Q4_1) {
      const V m = QK_SET1(h2f(hdr[1]));
      for (int j = 0; j < NV; ++j) QK_STORE(y + j * W, QK_FMA(f[j], d, m));
    } else {
      for (int j = 0; j < NV; ++j) QK_STORE(y + j * W, QK_MUL(f[j], d));
    }
  }
#undef QK_SET1
#undef QK_FMA
#undef QK_MUL
#undef QK_STORE
}
#endif

static void dequant_rows(int type, const uint8_t* W, int64_t rb, int64_t K, const int64_t* rows, int64_t r0,
                         int64_t r1, float* out) {
  deq_fn f = deq_for(type);
#if QK_ISA >= 1
  if (type == T_Q4_0) f = deq_fast<T_Q4_0>;
  if (type == T_Q4_1) f = deq_fast<T_Q4_1>;
  if (type == T_Q8_0) f = deq_fast<T_Q8_0>;
#endif
  for (int64_t r = r0; r < r1; ++r) f(W + (rows ? rows[r] : r) * rb, out + r * K, K);
}

#if QK_ISA == 1
// ---- many rows (AVX2): dequantize a chunk of weight rows into an L2-resident float buffer,
// then a register-blocked micro-kernel: 3 activation rows x 4 weight rows, 12 accumulators,
// 7 loads per 12 FMAs, horizontal sums at the end of K. Every type (dequant_rows). Beats the
// dequantized-tile + BLAS path at 16-64 rows (no packing of the tile, no second pass over it).
static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {  // [sum a, sum b, sum c, sum d]
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 s = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

template <int MR, int NR>
static void micro_many(const float* X, int64_t ldx, const float* Wf, int64_t K, float* out, int64_t ldo) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 x[MR];
    for (int r = 0; r < MR; ++r) x[r] = _mm256_loadu_ps(X + r * ldx + k);
    for (int c = 0; c < NR; ++c) {
      const __m256 w = _mm256_loadu_ps(Wf + c * K + k);
      for (int r = 0; r < MR; ++r) acc[r][c] = _mm256_fmadd_ps(x[r], w, acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    if constexpr (NR == 4) {
      _mm_storeu_ps(out + r * ldo, hsum4x8(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    } else {
      for (int c = 0; c < NR; ++c) out[r * ldo + c] = hsum8(acc[r][c]);
    }
  }
}

template <int MR>
static inline void micro_cols(const float* X, int64_t ldx, const float* Wf, int64_t K, float* out, int64_t ldo,
                              int64_t nc) {
  int64_t c = 0;
  for (; c + 4 <= nc; c += 4) micro_many<MR, 4>(X, ldx, Wf + c * K, K, out + c, ldo);
  switch (nc - c) {
    case 3: micro_many<MR, 3>(X, ldx, Wf + c * K, K, out + c, ldo); break;
    case 2: micro_many<MR, 2>(X, ldx, Wf + c * K, K, out + c, ldo); break;
    case 1: micro_many<MR, 1>(X, ldx, Wf + c * K, K, out + c, ldo); break;
    default: break;
  }
}

// Output columns [n0, n1) for all M rows; K a multiple of 8 (every packed type's block is).
static void gemm_many_rows(const GemmArgs& g, int64_t n0, int64_t n1) {
  const int64_t NC = std::max<int64_t>(4, std::min<int64_t>(64, ((int64_t(48) << 10) / 4 / g.K) & ~int64_t(3)));
  // blocks of activation rows that stay in L2 (~384 KB) while every weight chunk passes over
  // them; each block dequantizes the chunks again (~2% of its multiply-adds at 48+ rows)
  const int64_t MB = std::max<int64_t>(48, ((int64_t(384) << 10) / 4 / g.K) / 3 * 3);
  // F32 rows are already floats: read in place, no copy
  const bool in_place = g.type == T_F32;
  thread_local std::vector<float> buf;
  if (!in_place) buf.resize(NC * g.K);
  for (int64_t mb = 0; mb < g.M; mb += MB) {
    const int64_t me = std::min(g.M, mb + MB);
    for (int64_t c0 = n0; c0 < n1; c0 += NC) {
      const int64_t nc = std::min(NC, n1 - c0);
      const float* wf = reinterpret_cast<const float*>(g.W + c0 * g.rb);
      if (!in_place) {
        dequant_rows(g.type, g.W + c0 * g.rb, g.rb, g.K, nullptr, 0, nc, buf.data());
        wf = buf.data();
      }
      int64_t m = mb;
      for (; m + 3 <= me; m += 3) micro_cols<3>(g.X + m * g.K, g.K, wf, g.K, g.out + m * g.ldo + c0, g.ldo, nc);
      if (me - m == 2) micro_cols<2>(g.X + m * g.K, g.K, wf, g.K, g.out + m * g.ldo + c0, g.ldo, nc);
      if (me - m == 1) micro_cols<1>(g.X + m * g.K, g.K, wf, g.K, g.out + m * g.ldo + c0, g.ldo, nc);
    }
  }
}
#endif

static void gemm_rows(const GemmArgs& g, int64_t n0, int64_t n1) {
  switch (g.type) {
    case T_Q4_0: gemm_fused<T_Q4_0>(g, n0, n1); break;
    case T_Q4_1: gemm_fused<T_Q4_1>(g, n0, n1); break;
    case T_Q8_0: gemm_fused<T_Q8_0>(g, n0, n1); break;
    default: gemm_generic(g, n0, n1); break;
  }
}

// ---- activation-quantized products (the named option "gguf_q8", as llama.cpp's q8 dot products) ----
// Blocks [b0, b1) of 32 floats -> int8 quants round-half-even(x / d) in [-127, 127], d =
// max|x| / 127 (0 for an all-zero block), s = d * sum(quants). x * (1 / d) is clamped to
// +-127 and a NaN product becomes 0, so non-finite or tiny (d below FLT_MIN: 1 / d = inf)
// blocks give bounded quants, never -128 (the sign trick's blind spot); such inputs give
// finite garbage, not NaN. The vector and scalar code give the same bits for every input.
static void quantize_q8_blocks(const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, float* s) {
  for (int64_t b = b0; b < b1; ++b) {
    const float* v = x + b * 32;
#if QK_ISA >= 1
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 f[4], mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      f[j] = _mm256_loadu_ps(v + 8 * j);
      mx = _mm256_max_ps(_mm256_andnot_ps(sign, f[j]), mx);  // a NaN is skipped, as std::max does
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
#else
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
#endif
    const float dd = amax / 127.f, id = dd > 0.f ? 1.f / dd : 0.f;
#if QK_ISA >= 1
    const __m256 iv = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    __m256i i[4];
    for (int j = 0; j < 4; ++j) {
      __m256 y = _mm256_mul_ps(f[j], iv);
      y = _mm256_and_ps(y, _mm256_cmp_ps(y, y, _CMP_ORD_Q));          // NaN -> 0
      y = _mm256_min_ps(_mm256_max_ps(y, lo), hi);                     // +-inf -> +-127
      i[j] = _mm256_cvtps_epi32(y);                                    // MXCSR: round half to even
    }
    // 32 x int32 -> 32 x int8 in order (packs interleave 128-bit lanes; the permute undoes it)
    const __m256i p16 = _mm256_packs_epi32(i[0], i[1]), p16b = _mm256_packs_epi32(i[2], i[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, p16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), p8);
    const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    const int32_t sum = _mm_cvtsi128_si32(s4);
#else
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      float y = v[j] * id;
      y = y == y ? std::min(std::max(y, -127.f), 127.f) : 0.f;
      const int8_t qq = (int8_t)std::nearbyint(y);
      q[b * 32 + j] = qq;
      sum += qq;
    }
#endif
    d[b] = dd;
    s[b] = dd * (float)sum;
  }
}

#if QK_ISA >= 1
// A Q4_0 / Q4_1 / Q8_0 block's 32 quants as bytes in element order, for the integer kernels:
// Q8_0's signed bytes as stored; nibbles as unsigned 0..15 (Q4_0's not centred)
template <int TYPE>
static inline __m256i quant_bytes32(const uint8_t* blk) {
  if (TYPE == T_Q8_0)
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const bq8_0*>(blk)->qs));
  const uint8_t* qs = TYPE == T_Q4_0 ? reinterpret_cast<const bq4_0*>(blk)->qs : reinterpret_cast<const bq4_1*>(blk)->qs;
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1),
                          _mm256_set1_epi8(15));
}
#endif

// The activations were quantized per 32-element block to int8 (Q8A: scale xd = max|x| / 127,
// quants xq, and xs = xd * sum(xq) for Q4_1's min term); each weight block's quants meet them in
// integer multiply-adds, then acc += (d_w * xd) * dot + m_w * xs. Q4_0, Q4_1, Q8_0 only.
template <int TYPE, int MT>
static void gemm_q8_tile(const GemmQ8Args& g, int64_t n, int64_t m0) {
  constexpr int64_t BB = TYPE == T_Q8_0 ? sizeof(bq8_0) : TYPE == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
  const int64_t nb = g.K / 32;
  const uint8_t* row = g.W + n * g.rb;
#if QK_ISA >= 1
  __m256 acc[MT];
  float accm[MT];
  for (int t = 0; t < MT; ++t) {
    acc[t] = _mm256_setzero_ps();
    accm[t] = 0.f;
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* blk = row + i * BB;
    const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
    __m256i w = quant_bytes32<TYPE>(blk);
    if (TYPE == T_Q4_0) w = _mm256_sub_epi8(w, _mm256_set1_epi8(8));
    // maddubs multiplies unsigned by signed bytes: signed weights lend their sign to x
    const __m256i wu = TYPE == T_Q4_1 ? w : _mm256_sign_epi8(w, w);
    const float dw = h2f(hdr[0]);
    for (int t = 0; t < MT; ++t) {
      const int64_t r = (m0 + t) * nb + i;
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.xq + r * 32));
      if (TYPE != T_Q4_1) x = _mm256_sign_epi8(x, w);
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, x), ones);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * g.xd[r]), acc[t]);
    }
    if (TYPE == T_Q4_1) {
      const float mn = h2f(hdr[1]);
      for (int t = 0; t < MT; ++t) accm[t] += mn * g.xs[(m0 + t) * nb + i];
    }
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = hsum8(acc[t]) + accm[t];
#else
  float acc[MT], accm[MT];
  for (int t = 0; t < MT; ++t) acc[t] = accm[t] = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* blk = row + i * BB;
    const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
    int8_t w[32];
    quants32<TYPE>(blk, w);
    const float dw = h2f(hdr[0]);
    for (int t = 0; t < MT; ++t) {
      const int64_t r = (m0 + t) * nb + i;
      const int8_t* x = g.xq + r * 32;
      int32_t s = 0;
      for (int j = 0; j < 32; ++j) s += (int32_t)w[j] * (int32_t)x[j];
      acc[t] += (float)s * (dw * g.xd[r]);
    }
    if (TYPE == T_Q4_1) {
      const float mn = h2f(hdr[1]);
      for (int t = 0; t < MT; ++t) accm[t] += mn * g.xs[(m0 + t) * nb + i];
    }
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = acc[t] + accm[t];
#endif
}

template <int TYPE>
static void gemm_q8(const GemmQ8Args& g, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    row_tiles(g.M, [&](auto mt, int64_t m0) { gemm_q8_tile<TYPE, decltype(mt)::value>(g, n, m0); });
}

static void gemm_q8_rows(const GemmQ8Args& g, int64_t n0, int64_t n1) {
  switch (g.type) {
    case T_Q4_0: gemm_q8<T_Q4_0>(g, n0, n1); break;
    case T_Q4_1: gemm_q8<T_Q4_1>(g, n0, n1); break;
    default: gemm_q8<T_Q8_0>(g, n0, n1); break;
  }
}

#if QK_ISA == 1
// ---- many rows with int8 activations (the named option "gguf_q8"; AVX2, also run on AVX-512 CPUs) ----
// A chunk of output columns is repacked into groups of 8: for each 32-element block and each of
// its 8 steps of 4 elements, 32 bytes whose 32-bit lane c holds column c's 4 quants (unsigned:
// Q4_0 / Q4_1 nibbles 0..15; Q8_0 keeps its signed bytes), beside the 8 columns' scales and
// minimums as floats (Q4_0's min is -8 * scale: its quants are stored uncentred). Every step is
// then one vpmaddubsw per (activation row, group) against 4 activation bytes broadcast to all
// lanes: no horizontal sums, and each lane is an output column. Nibble products (|q x| <= 15 *
// 127) are summed over a block's 8 steps in 16 bits (at most 16 * 1905 = 30480, no overflow);
// Q8_0's (up to 2 * 128 * 127 = 32512 a step: a file may hold -128, whose magnitude vpmaddubsw
// reads as unsigned 128) are widened to 32 bits every step. Per block and row:
// acc += float(sum) * (d_w * d_x) + m_w * (d_x * sum(x quants)).
template <int TYPE>
static void q8_repack8(const uint8_t* W, int64_t rb, int64_t nb, int ncols, uint8_t* Q, float* D, float* Mn) {
  constexpr int64_t BB = TYPE == T_Q8_0 ? sizeof(bq8_0) : TYPE == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i e[8];
    for (int c = 0; c < 8; ++c) {
      if (c >= ncols) {
        e[c] = _mm256_setzero_si256();
        D[b * 8 + c] = Mn[b * 8 + c] = 0.f;
        continue;
      }
      const uint8_t* blk = W + c * rb + b * BB;
      const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
      e[c] = quant_bytes32<TYPE>(blk);
      const float d = h2f(hdr[0]);
      D[b * 8 + c] = d;
      Mn[b * 8 + c] = TYPE == T_Q4_1 ? h2f(hdr[1]) : TYPE == T_Q4_0 ? -8.f * d : 0.f;
    }
    // transpose 8 x 8 dwords: column c's dword s -> step s's lane c
    const __m256i t0 = _mm256_unpacklo_epi32(e[0], e[1]), t1 = _mm256_unpackhi_epi32(e[0], e[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(e[2], e[3]), t3 = _mm256_unpackhi_epi32(e[2], e[3]);
    const __m256i t4 = _mm256_unpacklo_epi32(e[4], e[5]), t5 = _mm256_unpackhi_epi32(e[4], e[5]);
    const __m256i t6 = _mm256_unpacklo_epi32(e[6], e[7]), t7 = _mm256_unpackhi_epi32(e[6], e[7]);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    __m256i* o = reinterpret_cast<__m256i*>(Q + b * 256);
    _mm256_storeu_si256(o + 0, _mm256_permute2x128_si256(u0, u4, 0x20));
    _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(u1, u5, 0x20));
    _mm256_storeu_si256(o + 2, _mm256_permute2x128_si256(u2, u6, 0x20));
    _mm256_storeu_si256(o + 3, _mm256_permute2x128_si256(u3, u7, 0x20));
    _mm256_storeu_si256(o + 4, _mm256_permute2x128_si256(u0, u4, 0x31));
    _mm256_storeu_si256(o + 5, _mm256_permute2x128_si256(u1, u5, 0x31));
    _mm256_storeu_si256(o + 6, _mm256_permute2x128_si256(u2, u6, 0x31));
    _mm256_storeu_si256(o + 7, _mm256_permute2x128_si256(u3, u7, 0x31));
  }
}

// R activation rows x G groups of 8 columns; `Q`, `D`, `Mn` the first group's repacked block 0
// (groups `gs` bytes / `gf` floats apart); `ncols` valid columns in the last group.
template <int TYPE, int R, int G>
static void q8_micro(const GemmQ8Args& g, int64_t m, const uint8_t* Q, const float* D, const float* Mn, int64_t gs,
                     int64_t gf, float* out, int ncols) {
  const int64_t nb = g.K / 32;
  const int8_t* x = g.xq + m * g.K;
  __m256 acc[R][G];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < G; ++c) acc[r][c] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s[R][G];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < G; ++c) s[r][c] = _mm256_setzero_si256();
    const uint8_t* qb = Q + b * 256;
#pragma GCC unroll 8
    for (int st = 0; st < 8; ++st) {
      __m256i w[G], wa[G];
#pragma GCC unroll 8
      for (int c = 0; c < G; ++c) {
        w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + c * gs + st * 32));
        wa[c] = TYPE == T_Q8_0 ? _mm256_sign_epi8(w[c], w[c]) : w[c];
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t xv;
        std::memcpy(&xv, x + r * g.K + b * 32 + st * 4, 4);
        const __m256i xb = _mm256_set1_epi32(xv);
#pragma GCC unroll 8
        for (int c = 0; c < G; ++c) {
          if (TYPE == T_Q8_0)  // signed weights lend their sign to x; 32-bit sums every step
            s[r][c] = _mm256_add_epi32(
                s[r][c], _mm256_madd_epi16(_mm256_maddubs_epi16(wa[c], _mm256_sign_epi8(xb, w[c])), ones));
          else
            s[r][c] = _mm256_add_epi16(s[r][c], _mm256_maddubs_epi16(wa[c], xb));
        }
      }
      // keeps the sums in registers: without it GCC reassociates the adds into a tree of spills
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < G; ++c) __asm__("" : "+x"(s[r][c]));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_broadcast_ss(g.xd + (m + r) * nb + b);
      const __m256 sx = _mm256_broadcast_ss(g.xs + (m + r) * nb + b);
#pragma GCC unroll 8
      for (int c = 0; c < G; ++c) {
        const __m256i i32 = TYPE == T_Q8_0 ? s[r][c] : _mm256_madd_epi16(s[r][c], ones);
        const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(D + c * gf + b * 8), dx);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), sc, acc[r][c]);
        if (TYPE != T_Q8_0) acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(Mn + c * gf + b * 8), sx, acc[r][c]);
      }
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(ncols), lane);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < G; ++c) {
      float* o = out + r * g.ldo + c * 8;
      if (c == G - 1 && ncols < 8)
        _mm256_maskstore_ps(o, tail, acc[r][c]);
      else
        _mm256_storeu_ps(o, acc[r][c]);
    }
}

template <int TYPE, int G>
static void q8_rows(const GemmQ8Args& g, int64_t m0, int64_t m1, const uint8_t* Q, const float* D, const float* Mn,
                    int64_t gs, int64_t gf, float* out, int ncols) {
  int64_t m = m0;
  for (; m + 3 <= m1; m += 3) q8_micro<TYPE, 3, G>(g, m, Q, D, Mn, gs, gf, out + m * g.ldo, ncols);
  if (m1 - m == 2) q8_micro<TYPE, 2, G>(g, m, Q, D, Mn, gs, gf, out + m * g.ldo, ncols);
  if (m1 - m == 1) q8_micro<TYPE, 1, G>(g, m, Q, D, Mn, gs, gf, out + m * g.ldo, ncols);
}

// Output columns [n0, n1) for all M rows (int8 activations in g.xq / g.xd / g.xs).
template <int TYPE>
static void gemm_q8_many_t(const GemmQ8Args& g, int64_t n0, int64_t n1) {
  constexpr int64_t NC = 32;  // columns repacked at a time: 4 groups, nb * 1.3 KB (in L1/L2)
  const int64_t nb = g.K / 32, gs = nb * 256, gf = nb * 8;
  // blocks of activation rows that stay in L2 (~384 KB of int8; at least 48 rows, so more for
  // K > 8192) while every chunk passes over them
  const int64_t MB = std::max<int64_t>(48, ((int64_t(384) << 10) / g.K) / 3 * 3);
  thread_local std::vector<uint8_t> qbuf;
  thread_local std::vector<float> dbuf, mbuf;
  qbuf.resize(NC / 8 * gs);
  dbuf.resize(NC / 8 * gf);
  mbuf.resize(NC / 8 * gf);
  for (int64_t mb = 0; mb < g.M; mb += MB) {
    const int64_t me = std::min(g.M, mb + MB);
    for (int64_t c0 = n0; c0 < n1; c0 += NC) {
      const int64_t nc = std::min(NC, n1 - c0), ng = (nc + 7) / 8;
      for (int64_t j = 0; j < ng; ++j)
        q8_repack8<TYPE>(g.W + (c0 + 8 * j) * g.rb, g.rb, nb, (int)std::min<int64_t>(8, nc - 8 * j),
                         qbuf.data() + j * gs, dbuf.data() + j * gf, mbuf.data() + j * gf);
      int64_t j = 0;
      for (; j + 2 <= ng; j += 2) {
        const int last = (int)std::min<int64_t>(8, nc - 8 * (j + 1));
        q8_rows<TYPE, 2>(g, mb, me, qbuf.data() + j * gs, dbuf.data() + j * gf, mbuf.data() + j * gf, gs, gf,
                         g.out + c0 + 8 * j, last);
      }
      if (j < ng)
        q8_rows<TYPE, 1>(g, mb, me, qbuf.data() + j * gs, dbuf.data() + j * gf, mbuf.data() + j * gf, gs, gf,
                         g.out + c0 + 8 * j, (int)(nc - 8 * j));
    }
  }
}

static void gemm_q8_many(const GemmQ8Args& g, int64_t n0, int64_t n1) {
  switch (g.type) {
    case T_Q4_0: gemm_q8_many_t<T_Q4_0>(g, n0, n1); break;
    case T_Q4_1: gemm_q8_many_t<T_Q4_1>(g, n0, n1); break;
    default: gemm_q8_many_t<T_Q8_0>(g, n0, n1); break;
  }
}
#endif
