// The portable kernels (no vector instructions written out; the compiler's own), included by
// quant_kernels.cpp inside `namespace scalar`. They define the reference arithmetic that every
// vector path must reproduce: the same products as dequantize-then-matmul up to float rounding,
// and for gguf_q8 the same integer sums bit for bit. No include guard on purpose.

static inline float h2f(uint16_t h) { return fp16_to_f32(h); }

#include "quant_dequant.h"

static inline float dot(const float* a, const float* b, int64_t K) {
  int64_t i = 0;
  float p[4] = {0.f, 0.f, 0.f, 0.f};
  for (; i + 4 <= K; i += 4)
    for (int j = 0; j < 4; ++j) p[j] += a[i + j] * b[i + j];
  float s = (p[0] + p[1]) + (p[2] + p[3]);
  for (; i < K; ++i) s += a[i] * b[i];
  return s;
}

// Q4_0 / Q4_1 / Q8_0: per block and row, acc += d * sum(x * q) (+ m * sum(x) for Q4_1, from g.xsum)
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

// Q4_0 / Q4_1 / Q8_0 rows: no faster unpacking than the generic row code here
template <int TYPE>
static void deq_fast(const uint8_t* src, float* y, int64_t K) {
  deq_for(TYPE)(src, y, K);
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
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float dd = amax / 127.f, id = dd > 0.f ? 1.f / dd : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      float y = v[j] * id;
      y = y == y ? std::min(std::max(y, -127.f), 127.f) : 0.f;
      const int8_t qq = (int8_t)std::nearbyint(y);
      q[b * 32 + j] = qq;
      sum += qq;
    }
    d[b] = dd;
    s[b] = dd * (float)sum;
  }
}

// One weight block (w: its 32 quants) in the few-row integer tiles, for MT activation rows from
// m0: acc[t] += (dw * xd) * sum(w * xq), then (MIN: Q4_1's and Q4_K's minimum term) accm[t] +=
// mn * xs
template <int MT, bool MIN>
static inline void q8_block_step(const GemmQ8Args& g, const int8_t* w, float dw, float mn, int64_t m0, int64_t blk,
                                 float (&acc)[MT], float (&accm)[MT]) {
  const int64_t nb = g.K / 32;
  for (int t = 0; t < MT; ++t) {
    const int64_t r = (m0 + t) * nb + blk;
    const int8_t* x = g.xq + r * 32;
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) s += (int32_t)w[j] * (int32_t)x[j];
    acc[t] += (float)s * (dw * g.xd[r]);
  }
  if (MIN)
    for (int t = 0; t < MT; ++t) accm[t] += mn * g.xs[(m0 + t) * nb + blk];
}

// The activations were quantized per 32-element block to int8 (Q8A: scale xd = max|x| / 127,
// quants xq, and xs = xd * sum(xq) for Q4_1's min term); each weight block's quants meet them in
// integer multiply-adds, then acc += (d_w * xd) * dot + m_w * xs. Q4_0, Q4_1, Q8_0 only.
template <int TYPE, int MT>
static void gemm_q8_tile(const GemmQ8Args& g, int64_t n, int64_t m0) {
  constexpr int64_t BB = TYPE == T_Q8_0 ? sizeof(bq8_0) : TYPE == T_Q4_0 ? sizeof(bq4_0) : sizeof(bq4_1);
  const int64_t nb = g.K / 32;
  const uint8_t* row = g.W + n * g.rb;
  float acc[MT], accm[MT];
  for (int t = 0; t < MT; ++t) acc[t] = accm[t] = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* blk = row + i * BB;
    const uint16_t* hdr = reinterpret_cast<const uint16_t*>(blk);
    int8_t w[32];
    quants32<TYPE>(blk, w);
    constexpr bool q41 = TYPE == T_Q4_1;
    q8_block_step<MT, q41>(g, w, h2f(hdr[0]), q41 ? h2f(hdr[1]) : 0.f, m0, i, acc, accm);
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = acc[t] + accm[t];
}

// Q4_K / Q5_K with int8 activations: each super-block's 8 sub-blocks are Q4_1 / Q5_1 blocks
// (kmin_sub_scales; Q5_K's fifth bit: bit sb of qh[l]) against the activations' q8 blocks of 32,
// as gemm_q8_tile's Q4_1
template <int TYPE, int MT>
static void gemm_q8_tile_kmin(const GemmQ8Args& g, int64_t n, int64_t m0) {
  using B = std::conditional_t<TYPE == T_Q5_K, bq5_K, bq4_K>;
  const int64_t ns = g.K / 256;
  const B* row = reinterpret_cast<const B*>(g.W + n * g.rb);
  float acc[MT], accm[MT];
  for (int t = 0; t < MT; ++t) acc[t] = accm[t] = 0.f;
  for (int64_t i = 0; i < ns; ++i)
    for (int sb = 0; sb < 8; ++sb) {
      float dw, mn;
      kmin_sub_scales(row[i], sb, &dw, &mn);
      const uint8_t* qs = row[i].qs + 32 * (sb / 2);
      int8_t w[32];
      for (int j = 0; j < 32; ++j) {
        w[j] = int8_t((qs[j] >> (4 * (sb % 2))) & 15);
        if constexpr (TYPE == T_Q5_K) w[j] = int8_t(w[j] | (((row[i].qh[j] >> sb) & 1) << 4));
      }
      q8_block_step<MT, true>(g, w, dw, mn, m0, i * 8 + sb, acc, accm);
    }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = acc[t] + accm[t];
}

// Q6_K with int8 activations: per 32-quant block, centred quants (q - 32), the two halves' sums
// times their int8 scales in int32 (exact), then acc += float(sum) * (d * xd) (quant_avx2_q8.h's
// q6k_block_q has the layout)
template <int MT>
static void gemm_q8_tile_q6k(const GemmQ8Args& g, int64_t n, int64_t m0) {
  const int64_t nb = g.K / 32, ns = g.K / 256;
  const bq6_K* row = reinterpret_cast<const bq6_K*>(g.W + n * g.rb);
  float acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = 0.f;
  for (int64_t i = 0; i < ns; ++i) {
    const bq6_K& b = row[i];
    const float d = h2f(b.d);
    for (int j = 0; j < 8; ++j) {
      const int hn = j / 4, jj = j % 4;
      int8_t w[32];
      for (int l = 0; l < 32; ++l) {
        const int lo = (b.ql[64 * hn + 32 * (jj % 2) + l] >> (4 * (jj / 2))) & 15;
        const int hi = (b.qh[32 * hn + l] >> (2 * jj)) & 3;
        w[l] = int8_t((lo | (hi << 4)) - 32);
      }
      for (int t = 0; t < MT; ++t) {
        const int64_t r = (m0 + t) * nb + i * 8 + j;
        const int8_t* x = g.xq + r * 32;
        int32_t sa = 0, sb = 0;
        for (int l = 0; l < 16; ++l) sa += (int32_t)w[l] * (int32_t)x[l];
        for (int l = 16; l < 32; ++l) sb += (int32_t)w[l] * (int32_t)x[l];
        acc[t] += (float)(b.scales[2 * j] * sa + b.scales[2 * j + 1] * sb) * (d * g.xd[r]);
      }
    }
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = acc[t];
}

// no K-quant or Q5_0 / Q5_1 tiles here: their rows go through a dequantized row and dot()
static bool gemm_avx2_tiles(const GemmArgs&, int64_t, int64_t) { return false; }

#include "quant_loops.h"
