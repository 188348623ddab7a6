// Many-row products of bfloat16 models on the AMX tiles, the weights dequantized from the
// row-interleaved copy (quant_rows16_layout.h) as they are used: each step streams the copy's
// 4.5 (Q4_0 / Q4_1 / Q4_K), 5.5 (Q5_0 / Q5_1 / Q5_K: a nibble plus its fifth bit from the copy's
// masks), 6.56 (Q6_K's six bits: quant_rows16_amx_q6k.h decodes them) or 8.5 (Q8_0) bits a weight
// from memory instead of 16. Included
// once by quant_kernels.cpp inside namespace amx_bf16_rows16, in a region compiled for AMX-BF16
// and AVX512-BF16; run only where the CPU has the tiles and Linux granted them (current_isa()
// >= ISA_AMX_BF16). No include guard on purpose.
//
// Work: items of 32 output columns (two 16-row groups of the copy; the last may be one). An
// item dequantizes its columns' K weights into a thread's buffer, in the layout TDPBF16PS takes
// as B (per group [K / 2][16 columns][2], pairs of K interleaved: a 32-element block of the copy
// is one 1 KB tile), then runs every 32 activation rows against it: tiles 0-1 A (rows 0-15,
// 16-31), 2-3 B (the two groups), 4-7 C (float32 sums over the whole K), stored into the
// output's float columns, or through an L1 scratch rounded to its bf16 ones (Out). M % 16 rows
// run last on tiles configured for that many rows.
//
// Numerics: each weight is fma(q, d, m) in float32 (Q4_0: fma(q, d, -8 d), the exact (q - 8) d;
// Q4_K: fma(q, d sc, -(dmin m)), ggml's d1 q - m1; Q5_x as Q4_x with q < 32 (Q5_0: fma(q, d, -16 d));
// Q8_0: q d; Q6_K: (d sc) (q - 32)), rounded once to bf16 (round to
// nearest even): the bf16 copy's weights (QuantLinear.attach_bf16_copy) up to that fma's
// rounding; products summed in float32 by the tiles (the order of oneDNN's brgemm on the same
// tiles is its own). A row's result does not depend on the other rows.

struct alignas(64) TileCfg {  // ldtilecfg's 64-byte operand, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-1 and 4-7 (A, C) of m rows (1 .. 16), 2-3 (B) of 16 pairs; 64 bytes a row each
inline void configure(int64_t m) {
  TileCfg c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = static_cast<uint8_t>(i == 2 || i == 3 ? 16 : m);
  }
  asm volatile("ldtilecfg %0" ::"m"(c));  // (GCC 12's builtin lets the stores to c be dropped)
}

// vpshufb controls: dword i of lane L <- byte 8 h + s + 2 i of the lane (row 4 L + i's pair
// 2 c + h + 8 s in chunk c of a Q4 block), zero-extended
inline __m512i pair_ctl(int h, int s) {
  alignas(16) uint8_t b[16];
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = static_cast<uint8_t>(8 * h + s + 2 * i);
    b[4 * i + 1] = b[4 * i + 2] = b[4 * i + 3] = 0x80;
  }
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(b)));
}

// vpermw's index for pack_pairs: word 2 n <- n, 2 n + 1 <- 16 + n (rows16_layout::PAIR_INDEX)
inline __m512i pair_index() { return _mm512_load_si512(PAIR_INDEX); }

// bf16 element 2 n <- lo[n], 2 n + 1 <- hi[n]: one tile row of 16 columns' pairs (idx: pair_index())
inline __m512i pack_pairs(__m512 lo, __m512 hi, __m512i idx) {
  return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// 32 along K of a 16-row group in Q4_1's chunk layout (q: its 4 chunks of 64 bytes), each
// weight fma(q, d, m) with the rows' d and m -> 16 tile rows at dst
inline void deq_chunks(const uint8_t* q, __m512 d, __m512 m, uint16_t* dst, const __m512i ctl[4], __m512i idx) {
  const __m512i low = _mm512_set1_epi32(15);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(q + 64 * c);
    for (int hs = 0; hs < 4; ++hs) {  // hs = h + 2 s: the pair 2 c + h + 8 s
      const __m512i x = _mm512_shuffle_epi8(v, ctl[hs]);
      const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(x, low)), d, m);
      const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4)), d, m);
      const int p = 2 * c + (hs & 1) + 8 * (hs >> 1);
      _mm512_storeu_si512(dst + 32 * p, pack_pairs(lo, hi, idx));
    }
  }
}

// The Q5 copies' fifth bits (quant_rows16_layout.h: mask 2 c + n, bit b for the nibble n of chunk
// c's byte b) of the bytes pair_ctl(h, s) picks, as its 16 dwords' lane mask: _pext_u64 of the mask
// by pattern hs (bits 16 L + 8 h + s + 2 i, ascending: dword 4 L + i)
inline uint64_t fifth_bit_pattern(int h, int s) {
  uint64_t p = 0;
  for (int L = 0; L < 4; ++L)
    for (int i = 0; i < 4; ++i) p |= uint64_t{1} << (16 * L + 8 * h + s + 2 * i);
  return p;
}

// deq_chunks for a Q5 block (Q5_0 / Q5_1 / a Q5_K sub-block): each nibble plus 16 where its
// fifth bit is set (masks: the block's 8 words), then fma(q, d, m)
inline void deq_chunks5(const uint8_t* masks, const uint8_t* q, __m512 d, __m512 m, uint16_t* dst,
                        const __m512i ctl[4], const uint64_t pat[4], __m512i idx) {
  const __m512i low = _mm512_set1_epi32(15), b16 = _mm512_set1_epi32(16);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(q + 64 * c);
    uint64_t fl, fh;  // the fifth bits of the chunk's low nibbles, its high ones
    std::memcpy(&fl, masks + 8 * (2 * c), 8);
    std::memcpy(&fh, masks + 8 * (2 * c + 1), 8);
    for (int hs = 0; hs < 4; ++hs) {
      const __m512i x = _mm512_shuffle_epi8(v, ctl[hs]);
      __m512i ql = _mm512_and_si512(x, low), qh = _mm512_srli_epi32(x, 4);
      ql = _mm512_mask_add_epi32(ql, static_cast<__mmask16>(_pext_u64(fl, pat[hs])), ql, b16);
      qh = _mm512_mask_add_epi32(qh, static_cast<__mmask16>(_pext_u64(fh, pat[hs])), qh, b16);
      const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ql), d, m);
      const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qh), d, m);
      const int p = 2 * c + (hs & 1) + 8 * (hs >> 1);
      _mm512_storeu_si512(dst + 32 * p, pack_pairs(lo, hi, idx));
    }
  }
}

inline __m512 h16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// One block of 32 along K of a 16-row group of a Q4_0 / Q4_1 copy -> 16 tile rows at dst
template <bool MIN>
inline void deq_q4(const uint8_t* blk, uint16_t* dst, const __m512i ctl[4], __m512i idx) {
  const __m512 d = h16(blk);
  const __m512 m = MIN ? h16(blk + 32) : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
  deq_chunks(blk + (MIN ? 64 : 32), d, m, dst, ctl, idx);
}

// Sub-block sb (32 along K) of a Q4_K copy's super-block (hdr: its d, dmin, scales, mins):
// fma(q, d sc, -(dmin m)), ggml's d1 q - m1 exactly (d sc and dmin m are exact in float32)
inline void deq_q4k(const uint8_t* hdr, int64_t sb, uint16_t* dst, const __m512i ctl[4], __m512i idx) {
  const __m512 d = _mm512_mul_ps(h16(hdr), u8x16(hdr + 64 + 16 * sb));
  const __m512 m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(h16(hdr + 32), u8x16(hdr + 192 + 16 * sb)));
  deq_chunks(hdr + Q4K_HDR + Q4K_SUB * sb, d, m, dst, ctl, idx);
}

// One block of a Q5_0 / Q5_1 copy: d[16] | m[16] (MIN) | 8 masks | 4 chunks; Q5_0's fma(q, d, -16 d),
// the exact (q - 16) d
template <bool MIN>
inline void deq_q5(const uint8_t* blk, uint16_t* dst, const __m512i ctl[4], const uint64_t pat[4], __m512i idx) {
  const __m512 d = h16(blk);
  const __m512 m = MIN ? h16(blk + 32) : _mm512_mul_ps(d, _mm512_set1_ps(-16.0f));
  const uint8_t* masks = blk + (MIN ? 64 : 32);
  deq_chunks5(masks, masks + 64, d, m, dst, ctl, pat, idx);
}

// Sub-block sb of a Q5_K copy's super-block (Q4_K's header, then per sub-block 8 masks and 4
// chunks): fma(q, d sc, -(dmin m)), as Q4_K's
inline void deq_q5k(const uint8_t* hdr, int64_t sb, uint16_t* dst, const __m512i ctl[4], const uint64_t pat[4],
                    __m512i idx) {
  const __m512 d = _mm512_mul_ps(h16(hdr), u8x16(hdr + 64 + 16 * sb));
  const __m512 m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(h16(hdr + 32), u8x16(hdr + 192 + 16 * sb)));
  const uint8_t* masks = hdr + Q4K_HDR + Q5K_SUB * sb;
  deq_chunks5(masks, masks + 64, d, m, dst, ctl, pat, idx);
}

// The same for a Q8_0 copy (byte [j][r] = row r's quant j)
inline void deq_q8(const uint8_t* blk, uint16_t* dst, __m512i idx) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
  const int8_t* q = reinterpret_cast<const int8_t*>(blk + 32);
  for (int p = 0; p < 16; ++p) {
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 32 * p)))), d);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 32 * p + 16)))), d);
    _mm512_storeu_si512(dst + 32 * p, pack_pairs(lo, hi, idx));
  }
}

// Bytes of a 16-row group's copy of K columns
inline int64_t group_bytes(int type, int64_t K) {
  return K / (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K ? 256 : 32) * rows16_block_bytes(type);
}

// The next item's dequantization, done a slice at a time between the current item's tile
// products (the tiles run beside the vector units: the two overlap where interleaved). One type
// per instantiation, so each block's dequantization is inlined into the walk (a run-time switch
// per block kept it out of line: 8-10% of a 64-row product at K = 576, BENCHMARKS section 72).
template <int TYPE>
struct NextItem {
  // blocks of 32 along K (the K-quants' sub-blocks: super-block b / 8, part b % 8)
  static constexpr bool SUPER = TYPE == T_Q4_K || TYPE == T_Q5_K || TYPE == T_Q6_K;
  const uint8_t* grp = nullptr;  // the group being dequantized: its copy
  uint16_t* out = nullptr;       // its tile rows
  int64_t K = 0, nb = 0, bb = 0, gb = 0, total = 0, done = 0, b = 0;  // nb: blocks a group; b: the group's next
  __m512i ctl[4], idx;
  uint64_t pat[4];  // the Q5 copies' fifth-bit patterns, in ctl's order

  void init(int64_t k) {
    K = k;
    nb = K / 32;
    bb = rows16_block_bytes(TYPE);  // (the K-quants: a super-block's)
    gb = group_bytes(TYPE, K);
    ctl[0] = pair_ctl(0, 0);
    ctl[1] = pair_ctl(1, 0);
    ctl[2] = pair_ctl(0, 1);
    ctl[3] = pair_ctl(1, 1);
    for (int hs = 0; hs < 4; ++hs) pat[hs] = fifth_bit_pattern(hs & 1, hs >> 1);
    idx = pair_index();
  }
  // groups (1 or 2) from src into dst (a group's tile rows 16 K words after the one before);
  // nothing left for groups = 0
  void start(const uint8_t* src, uint16_t* dst, int64_t groups) {
    grp = src;
    out = dst;
    total = groups * nb;
    done = b = 0;
  }
  // block bk of the group at g -> its 16 tile rows at o
  inline void one(const uint8_t* g, int64_t bk, uint16_t* o) const {
    const uint8_t* blk = g + (SUPER ? bk / 8 : bk) * bb;
    if constexpr (TYPE == T_Q4_1) deq_q4<true>(blk, o, ctl, idx);
    else if constexpr (TYPE == T_Q4_0) deq_q4<false>(blk, o, ctl, idx);
    else if constexpr (TYPE == T_Q4_K) deq_q4k(blk, bk % 8, o, ctl, idx);
    else if constexpr (TYPE == T_Q6_K) avx512_bf16_vbmi::amx_b_rows_q6k_six(blk, bk % 8, o);
    else if constexpr (TYPE == T_Q5_K) deq_q5k(blk, bk % 8, o, ctl, pat, idx);
    else if constexpr (TYPE == T_Q5_1) deq_q5<true>(blk, o, ctl, pat, idx);
    else if constexpr (TYPE == T_Q5_0) deq_q5<false>(blk, o, ctl, pat, idx);
    else deq_q8(blk, o, idx);
  }
  // blocks 0 .. t - 1 of the item done (the first group's nb, then the second's)
  inline void upto(int64_t t) {
    for (t = std::min(t, total); done < t; ++done) {
      one(grp, b, out + b * 512);
      if (++b == nb) {
        b = 0;
        grp += gb;
        out += 16 * K;
      }
    }
  }
};

// C (float, ldc) [rows x 16 * cols] = A rows (bf16, lda) @ B (one or two groups, b1 = b0 + 16 K);
// after each step along K, the next item's share of its blocks (step of steps)
template <bool TWO_ROWS, bool TWO_COLS, class NX>
inline void block(const uint16_t* a, int64_t lda, const uint16_t* b0, int64_t K, float* c, int64_t ldc, NX& nx,
                  int64_t& step, int64_t steps) {
  const uint16_t* b1 = b0 + 16 * K;
  const uint16_t* a1 = a + 16 * lda;
  _tile_zero(4);
  if (TWO_COLS) _tile_zero(5);
  if (TWO_ROWS) _tile_zero(6);
  if (TWO_ROWS && TWO_COLS) _tile_zero(7);
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(0, a + k, lda * 2);
    _tile_loadd(2, b0 + k * 16, 64);
    _tile_dpbf16ps(4, 0, 2);
    if (TWO_COLS) {
      _tile_loadd(3, b1 + k * 16, 64);
      _tile_dpbf16ps(5, 0, 3);
    }
    if (TWO_ROWS) {
      _tile_loadd(1, a1 + k, lda * 2);
      _tile_dpbf16ps(6, 1, 2);
      if (TWO_COLS) _tile_dpbf16ps(7, 1, 3);
    }
    ++step;
    nx.upto((step * nx.total + steps - 1) / steps);
  }
  _tile_stored(4, c, ldc * 4);
  if (TWO_COLS) _tile_stored(5, c + 16, ldc * 4);
  if (TWO_ROWS) _tile_stored(6, c + 16 * ldc, ldc * 4);
  if (TWO_ROWS && TWO_COLS) _tile_stored(7, c + 16 * ldc + 16, ldc * 4);
}

// Where an item's sums go: float columns (f, row stride ldo), or rounded to bf16 (h, row
// stride ldo) after the bias (float, the item's columns; may be null) is added, through a
// 32 x 32 float scratch that stays in L1
struct Out {
  float* f = nullptr;
  uint16_t* h = nullptr;
  const float* bias = nullptr;
  int64_t ldo = 0;
  alignas(64) float c[32 * 32];
};

// 16 floats -> bf16, rounded to nearest even, NaN -> 0x7FC0 (c10::BFloat16's bits, and
// quant_kernels.cpp's narrow_bf16)
inline __m256i round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0)));
}

// rows r0 .. r0 + rows - 1, columns col .. col + 16 cols - 1 of the output from the scratch
inline void to_bf16(Out& o, int64_t r0, int64_t rows, int64_t col, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < 16 * cols; j += 16) {
      __m512 v = _mm512_load_ps(o.c + 32 * r + j);
      if (o.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(o.bias + col + j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.h + (r0 + r) * o.ldo + col + j), round_bf16(v));
    }
}

// The item's columns col .. (16 or 32 of them, b their weights) against every row of X
template <bool TWO_COLS, class NX>
inline void rows_block(const uint16_t* X, int64_t M, int64_t K, const uint16_t* b, Out& o, int64_t col, int64_t& cfg,
                       NX& nx) {
  const int64_t steps = (M / 32 + (M % 32 >= 16) + (M % 16 != 0)) * (K / 32);  // blocks of 32, 16 and the rest
  constexpr int64_t cols = TWO_COLS ? 2 : 1;
  int64_t m0 = 0, step = 0;
  const bool f = o.f != nullptr;
  auto c = [&](int64_t m) { return f ? o.f + m * o.ldo + col : o.c; };
  const int64_t ldc = f ? o.ldo : 32;
  if (cfg != 16) configure(cfg = 16);
  for (; m0 + 32 <= M; m0 += 32) {
    block<true, TWO_COLS>(X + m0 * K, K, b, K, c(m0), ldc, nx, step, steps);
    if (!f) to_bf16(o, m0, 32, col, cols);
  }
  if (m0 + 16 <= M) {
    block<false, TWO_COLS>(X + m0 * K, K, b, K, c(m0), ldc, nx, step, steps);
    if (!f) to_bf16(o, m0, 16, col, cols);
    m0 += 16;
  }
  if (m0 < M) {
    configure(cfg = M - m0);
    block<false, TWO_COLS>(X + m0 * K, K, b, K, c(m0), ldc, nx, step, steps);
    if (!f) to_bf16(o, m0, M - m0, col, cols);
  }
  nx.upto(nx.total);
}

// This thread's two item buffers (32 K tile-row words each), starting on a cache line: a tile
// row read across two lines cost a 64-row product up to a quarter more (section 72). One for
// every type's gemm_type.
inline uint16_t* item_buffers(int64_t K) {
  thread_local std::vector<uint16_t> buf;
  if (static_cast<int64_t>(buf.size()) < 64 * K + 32) buf.resize(64 * K + 32);
  return buf.data() + ((64 - (reinterpret_cast<uintptr_t>(buf.data()) & 63)) & 63) / 2;
}

// The output's columns 16 g0 .. 16 g1 (o: float, or bf16 after the bias) = X [M, K] bf16 @ the
// copy's groups g0 .. g1, transposed; items of two groups, each item's weights dequantized
// during the one before it
template <int TYPE>
inline void gemm_type(const uint8_t* W, int64_t K, const uint16_t* X, int64_t M, Out& o, int64_t g0, int64_t g1) {
  uint16_t* base = item_buffers(K);
  uint16_t* bufs[2] = {base, base + 32 * K};
  NextItem<TYPE> nx;
  nx.init(K);
  const int64_t gb = nx.gb;
  nx.start(W + g0 * gb, bufs[0], std::min<int64_t>(2, g1 - g0));
  nx.upto(nx.total);
  int64_t cfg = -1, cur = 0;
  for (int64_t g = g0; g < g1; g += 2, cur ^= 1) {
    nx.start(W + (g + 2) * gb, bufs[cur ^ 1], std::clamp<int64_t>(g1 - g - 2, 0, 2));
    if (g + 1 < g1) rows_block<true>(X, M, K, bufs[cur], o, 16 * g, cfg, nx);
    else rows_block<false>(X, M, K, bufs[cur], o, 16 * g, cfg, nx);
  }
  _tile_release();
}

inline void gemm(int type, const uint8_t* W, int64_t K, const uint16_t* X, int64_t M, Out& o, int64_t g0, int64_t g1) {
  switch (type) {
    case T_Q4_1: return gemm_type<T_Q4_1>(W, K, X, M, o, g0, g1);
    case T_Q4_0: return gemm_type<T_Q4_0>(W, K, X, M, o, g0, g1);
    case T_Q4_K: return gemm_type<T_Q4_K>(W, K, X, M, o, g0, g1);
    case T_Q6_K: return gemm_type<T_Q6_K>(W, K, X, M, o, g0, g1);
    case T_Q5_K: return gemm_type<T_Q5_K>(W, K, X, M, o, g0, g1);
    case T_Q5_1: return gemm_type<T_Q5_1>(W, K, X, M, o, g0, g1);
    case T_Q5_0: return gemm_type<T_Q5_0>(W, K, X, M, o, g0, g1);
    default: return gemm_type<T_Q8_0>(W, K, X, M, o, g0, g1);
  }
}
