// Few-row products (1 .. 16 rows: decode steps, speculative verifications) of bfloat16 models
// on the AMX tiles over the row-interleaved copies of Q4_0 / Q4_1 / Q4_K, Q5_0 / Q5_1 / Q5_K
// (a nibble plus its fifth bit from the copy's masks), Q8_0 (the bf16 of q itself:
// exact_words_q8) and Q6_K (six-bit copies, by sub-blocks of 16: exact_q6k_groups), the quants exact: no
// weight is rounded. Included by quant_kernels.cpp inside namespace amx_bf16_rows16 after
// quant_rows16_amx.h (its configure, h16, u8x16, round_bf16), in the AMX-BF16 region; run only
// where the CPU has the tiles and Linux granted them. No include guard on purpose.
//
// Per 16-row group of the copy and block of 32 along K (Q4_K: sub-block), the block's 4 chunks
// of nibbles become one B tile with a byte unpack each: tile row j holds the 16 rows' pairs
// (j, j + 16) as the bf16 of 128 + q (0x4300 | q, exact: bf16 steps by 1 from 128 to 256), the
// copy's chunk order (quant_rows16_layout.h) against pair_activations' A rows. TDPBF16PS sums
// the block into a C tile of M rows; the C tile is stored to L1 and scaled into per-row vector
// accumulators. A thread's groups run as one stream of blocks whose tiles are written
// EXACT_AHEAD blocks before the tiles read them (a ring; two A, B and C tiles alternate).
//
// Numerics, per output row and block: s = the tile's sum over the block of x[j] (128 + q[j])
// (products exact, summed in float32 in the tile's order), acc += s d, then acc += c xsum with
// c = m - (128 + z) d (z: Q4_0's 8, Q5_0's 16; m: Q4_1's / Q5_1's min, the K-quants' -dmin m_sb, 0 for Q4_0 / Q5_0; d: the K-quants'
// d sc_sb) and xsum the block's activation sum (float32, element order: group_sums). The
// quants' offset costs about 4 bits of the block sums' float32 precision (s ~ 18x the sum
// over q alone; Q8_0: no offset, its words are q), far below the activations' bf16 rounding. A row's result does not depend on
// the other rows or their number: the tiles compute each row alone, so a k-token verification
// computes what the 1-row steps compute.

struct ExactArgs {
  int type;
  int64_t K, M;
  const uint16_t* X;   // [M, K] the activations (Q6_K's A tiles: natural pairs)
  const uint32_t* XP;  // [M, K / 2] activation pairs (avx512_bf16_rows16::pair_activations; not Q6_K)
  const float* xsum;   // [M, K / 32] block sums of the activations
  float* f;            // float output (row stride ldo, offset by the segment's column), or
  uint16_t* h;         // bf16 output after the bias (float, the segment's columns; may be null)
  const float* bias;
  int64_t ldo;
};

// Block b (32 along K) of a Q4 group's chunks at q -> 16 tile rows at dst: row j = the group's
// 16 rows' pairs (j, j + 16), each the bf16 of 128 + q. Q5_0 / Q5_1 / Q5_K: q at the block's 8
// fifth-bit masks, its chunks after them; a nibble whose bit is set gets 16 (128 + q < 160 stays
// exact: bf16 steps by 1 from 128 to 256)
template <int TYPE>
inline void exact_words(const uint8_t* q, uint16_t* dst) {
  constexpr bool q5 = TYPE == T_Q5_0 || TYPE == T_Q5_1 || TYPE == T_Q5_K;
  const uint8_t* chunks = q5 ? q + 64 : q;
  const __m512i m4 = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x43), b16 = _mm512_set1_epi8(16);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(chunks + 64 * c);
    __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    if constexpr (q5) {  // masks 2 c and 2 c + 1: bit b for the low / high nibble of byte b
      uint64_t fl, fh;
      std::memcpy(&fl, q + 8 * (2 * c), 8);
      std::memcpy(&fh, q + 8 * (2 * c + 1), 8);
      lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(fl), lo, b16);
      hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(fh), hi, b16);
    } else {
      (void)b16;
    }
    _mm512_storeu_si512(dst + 32 * (4 * c + 0), _mm512_unpacklo_epi8(lo, top));
    _mm512_storeu_si512(dst + 32 * (4 * c + 1), _mm512_unpacklo_epi8(hi, top));
    _mm512_storeu_si512(dst + 32 * (4 * c + 2), _mm512_unpackhi_epi8(lo, top));
    _mm512_storeu_si512(dst + 32 * (4 * c + 3), _mm512_unpackhi_epi8(hi, top));
  }
}

// Block b of a Q8_0 copy's quants at q (byte [j][r] = row r's q[j]) -> 16 tile rows at dst: row
// j = the 16 rows' pairs (j, j + 16) as the bf16 of q itself (exact: |q| <= 128), through float32
inline void exact_words_q8(const uint8_t* q, uint16_t* dst) {
  const __m512i idx = pair_index();
  auto f = [&](int64_t j) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j))));
  };
  for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + 32 * j, pack_pairs(f(j), f(j + 16), idx));
}

template <int TYPE>
constexpr bool exact_kquant() { return TYPE == T_Q4_K || TYPE == T_Q5_K; }

// Block b of group g in a copy of nb blocks a group: where its bytes start (the K-quants: its
// super-block's header), its chunks (Q5: its masks), and (scales) its 16 rows' d and c (see Numerics)
template <int TYPE>
inline const uint8_t* exact_block(const uint8_t* WI, int64_t g, int64_t nb, int64_t b) {
  if constexpr (exact_kquant<TYPE>()) return WI + (g * (nb / 8) + b / 8) * rows16_block_bytes(TYPE);
  return WI + (g * nb + b) * rows16_block_bytes(TYPE);
}
template <int TYPE>
inline const uint8_t* exact_quants(const uint8_t* WI, int64_t g, int64_t nb, int64_t b) {
  if constexpr (exact_kquant<TYPE>())
    return exact_block<TYPE>(WI, g, nb, b) + Q4K_HDR + (TYPE == T_Q5_K ? Q5K_SUB : Q4K_SUB) * (b % 8);
  return exact_block<TYPE>(WI, g, nb, b) + rows16_scales_bytes(TYPE);  // (Q5_0 / Q5_1: the masks)
}
template <int TYPE>
inline void exact_scales(const uint8_t* WI, int64_t g, int64_t nb, int64_t b, __m512& d, __m512& c) {
  const uint8_t* blk = exact_block<TYPE>(WI, g, nb, b);
  if constexpr (exact_kquant<TYPE>()) {
    const int64_t sb = b % 8;
    d = _mm512_mul_ps(h16(blk), u8x16(blk + 64 + 16 * sb));
    c = _mm512_fnmadd_ps(h16(blk + 32), u8x16(blk + 192 + 16 * sb), _mm512_mul_ps(_mm512_set1_ps(-128.0f), d));
  } else if constexpr (TYPE == T_Q4_1 || TYPE == T_Q5_1) {
    d = h16(blk);
    c = _mm512_fmadd_ps(_mm512_set1_ps(-128.0f), d, h16(blk + 32));
  } else if constexpr (TYPE == T_Q8_0) {  // its words are q itself: no offset
    d = h16(blk);
    c = _mm512_setzero_ps();
  } else {  // z = 8 (Q4_0), 16 (Q5_0)
    d = h16(blk);
    c = _mm512_mul_ps(_mm512_set1_ps(TYPE == T_Q5_0 ? -144.0f : -136.0f), d);
  }
}

// Tile buffers in the ring, and how many blocks ahead of the tiles' block its words are
// written: vector stores and a tileload of their data soon after cost ~85 cycles a block
// instead of ~32 on a Sapphire Rapids (no forwarding into the tiles), so the words are
// written well before the tiles read them
constexpr int64_t EXACT_RING = 8, EXACT_AHEAD = 4;
constexpr int64_t EXACT_SLOT = 512;  // words a ring slot holds: a block's tile

// A thread's (group, block) cursor along its stream: no division in the loop
struct ExactCursor {
  int64_t g, b, nb;
  void next() {
    if (++b == nb) b = 0, ++g;
  }
};

// Group g's output columns 16 g .. 16 g + 15 of the MT rows from acc (float, or bf16 after the
// bias), acc cleared for the next group
template <int MT>
inline void exact_store(const ExactArgs& a, int64_t g, __m512* acc) {
  for (int r = 0; r < MT; ++r) {
    if (a.f) {
      _mm512_storeu_ps(a.f + r * a.ldo + 16 * g, acc[r]);
    } else {
      const __m512 v = a.bias ? _mm512_add_ps(acc[r], _mm512_loadu_ps(a.bias + 16 * g)) : acc[r];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.h + r * a.ldo + 16 * g), round_bf16(v));
    }
    acc[r] = _mm512_setzero_ps();
  }
}

// One step's tiles on set 0 or 1 (A 0-1, B 2-3, C 4-5; the tile macros take literal numbers):
// the ring slot's words against the A rows at APTR (row stride lda bytes), the sums stored to cs
// by the step's parity
#define PS_EXACT_TILES(A, B, C, APTR)                       \
  _tile_loadd(B, ring + EXACT_SLOT * (s % EXACT_RING), 64); \
  _tile_loadd(A, APTR, lda);                                \
  _tile_zero(C);                                            \
  _tile_dpbf16ps(C, A, B);                                  \
  _tile_stored(C, cs + 256 * (s & 1), 64);

// The stream of `total` steps both kernels run, from cursor t: per step s, the words of the
// steps EXACT_AHEAD on (words(s) fills slots s .. s + PER - 1 where s % PER == 0), step s on the
// tiles against the A rows at aptr(t), and step s - 1's sums, stored the step before, scaled into
// the accumulators (scale(s - 1)). PER a constant: no division a step (a batch-1 step paid ~4%).
template <int64_t PER, typename Words, typename APtr, typename Scale>
inline void exact_stream(int64_t total, int64_t lda, const uint16_t* ring, float* cs, ExactCursor t, Words words,
                         APtr aptr, Scale scale) {
  constexpr int64_t per = PER;
  for (int64_t s = 0; s < std::min(EXACT_AHEAD, total); s += per) words(s);
  for (int64_t s = 0; s < total; ++s) {
    if (s % per == 0 && s + EXACT_AHEAD < total) words(s + EXACT_AHEAD);
    const void* rows = aptr(t);
    if (s & 1) {
      PS_EXACT_TILES(1, 3, 5, rows)
    } else {
      PS_EXACT_TILES(0, 2, 4, rows)
    }
    t.next();
    if (s > 0) scale(s - 1);
  }
  scale(total - 1);
}
#undef PS_EXACT_TILES

// Output columns 16 g0 .. 16 g1 of the MT rows: the thread's groups as one stream of blocks
// (s: the group s / nb's block s % nb), tiles configured for MT rows; a group's output after its
// last block.
template <int TYPE, int MT>
inline void exact_groups(const ExactArgs& a, const uint8_t* WI, int64_t g0, int64_t g1, uint16_t* ring, float* cs) {
  const int64_t nb = a.K / 32, lda = a.K * 2, total = (g1 - g0) * nb;  // lda: A's row stride in bytes
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  ExactCursor w{g0, 0, nb}, c{g0, 0, nb};  // the words' and the scaling's (exact_stream: the tiles')
  auto words = [&](int64_t s) {  // block s's words, from cursor w
    const uint8_t* q = exact_quants<TYPE>(WI, w.g, nb, w.b);
    for (int i = -1; i < 4; ++i)  // ~8 blocks further on in the stream, their scales too
      _mm_prefetch(reinterpret_cast<const char*>(q + 8 * 320 + 64 * i), _MM_HINT_T0);
    if constexpr (TYPE == T_Q8_0)
      exact_words_q8(q, ring + EXACT_SLOT * (s % EXACT_RING));
    else
      exact_words<TYPE>(q, ring + EXACT_SLOT * (s % EXACT_RING));
    w.next();
  };
  auto scale = [&](int64_t s) {  // block s's sums (stored in cs by parity) into acc; a group's end
    const float* cp = cs + 256 * (s & 1);
    __m512 d, k;
    exact_scales<TYPE>(WI, c.g, nb, c.b, d, k);
    for (int r = 0; r < MT; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_load_ps(cp + 16 * r), d, acc[r]);
      acc[r] = _mm512_fmadd_ps(k, _mm512_set1_ps(a.xsum[r * nb + c.b]), acc[r]);
    }
    if (c.b == nb - 1) exact_store<MT>(a, c.g, acc);
    c.next();
  };
  exact_stream<1>(total, lda, ring, cs, {g0, 0, nb}, words, [&](const ExactCursor& x) { return a.XP + x.b * 16; }, scale);
}

// Q6_K (six-bit copies) by sub-blocks of 16, each with its own scale d sc: tiles 0-1 (A) of m
// rows x 16 activations, 2-3 (B) of 8 pairs, 4-5 (C) of m rows
inline void configure_q6k(int64_t m) {
  TileCfg c;
  for (int i = 0; i < 6; ++i) {
    c.colsb[i] = i < 2 ? 32 : 64;
    c.rows[i] = static_cast<uint8_t>(i == 2 || i == 3 ? 8 : m);
  }
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// exact_groups for Q6_K: a stream of sub-blocks of 16 along K (s: group s / ns's sub-block
// s % ns). The B words are bf16(q - 32) in natural pairs (2 p, 2 p + 1), exact
// (avx512_bf16_vbmi::amx_exact_words_q6k, four sub-blocks a call), against the activations' own
// pairs; per output row and sub-block, acc += s (d sc) with s the tile's float32 sum over the
// sub-block of x[j] (q[j] - 32) (products exact) and d sc exact in float32: ggml's (d sc) (q -
// 32) x summed, in the tile's order. No offset term.
template <int MT>
inline void exact_q6k_groups(const ExactArgs& a, const uint8_t* WI, int64_t g0, int64_t g1, uint16_t* ring, float* cs) {
  static_assert(EXACT_AHEAD % 4 == 0 && EXACT_RING % 4 == 0, "words() fills four slots at a time");
  const int64_t ns = a.K / 16, lda = a.K * 2, total = (g1 - g0) * ns, bb = rows16_block_bytes(T_Q6_K);
  const int64_t gb = (a.K / 256) * bb;
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  ExactCursor w{g0, 0, ns}, c{g0, 0, ns};
  auto block = [&](const ExactCursor& x) { return WI + x.g * gb + (x.b / 16) * bb; };  // its super-block
  auto words = [&](int64_t s) {  // sub-blocks s .. s + 3 (total: a multiple of 16)
    const uint8_t* p = block(w);
    const char* ahead = reinterpret_cast<const char*>(p + Q6K_HDR + Q6K_SUB6 * (w.b % 16 + 8));
    for (int i = 0; i < 12; ++i) _mm_prefetch(ahead + 64 * i, _MM_HINT_T0);  // ~8 sub-blocks on
    avx512_bf16_vbmi::amx_exact_words_q6k(p, w.b % 16, ring + EXACT_SLOT * (s % EXACT_RING), EXACT_SLOT);
    for (int i = 0; i < 4; ++i) w.next();
  };
  auto scale = [&](int64_t s) {
    const float* cp = cs + 256 * (s & 1);
    const uint8_t* p = block(c);
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * (c.b % 16)));
    const __m512 ds = _mm512_mul_ps(h16(p), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
    for (int r = 0; r < MT; ++r) acc[r] = _mm512_fmadd_ps(_mm512_load_ps(cp + 16 * r), ds, acc[r]);
    if (c.b == ns - 1) exact_store<MT>(a, c.g, acc);
    c.next();
  };
  exact_stream<4>(total, lda, ring, cs, {g0, 0, ns}, words, [&](const ExactCursor& x) { return a.X + x.b * 16; }, scale);
}

// Output columns 16 g0 .. 16 g1 of all a.M (1 .. 16) rows, on this thread's tiles
inline void gemm_exact(const ExactArgs& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  alignas(64) uint16_t ring[EXACT_SLOT * EXACT_RING];
  alignas(64) float cs[512];
  if (g1 <= g0) return;
  const bool q6k = a.type == T_Q6_K;
  if (q6k) configure_q6k(a.M);
  else configure(a.M);
  auto run = [&](auto T, auto MT) {
    if constexpr (decltype(T)::value == T_Q6_K) exact_q6k_groups<decltype(MT)::value>(a, WI, g0, g1, ring, cs);
    else exact_groups<decltype(T)::value, decltype(MT)::value>(a, WI, g0, g1, ring, cs);
  };
  auto rows = [&](auto T) {
    using std::integral_constant;
    switch (a.M) {
      case 1: return run(T, integral_constant<int, 1>{});
      case 2: return run(T, integral_constant<int, 2>{});
      case 3: return run(T, integral_constant<int, 3>{});
      case 4: return run(T, integral_constant<int, 4>{});
      case 5: return run(T, integral_constant<int, 5>{});
      case 6: return run(T, integral_constant<int, 6>{});
      case 7: return run(T, integral_constant<int, 7>{});
      case 8: return run(T, integral_constant<int, 8>{});
      case 9: return run(T, integral_constant<int, 9>{});
      case 10: return run(T, integral_constant<int, 10>{});
      case 11: return run(T, integral_constant<int, 11>{});
      case 12: return run(T, integral_constant<int, 12>{});
      case 13: return run(T, integral_constant<int, 13>{});
      case 14: return run(T, integral_constant<int, 14>{});
      case 15: return run(T, integral_constant<int, 15>{});
      default: return run(T, integral_constant<int, 16>{});
    }
  };
  using std::integral_constant;
  if (a.type == T_Q4_1) rows(integral_constant<int, T_Q4_1>{});
  else if (a.type == T_Q4_0) rows(integral_constant<int, T_Q4_0>{});
  else if (a.type == T_Q5_1) rows(integral_constant<int, T_Q5_1>{});
  else if (a.type == T_Q5_0) rows(integral_constant<int, T_Q5_0>{});
  else if (a.type == T_Q5_K) rows(integral_constant<int, T_Q5_K>{});
  else if (a.type == T_Q8_0) rows(integral_constant<int, T_Q8_0>{});
  else if (q6k) rows(integral_constant<int, T_Q6_K>{});
  else rows(integral_constant<int, T_Q4_K>{});
  _tile_release();
}
