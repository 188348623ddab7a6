// The gguf_q8 many-row kernel in AVX2 instructions, included by quant_avx2.h (namespace avx2)
// and, for AVX-VNNI, once more by quant_kernels.cpp (namespace avx_vnni, QK_AVX_VNNI 1: each
// step's products one vpdpbusd into 32-bit sums, quant_avx2_q8.h's dot_add). Needs
// quant_avx2_q8.h. No include guard on purpose.

// ---- many rows with int8 activations (the named option "gguf_q8"; AVX2, also run on AVX-512 CPUs) ----
// A chunk of output columns is repacked into groups of 8: for each 32-element block and each of
// its 8 steps of 4 elements, 32 bytes whose 32-bit lane c holds column c's 4 quants (unsigned:
// Q4_0 / Q4_1 / Q4_K nibbles 0..15, Q5_K's quants 0..31; Q8_0 keeps its signed bytes), beside the
// 8 columns' scales and minimums as floats (Q4_0's min is -8 * scale: its quants are stored
// uncentred; Q4_K's and Q5_K's sub-blocks of 32 are such blocks, kmin_sub_scales). Every step is
// then one vpmaddubsw per (activation row, group) against 4 activation bytes broadcast to all
// lanes: no horizontal sums, and each lane is an output column. Nibble products (|q x| <= 15 *
// 127) are summed over a block's 8 steps in 16 bits (at most 16 * 1905 = 30480, no overflow),
// Q5_K's (|q x| <= 31 * 127) over each half of a block, then widened (at most 8 * 3937 = 31496);
// Q8_0's (up to 2 * 128 * 127 = 32512 a step: a file may hold -128, whose magnitude vpmaddubsw
// reads as unsigned 128) are widened to 32 bits every step. Q6_K's centred quants (|q| <= 32, signed
// as Q8_0's) are summed in 16 bits over each half of a block (at most 4 * 2 * 32 * 127 = 32512),
// then times the half's int8 scale in vpmaddwd (`S`: per block, the 8 columns' first-half scales,
// then their second-half ones, each in both 16-bit halves of a dword). Per block and row:
// acc += float(sum) * (d_w * d_x) + m_w * (d_x * sum(x quants)) (Q6_K: d_w = d, no m_w term).
template <int TYPE>
static void q8_repack8(const uint8_t* W, int64_t rb, int64_t nb, int ncols, uint8_t* Q, float* D, float* Mn,
                       int32_t* S) {
  for (int64_t b = 0; b < nb; ++b) {
    __m256i e[8];
    for (int c = 0; c < 8; ++c) {
      if (c >= ncols) {
        e[c] = _mm256_setzero_si256();
        D[b * 8 + c] = Mn[b * 8 + c] = 0.f;
        if (TYPE == T_Q6_K) S[b * 16 + c] = S[b * 16 + 8 + c] = 0;
        continue;
      }
      const Q8Block k = q8_weight_block<TYPE>(W + c * rb, b);
      e[c] = TYPE == T_Q6_K ? q6k_centred(k.q) : k.q;
      D[b * 8 + c] = k.d;
      Mn[b * 8 + c] = TYPE == T_Q4_0 ? -8.f * k.d : k.mn;
      if (TYPE == T_Q6_K) {
        S[b * 16 + c] = (int32_t)(((uint32_t)(uint16_t)k.sa << 16) | (uint16_t)k.sa);
        S[b * 16 + 8 + c] = (int32_t)(((uint32_t)(uint16_t)k.sb << 16) | (uint16_t)k.sb);
      }
    }
    __m256i o[8];
    transpose8x8_epi32(e, o);
    for (int st = 0; st < 8; ++st) _mm256_storeu_si256(reinterpret_cast<__m256i*>(Q + b * 256) + st, o[st]);
  }
}

// R activation rows x G groups of 8 columns; `Q`, `D`, `Mn` the first group's repacked block 0
// (groups `gs` bytes / `gf` floats apart); `ncols` valid columns in the last group.
template <int TYPE, int R, int G>
static void q8_micro(const GemmQ8Args& g, int64_t m, const uint8_t* Q, const float* D, const float* Mn,
                     const int32_t* S, int64_t gs, int64_t gf, float* out, int ncols) {
  constexpr bool SIGNED = TYPE == T_Q8_0 || TYPE == T_Q6_K;
  const int64_t nb = g.K / 32;
  const int8_t* x = g.xq + m * g.K;
  __m256 acc[R][G];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < G; ++c) acc[r][c] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s[R][G], s6[R][G];  // (s6: the first half in 32 bits: Q6_K's scaled, Q5_K's widened)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < G; ++c) s[r][c] = _mm256_setzero_si256();
    const uint8_t* qb = Q + b * 256;
#pragma GCC unroll 8
    for (int st = 0; st < 8; ++st) {
      if ((TYPE == T_Q6_K || TYPE == T_Q5_K) && st == 4)  // the first half's 16-bit sums in 32 bits
#pragma GCC unroll 8
        for (int c = 0; c < G; ++c) {  // (times Q6_K's scales)
          const __m256i sa =
              TYPE == T_Q5_K ? ones : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(S + c * 2 * gf + b * 16));
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            s6[r][c] = TYPE == T_Q5_K ? dot_widen(s[r][c]) : _mm256_madd_epi16(s[r][c], sa);
            s[r][c] = _mm256_setzero_si256();
          }
        }
      __m256i w[G], wa[G];
#pragma GCC unroll 8
      for (int c = 0; c < G; ++c) {
        w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + c * gs + st * 32));
        wa[c] = SIGNED ? _mm256_sign_epi8(w[c], w[c]) : w[c];
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t xv;
        std::memcpy(&xv, x + r * g.K + b * 32 + st * 4, 4);
        const __m256i xb = _mm256_set1_epi32(xv);
#pragma GCC unroll 8
        for (int c = 0; c < G; ++c) {
          if (TYPE == T_Q8_0 && !kVnni)  // signed weights lend their sign to x; 32-bit sums every step
            s[r][c] = _mm256_add_epi32(
                s[r][c], _mm256_madd_epi16(_mm256_maddubs_epi16(wa[c], _mm256_sign_epi8(xb, w[c])), ones));
          else if (TYPE == T_Q6_K)  // (16-bit sums: each half's times its scale in vpmaddwd)
            s[r][c] = _mm256_add_epi16(s[r][c], _mm256_maddubs_epi16(wa[c], _mm256_sign_epi8(xb, w[c])));
          else  // AVX-VNNI: Q8_0's in 32 bits as well
            s[r][c] = dot_add(s[r][c], wa[c], TYPE == T_Q8_0 ? _mm256_sign_epi8(xb, w[c]) : xb);
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
        __m256i i32 = TYPE == T_Q8_0 ? s[r][c] : dot_widen(s[r][c]);
        if (TYPE == T_Q6_K) {
          const __m256i sb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(S + c * 2 * gf + b * 16 + 8));
          i32 = _mm256_add_epi32(s6[r][c], _mm256_madd_epi16(s[r][c], sb));
        } else if (TYPE == T_Q5_K) {
          i32 = _mm256_add_epi32(s6[r][c], i32);
        }
        const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(D + c * gf + b * 8), dx);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), sc, acc[r][c]);
        if (q8_many_min_term(TYPE))
          acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(Mn + c * gf + b * 8), sx, acc[r][c]);
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
                    const int32_t* S, int64_t gs, int64_t gf, float* out, int ncols) {
  int64_t m = m0;
  for (; m + 3 <= m1; m += 3) q8_micro<TYPE, 3, G>(g, m, Q, D, Mn, S, gs, gf, out + m * g.ldo, ncols);
  if (m1 - m == 2) q8_micro<TYPE, 2, G>(g, m, Q, D, Mn, S, gs, gf, out + m * g.ldo, ncols);
  if (m1 - m == 1) q8_micro<TYPE, 1, G>(g, m, Q, D, Mn, S, gs, gf, out + m * g.ldo, ncols);
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
  thread_local std::vector<int32_t> sbuf;
  qbuf.resize(NC / 8 * gs);
  dbuf.resize(NC / 8 * gf);
  mbuf.resize(NC / 8 * gf);
  sbuf.resize(NC / 8 * 2 * gf);  // (Q6_K's scales; sized for every type, so its offsets stay in range)
  for (int64_t mb = 0; mb < g.M; mb += MB) {
    const int64_t me = std::min(g.M, mb + MB);
    for (int64_t c0 = n0; c0 < n1; c0 += NC) {
      const int64_t nc = std::min(NC, n1 - c0), ng = (nc + 7) / 8;
      for (int64_t j = 0; j < ng; ++j)
        q8_repack8<TYPE>(g.W + (c0 + 8 * j) * g.rb, g.rb, nb, (int)std::min<int64_t>(8, nc - 8 * j),
                         qbuf.data() + j * gs, dbuf.data() + j * gf, mbuf.data() + j * gf,
                         sbuf.data() + j * 2 * gf);
      int64_t j = 0;
      for (; j + 2 <= ng; j += 2) {
        const int last = (int)std::min<int64_t>(8, nc - 8 * (j + 1));
        q8_rows<TYPE, 2>(g, mb, me, qbuf.data() + j * gs, dbuf.data() + j * gf, mbuf.data() + j * gf,
                         sbuf.data() + j * 2 * gf, gs, gf, g.out + c0 + 8 * j, last);
      }
      if (j < ng)
        q8_rows<TYPE, 1>(g, mb, me, qbuf.data() + j * gs, dbuf.data() + j * gf, mbuf.data() + j * gf,
                         sbuf.data() + j * 2 * gf, gs, gf, g.out + c0 + 8 * j, (int)(nc - 8 * j));
    }
  }
}

static void gemm_q8_many(const GemmQ8Args& g, int64_t n0, int64_t n1) {
  switch (g.type) {
    case T_Q4_K: gemm_q8_many_t<T_Q4_K>(g, n0, n1); break;  // its sub-blocks as Q4_1 blocks
    case T_Q5_K: gemm_q8_many_t<T_Q5_K>(g, n0, n1); break;  // its sub-blocks as Q5_1 blocks
    case T_Q6_K: gemm_q8_many_t<T_Q6_K>(g, n0, n1); break;
    case T_Q4_0: gemm_q8_many_t<T_Q4_0>(g, n0, n1); break;
    case T_Q4_1: gemm_q8_many_t<T_Q4_1>(g, n0, n1); break;
    default: gemm_q8_many_t<T_Q8_0>(g, n0, n1); break;
  }
}
