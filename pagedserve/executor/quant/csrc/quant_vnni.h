// AVX512-VNNI kernels of the act_q8 products (the named option "gguf_q8"): vpdpbusd, four
// unsigned x signed byte products summed into each 32-bit lane in one instruction, where the
// AVX2 kernels take vpmaddubsw + vpmaddwd (few rows) or vpmaddubsw + 16-bit adds (many rows).
// Included once by quant_kernels.cpp, inside namespace avx512_vnni and a target region that
// adds avx512vnni to the AVX-512 set; the AVX-512 build's helpers (q8_weight_block, hsum8,
// transpose8x8_epi32, row_tiles, h2f) come from `using namespace avx512`. Q4_0, Q4_1, Q8_0,
// Q4_K / Q5_K (their sub-blocks of 32 as Q4_1 / Q5_1 blocks; 1-2 rows run the AVX2 tile,
// gemm_q8_rows says why) and Q6_K (many rows only: its few rows run the AVX2 tile, or its copy's
// kernel, quant_rows16_q6k_vnni.h).
// No include guard on purpose.
//
// Same numbers as the AVX2 kernels, bit for bit: every integer block sum is exact in both
// (no saturation: nibble x int8 pairs are at most 2 * 15 * 127, Q5_K's 2 * 31 * 127, Q8_0's at
// most 2 * 128 * 127, vpdpbusd does not saturate at all, and Q6_K's half-block sums times an int8
// scale stay within 16 * 32 * 127 * 128), and the float steps that follow are the AVX2 kernels' own, lane for lane
// (tests compare the outputs' bits).

// ---- few rows: two output columns per 512-bit register ----------------------------------
// Lanes 0-7 hold column n's eight partial sums and lanes 8-15 column n + 1's, exactly as the
// AVX2 kernel's one 256-bit accumulator per column: each activation row's 32 quants are
// broadcast to both halves, meet both columns' blocks in one vpdpbusd, and the halves are
// summed at the end as the AVX2 kernel sums its register (hsum8).
template <int TYPE, int MT>
static void gemm_q8_tile2(const GemmQ8Args& g, int64_t n, int64_t m0) {
  constexpr bool MIN = q8_has_min(TYPE);
  const int64_t nb = g.K / 32;
  const uint8_t* row0 = g.W + n * g.rb;
  const uint8_t* row1 = row0 + g.rb;
  __m512 acc[MT];
  float accm0[MT], accm1[MT];
  for (int t = 0; t < MT; ++t) {
    acc[t] = _mm512_setzero_ps();
    accm0[t] = accm1[t] = 0.f;
  }
  for (int64_t i = 0; i < nb; ++i) {
    const Q8Block b0 = q8_weight_block<TYPE>(row0, i), b1 = q8_weight_block<TYPE>(row1, i);
    __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(b0.q), b1.q, 1);
    if (TYPE == T_Q4_0) w = _mm512_sub_epi8(w, _mm512_set1_epi8(8));
    // vpdpbusd multiplies unsigned by signed bytes: signed weights lend their sign to x
    // (abs(-128) is 0x80, read as unsigned 128: exact, as in the AVX2 kernel)
    const __m512i wu = MIN ? w : _mm512_abs_epi8(w);
    const __mmask64 neg = MIN ? 0 : _mm512_movepi8_mask(w);
    const __m512 vdw = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(b0.d)), _mm256_set1_ps(b1.d), 1);
    for (int t = 0; t < MT; ++t) {
      const int64_t r = (m0 + t) * nb + i;
      __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.xq + r * 32)));
      if (!MIN) x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, x);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(vdw, _mm512_set1_ps(g.xd[r])), acc[t]);
    }
    if (MIN)
      for (int t = 0; t < MT; ++t) {
        accm0[t] = std::fma(b0.mn, g.xs[(m0 + t) * nb + i], accm0[t]);
        accm1[t] = std::fma(b1.mn, g.xs[(m0 + t) * nb + i], accm1[t]);
      }
  }
  for (int t = 0; t < MT; ++t) {
    float* o = g.out + (m0 + t) * g.ldo + n;
    o[0] = hsum8(_mm512_castps512_ps256(acc[t])) + accm0[t];
    o[1] = hsum8(_mm512_extractf32x8_ps(acc[t], 1)) + accm1[t];
  }
}

// One column (Q8_0's, long rows', an odd last one): the AVX2 kernel with vpdpbusd on 256-bit
// registers (AVX512VL).
template <int TYPE, int MT>
static void gemm_q8_tile1(const GemmQ8Args& g, int64_t n, int64_t m0) {
  constexpr bool MIN = q8_has_min(TYPE);
  const int64_t nb = g.K / 32;
  const uint8_t* row = g.W + n * g.rb;
  __m256 acc[MT];
  float accm[MT];
  for (int t = 0; t < MT; ++t) {
    acc[t] = _mm256_setzero_ps();
    accm[t] = 0.f;
  }
  for (int64_t i = 0; i < nb; ++i) {
    const Q8Block b = q8_weight_block<TYPE>(row, i);
    const __m256i w = TYPE == T_Q4_0 ? _mm256_sub_epi8(b.q, _mm256_set1_epi8(8)) : b.q;
    const __m256i wu = MIN ? w : _mm256_sign_epi8(w, w);
    for (int t = 0; t < MT; ++t) {
      const int64_t r = (m0 + t) * nb + i;
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.xq + r * 32));
      if (!MIN) x = _mm256_sign_epi8(x, w);
      const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wu, x);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(b.d * g.xd[r]), acc[t]);
    }
    if (MIN)
      for (int t = 0; t < MT; ++t) accm[t] = std::fma(b.mn, g.xs[(m0 + t) * nb + i], accm[t]);
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = hsum8(acc[t]) + accm[t];
}

// Q4_K / Q5_K, one column: each super-block's sub-blocks (Q4_1 / Q5_1 blocks, kmin_sub_scales)
// in pairs, one 32-byte load of qs a pair (its low and high nibbles; Q5_K's fifth bits from one
// load of qh a super-block), as the AVX2 tile (gemm_q8_tile_kmin) with vpdpbusd for its
// vpmaddubsw + vpmaddwd
template <int TYPE, int MT>
static void gemm_q8_tile1_kmin(const GemmQ8Args& g, int64_t n, int64_t m0) {
  using B = std::conditional_t<TYPE == T_Q5_K, bq5_K, bq4_K>;
  const int64_t nb = g.K / 32, ns = g.K / 256;
  const B* row = reinterpret_cast<const B*>(g.W + n * g.rb);
  __m256 acc[MT];
  float accm[MT];
  for (int t = 0; t < MT; ++t) {
    acc[t] = _mm256_setzero_ps();
    accm[t] = 0.f;
  }
  const __m256i m4 = _mm256_set1_epi8(15);
  for (int64_t i = 0; i < ns; ++i) {
    __m256i qh = _mm256_setzero_si256();
    if constexpr (TYPE == T_Q5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[i].qh));
    for (int p = 0; p < 4; ++p) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[i].qs + 32 * p));
      __m256i w[2] = {_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4)};
      if constexpr (TYPE == T_Q5_K)
        for (int h = 0; h < 2; ++h) w[h] = _mm256_or_si256(w[h], q5k_high(qh, 2 * p + h));
      for (int h = 0; h < 2; ++h) {
        float dw, mn;
        kmin_sub_scales(row[i], 2 * p + h, &dw, &mn);
        const int64_t blk = i * 8 + 2 * p + h;
        for (int t = 0; t < MT; ++t) {
          const int64_t r = (m0 + t) * nb + blk;
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.xq + r * 32));
          const __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[h], x);
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(dw * g.xd[r]), acc[t]);
        }
        for (int t = 0; t < MT; ++t) accm[t] = std::fma(mn, g.xs[(m0 + t) * nb + blk], accm[t]);
      }
    }
  }
  for (int t = 0; t < MT; ++t) g.out[(m0 + t) * g.ldo + n] = hsum8(acc[t]) + accm[t];
}

// Q4_0 / Q4_1 in column pairs where a row is short (rows 360 bytes apart, K = 576: 4-5 rows
// 1.1-1.2x the AVX2 tile, 1-2 rows even), else one column at a time: with rows 960 bytes or more
// apart the pairs stream their weights from memory 2x slower than the AVX2 tile at 1 row (Zen 4:
// Q4_1 576 x 1536 49 vs 24 us, 5632 x 2048 609 vs 271 us), one column at a time 1.0-1.1x faster.
// Q8_0's pairs were as slow from memory (the 49152 x 576 LM head at 1 row: 1852 vs 663 us; AVX2
// 621), and software prefetch did not mend it. Q4_K / Q5_K one column at a time
// (gemm_q8_tile1_kmin; Q4_K's column pairs were as slow from memory), from 3 rows: gemm_q8_rows
// gives 1-2 to the AVX2 tile.
constexpr int64_t Q8_PAIR_MAX_ROW_BYTES = 512;

template <int TYPE>
static void gemm_q8_vnni(const GemmQ8Args& g, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if ((TYPE == T_Q4_0 || TYPE == T_Q4_1) && g.rb <= Q8_PAIR_MAX_ROW_BYTES)
    for (; n + 2 <= n1; n += 2)
      row_tiles(g.M, [&](auto mt, int64_t m0) { gemm_q8_tile2<TYPE, decltype(mt)::value>(g, n, m0); });
  for (; n < n1; ++n)
    row_tiles(g.M, [&](auto mt, int64_t m0) {
      if constexpr (TYPE == T_Q4_K || TYPE == T_Q5_K)
        gemm_q8_tile1_kmin<TYPE, decltype(mt)::value>(g, n, m0);
      else
        gemm_q8_tile1<TYPE, decltype(mt)::value>(g, n, m0);
    });
}

static void gemm_q8_rows(const GemmQ8Args& g, int64_t n0, int64_t n1) {
  switch (g.type) {
    case T_Q4_K:
    case T_Q5_K:  // 1-2 rows: the AVX2 tile (Q4_K: vpdpbusd's took 1.03-1.10x its time; at 3-5 rows 0.67-0.93x)
      if (g.M <= 2)
        avx512::gemm_q8_rows(g, n0, n1);
      else if (g.type == T_Q4_K)
        gemm_q8_vnni<T_Q4_K>(g, n0, n1);
      else
        gemm_q8_vnni<T_Q5_K>(g, n0, n1);
      break;
    case T_Q6_K:  // (a layer without a copy: quant_rows16_q6k_vnni.h reads it) the AVX2 tile: a
      avx512::gemm_q8_rows(g, n0, n1);  // vpdpbusd + vpmulld one took 1.02-1.45x its time at 1-5 rows, so was dropped
      break;
    case T_Q4_0: gemm_q8_vnni<T_Q4_0>(g, n0, n1); break;
    case T_Q4_1: gemm_q8_vnni<T_Q4_1>(g, n0, n1); break;
    default: gemm_q8_vnni<T_Q8_0>(g, n0, n1); break;
  }
}

// ---- many rows: 16 output columns per register ----------------------------------------------
// The AVX2 many-row kernel's layout, 16 lanes wide: a chunk of output columns is repacked into
// groups of 16; for each 32-element block and each of its 8 steps of 4 elements, 64 bytes whose
// 32-bit lane c holds column c's 4 quants as unsigned bytes (Q4_0 / Q4_1 / Q4_K nibbles 0..15,
// Q5_K's 0..31;
// Q8_0's signed bytes + 128, i.e. xor 0x80), beside the 16 columns' scales and minimums as floats
// (Q4_0's min is -8 * scale). Each step is one vpdpbusd per (activation row, group) against
// the row's 4 quants broadcast to every lane, summed in 32 bits. Q8_0's +128 is taken back
// exactly: its block sums start from -128 * sum(x quants) (GemmQ8Args::xc). Per block and row:
// acc += float(sum) * (d_w * d_x) + m_w * (d_x * sum(x quants)), each lane the AVX2 kernel's.
// Q6_K's quants go in uncentred (0..63): each half of a block starts from -32 * sum(its 16 x
// quants) (xc, q8_half_corr), which makes it the centred sum, then it is multiplied by the
// half's scale (vpmulld; `S`: per block, the 16 columns' first-half scales, then the second's).
// The repack reads 8 columns' rows at a time, as the AVX2 one does. Reading all 16 side by side
// (the first version) took 1.04-1.25x the time on Zen 4 with weights from memory (Q4_K 5632 x
// 2048 at 6-64 rows, Q4_1 / Q8_0 at 1536 x 576), and made Q4_K slower than the AVX2 kernel below
// ~24 rows; now it is 1.04-1.18x faster than the AVX2 kernel from 6 rows.
template <int TYPE>
static void q8_repack16(const uint8_t* W, int64_t rb, int64_t nb, int ncols, uint8_t* Q, float* D, float* Mn,
                        int32_t* S) {
  for (int h = 0; h < 2; ++h)  // 8 columns' rows at a time (the AVX2 repack's 8 streams)
    for (int64_t b = 0; b < nb; ++b) {
      __m256i e[8];
      for (int c = 0; c < 8; ++c) {
        const int col = 8 * h + c;
        if (col >= ncols) {
          e[c] = TYPE == T_Q8_0 ? _mm256_set1_epi8((char)0x80) : _mm256_setzero_si256();  // quants 0
          D[b * 16 + col] = Mn[b * 16 + col] = 0.f;
          if (TYPE == T_Q6_K) S[b * 32 + col] = S[b * 32 + 16 + col] = 0;
          continue;
        }
        const Q8Block k = q8_weight_block<TYPE>(W + col * rb, b);
        e[c] = TYPE == T_Q8_0 ? _mm256_xor_si256(k.q, _mm256_set1_epi8((char)0x80)) : k.q;
        D[b * 16 + col] = k.d;
        Mn[b * 16 + col] = TYPE == T_Q4_0 ? -8.f * k.d : k.mn;
        if (TYPE == T_Q6_K) {
          S[b * 32 + col] = k.sa;
          S[b * 32 + 16 + col] = k.sb;
        }
      }
      __m256i o[8];
      transpose8x8_epi32(e, o);
      for (int st = 0; st < 8; ++st)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(Q + b * 512 + st * 64 + h * 32), o[st]);
    }
}

// R activation rows x G groups of 16 columns; `Q`, `D`, `Mn` the first group's repacked block 0
// (groups `gs` bytes / `gf` floats apart); `ncols` valid columns in the last group.
template <int TYPE, int R, int G>
static void q8_micro16(const GemmQ8Args& g, int64_t m, const uint8_t* Q, const float* D, const float* Mn,
                       const int32_t* S, int64_t gs, int64_t gf, float* out, int ncols) {
  const int64_t nb = g.K / 32;
  const int8_t* x = g.xq + m * g.K;
  __m512 acc[R][G];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < G; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i s[R][G], s6[R][G];  // (s6: Q6_K's first half, scaled)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i s0 = TYPE == T_Q8_0   ? _mm512_set1_epi32(g.xc[(m + r) * nb + b])
                         : TYPE == T_Q6_K ? _mm512_set1_epi32(g.xc[((m + r) * nb + b) * 2])
                                          : _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < G; ++c) s[r][c] = s0;
    }
    const uint8_t* qb = Q + b * 512;
#pragma GCC unroll 8
    for (int st = 0; st < 8; ++st) {
      if (TYPE == T_Q6_K && st == 4)  // the first half times its scales; the second half's start
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i s1 = _mm512_set1_epi32(g.xc[((m + r) * nb + b) * 2 + 1]);
#pragma GCC unroll 8
          for (int c = 0; c < G; ++c) {
            s6[r][c] = _mm512_mullo_epi32(s[r][c], _mm512_loadu_si512(S + c * 2 * gf + b * 32));
            s[r][c] = s1;
          }
        }
      __m512i w[G];
#pragma GCC unroll 8
      for (int c = 0; c < G; ++c) w[c] = _mm512_loadu_si512(qb + c * gs + st * 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t xv;
        std::memcpy(&xv, x + r * g.K + b * 32 + st * 4, 4);
        const __m512i xb = _mm512_set1_epi32(xv);
#pragma GCC unroll 8
        for (int c = 0; c < G; ++c) s[r][c] = _mm512_dpbusd_epi32(s[r][c], w[c], xb);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(g.xd[(m + r) * nb + b]);
      const __m512 sx = _mm512_set1_ps(g.xs[(m + r) * nb + b]);
#pragma GCC unroll 8
      for (int c = 0; c < G; ++c) {
        const __m512 sc = _mm512_mul_ps(_mm512_loadu_ps(D + c * gf + b * 16), dx);
        __m512i i32 = s[r][c];
        if (TYPE == T_Q6_K)  // the second half times its scales
          i32 = _mm512_add_epi32(s6[r][c], _mm512_mullo_epi32(i32, _mm512_loadu_si512(S + c * 2 * gf + b * 32 + 16)));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32), sc, acc[r][c]);
        if (q8_many_min_term(TYPE))
          acc[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(Mn + c * gf + b * 16), sx, acc[r][c]);
      }
    }
  }
  const __mmask16 tail = (__mmask16)((1u << ncols) - 1u);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < G; ++c) {
      float* o = out + r * g.ldo + c * 16;
      if (c == G - 1 && ncols < 16)
        _mm512_mask_storeu_ps(o, tail, acc[r][c]);
      else
        _mm512_storeu_ps(o, acc[r][c]);
    }
}

constexpr int Q8_MR = 4;  // activation rows per micro-kernel call

template <int TYPE, int G>
static void q8_rows16(const GemmQ8Args& g, int64_t m0, int64_t m1, const uint8_t* Q, const float* D, const float* Mn,
                      const int32_t* S, int64_t gs, int64_t gf, float* out, int ncols) {
  int64_t m = m0;
  for (; m + Q8_MR <= m1; m += Q8_MR) q8_micro16<TYPE, Q8_MR, G>(g, m, Q, D, Mn, S, gs, gf, out + m * g.ldo, ncols);
  switch (m1 - m) {
    case 3: q8_micro16<TYPE, 3, G>(g, m, Q, D, Mn, S, gs, gf, out + m * g.ldo, ncols); break;
    case 2: q8_micro16<TYPE, 2, G>(g, m, Q, D, Mn, S, gs, gf, out + m * g.ldo, ncols); break;
    case 1: q8_micro16<TYPE, 1, G>(g, m, Q, D, Mn, S, gs, gf, out + m * g.ldo, ncols); break;
    default: break;
  }
}

// Output columns [n0, n1) for all M rows (int8 activations in g.xq / g.xd / g.xs / g.xc).
template <int TYPE>
static void gemm_q8_many_t(const GemmQ8Args& g, int64_t n0, int64_t n1) {
  constexpr int64_t NC = 32;  // columns repacked at a time: 2 groups, nb * 2.3 KB (in L1/L2)
  const int64_t nb = g.K / 32, gs = nb * 512, gf = nb * 16;
  const int64_t MB = std::max<int64_t>(48, ((int64_t(384) << 10) / g.K) / 12 * 12);
  thread_local std::vector<uint8_t> qbuf;
  thread_local std::vector<float> dbuf, mbuf;
  thread_local std::vector<int32_t> sbuf;
  qbuf.resize(NC / 16 * gs);
  dbuf.resize(NC / 16 * gf);
  mbuf.resize(NC / 16 * gf);
  sbuf.resize(NC / 16 * 2 * gf);  // (Q6_K's scales; sized for every type, so its offsets stay in range)
  for (int64_t mb = 0; mb < g.M; mb += MB) {
    const int64_t me = std::min(g.M, mb + MB);
    for (int64_t c0 = n0; c0 < n1; c0 += NC) {
      const int64_t nc = std::min(NC, n1 - c0), ng = (nc + 15) / 16;
      for (int64_t j = 0; j < ng; ++j)
        q8_repack16<TYPE>(g.W + (c0 + 16 * j) * g.rb, g.rb, nb, (int)std::min<int64_t>(16, nc - 16 * j),
                          qbuf.data() + j * gs, dbuf.data() + j * gf, mbuf.data() + j * gf,
                          sbuf.data() + j * 2 * gf);
      if (ng == 2)
        q8_rows16<TYPE, 2>(g, mb, me, qbuf.data(), dbuf.data(), mbuf.data(), sbuf.data(), gs, gf, g.out + c0,
                           (int)(nc - 16));
      else
        q8_rows16<TYPE, 1>(g, mb, me, qbuf.data(), dbuf.data(), mbuf.data(), sbuf.data(), gs, gf, g.out + c0,
                           (int)nc);
    }
  }
}

static void gemm_q8_many(const GemmQ8Args& g, int64_t n0, int64_t n1) {
  switch (g.type) {
    case T_Q4_K: gemm_q8_many_t<T_Q4_K>(g, n0, n1); break;
    case T_Q5_K: gemm_q8_many_t<T_Q5_K>(g, n0, n1); break;
    case T_Q6_K: gemm_q8_many_t<T_Q6_K>(g, n0, n1); break;
    case T_Q4_0: gemm_q8_many_t<T_Q4_0>(g, n0, n1); break;
    case T_Q4_1: gemm_q8_many_t<T_Q4_1>(g, n0, n1); break;
    default: gemm_q8_many_t<T_Q8_0>(g, n0, n1); break;
  }
}

// -128 * sum of each 32-quant block of x (Q8_0's start value in the many-row kernel)
static void q8_block_corr(const int8_t* xq, int64_t b0, int64_t b1, int32_t* xc) {
  const __m256i ones = _mm256_set1_epi8(1);
  for (int64_t b = b0; b < b1; ++b) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
    const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, x);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    xc[b] = -128 * _mm_cvtsi128_si32(s4);
  }
}
