// ISA-neutral block code, included by each ISA's kernel file (quant_scalar.h, quant_avx2.h,
// quant_avx512.h) inside that ISA's namespace and target region, after its h2f(): a row of K
// elements dequantized (any supported type), a Q4_0 / Q4_1 / Q8_0 block's quants in element
// order, and the split of activation rows into register tiles. The compiler vectorises these
// loops for the ISA being compiled. No include guard on purpose (one copy per ISA namespace).

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
// Q4_K's or Q5_K's (B: bq4_K, bq5_K: the same d, dmin and scales) sub-block sb (0 .. 7) of a
// super-block as a Q4_1 / Q5_1 block (gguf_q8's integer products): scale d * sc and min
// -dmin * m, both exact in float (11-bit mantissas times 6-bit integers); its 32 quants are the
// low (sb even) or high nibbles of qs[32 (sb / 2) ..], Q5_K's with bit sb of qh[0 .. 31] above
template <class B>
static inline void kmin_sub_scales(const B& b, int sb, float* dw, float* mn) {
  int sc, m;
  scale_min_k4(sb, b.scales, &sc, &m);
  *dw = h2f(b.d) * (float)sc;
  *mn = -h2f(b.dmin) * (float)m;
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
      // two runs of 16 with their four scales fixed (the same products as d * sc * q, in
      // that order): loops the compiler vectorizes (one run of 32 with sc[l / 16] it did
      // not: 0.7-1.0 GB/s of Q6_K on the float kernels, BENCHMARKS section 49)
      for (int is = 0; is < 2; ++is) {
        const float s1 = d * (float)sc[is], s2 = d * (float)sc[is + 2], s3 = d * (float)sc[is + 4],
                    s4 = d * (float)sc[is + 6];
        for (int l = 16 * is; l < 16 * is + 16; ++l) {
          const int q1 = ((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          y[l] = s1 * (float)q1;
          y[l + 32] = s2 * (float)q2;
          y[l + 64] = s3 * (float)q3;
          y[l + 96] = s4 * (float)q4;
        }
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
