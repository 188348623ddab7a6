// The row-interleaved copies of packed rows (16 output rows' blocks side by side) that the
// few-row kernels read: quant_rows16.h (AVX-512, float activations), quant_rows16_bf16.h
// (AVX512-BF16), quant_rows16_q6k_vbmi*.h (Q6_K's six-bit copy) and quant_rows16_avx2.h (AVX2,
// float activations; every layout but Q6_K's six bits). Their sizes, the code that writes them
// and what every kernel shares about them (the nibble tables' bytes, the walk over row tiles).
// Portable code (no target region), so the copy is written the same on every CPU. Included
// once by quant_kernels.cpp inside namespace rows16_layout (the block structs, the type codes
// and scale_min_k4 are the file's / the scalar build's). No include guard on purpose.
//
// The packed rows' layout makes a few-row product horizontal: each output row is a dot product
// over its blocks, 32 weights at a time, summed across lanes at the end, with one scale
// conversion and per-row bookkeeping per block. Interleaving 16 output rows per block turns it
// vertical: a vector holds one element of 16 rows, multiplied by one broadcast activation, no
// lane sums, and each block's 16 scales load as one vector. Per (group of 16 rows, block of 32
// along K), the same bytes as the 16 rows' blocks:
//   d[16] (fp16) | m[16] (fp16, Q4_1 only) | quants:
//   Q4_0 / Q4_1: 4 chunks of 64 bytes; chunk c's byte 16 L + 8 h + 2 i + s (L, i < 4; h, s < 2)
//   holds row 4 L + i's elements e = 4 c + 2 h + 16 s (low nibble) and e + 1 (high nibble), so
//   that one 64-byte load, its nibbles split and looked up (chunk_words), gives the pairs (j, j + 16)
//   of 16 rows for j = 4 c .. 4 c + 3, a row a dword, without widening a byte at a time;
//   Q8_0: 32 x 16 bytes, byte [j][r] = row r's qs[j].
// Numerics, per output row and block: lo = sum_{j < 16} q[j] x[j] and hi = sum_{j < 16} q[j + 16]
// x[j + 16] (float FMAs in j order), acc += (lo + hi) * d, then acc += m * sum(x of the block)
// for Q4_1 / Q5_1; the quants exactly as the packed kernels take them (Q4_0's minus 8, Q5_0's
// minus 16). A row's bits
// do not depend on the number of rows or groups computed with it (so a k-token verification
// computes what 1-row decode steps do); they differ from the packed rows' kernel's, which sums
// in another order. (The chunk layout of section 46 left these sums and their order as they were.)

// Q5_0 / Q5_1: d[16] | m[16] (Q5_1 only) | the fifth bits as 8 masks of 64 bits | Q4's 4 chunks
// of the low nibbles. Mask 2 c + n (n = 0: the chunk's low nibbles, 1: its high ones) has bit
// b set where the element in that nibble of chunk c's byte b has its fifth bit (bit e of the
// row's qh). The same bytes as the 16 rows' blocks (352 / 384). The kernels look each nibble up
// in one of two tables, chosen by the mask (vpshufb under a mask): 0 .. 15 and 16 .. 31 (Q5_0:
// minus 16), so a 5-bit quant costs one masked lookup more than a 4-bit one.

// Q4_K (the bf16 kernel, quant_rows16_bf16.h, and the float one, rows16_tile_k), per (group of
// 16 rows, super-block of 256 along K): d[16] (fp16) | dmin[16] (fp16) | sc[8][16] | m[8][16]
// (each sub-block's 6-bit scale and min, a byte each) | 8 sub-blocks of 32 elements, each's
// quants in Q4_1's 4 chunks of 64 bytes. 2,368 bytes against the 16 packed blocks' 2,304: the scales unpacked.
constexpr int64_t Q4K_HDR = 320, Q4K_SUB = 256;
// Q6_K, per (group of 16 rows, super-block of 256): d[16] (fp16) | sc[16][16] (each sub-block
// of 16's int8 scale, [sub-block][row]) | 16 sub-blocks of 16 elements, each's quants in one of
// two layouts (q6k_six_bits(): where the CPU has AVX512-VBMI), both read by both float / bf16
// kernels and by gguf_q8's int8 one (quant_rows16_q6k_vnni.h):
//   six bits: 8 runs of 24 bytes; run p holds the element pairs (2 p, 2 p + 1) of the 16 rows as
//   a little-endian stream of 32 six-bit fields, field 2 r + h = row r's quant 2 p + h (0 .. 63,
//   unsigned as in ql / qh). 3,360 bytes, the 16 packed blocks' size (quant_rows16_q6k_vbmi*.h);
//   a byte: the quants minus 32 as int8, byte [e][r] = row r's element e (Q8_0's order). 4,384
//   bytes (+30%).
constexpr int64_t Q6K_HDR = 288, Q6K_SUB = 256, Q6K_SUB6 = 192;
// A tile row's pair interleave (vpermw's index for the AMX kernels' B rows): word 2 n <- n,
// 2 n + 1 <- 16 + n
alignas(64) inline constexpr uint16_t PAIR_INDEX[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
static inline int64_t q6k_sub_bytes() { return ::q6k_six_bits() ? Q6K_SUB6 : Q6K_SUB; }
// Q5_K (both kernels, as Q4_K), per (group of 16 rows, super-block of 256): Q4_K's header (d,
// dmin, the sub-blocks' scales and mins a byte each: 320 bytes), then 8 sub-blocks of 32, each
// as a Q5_0 / Q5_1 block's quants: its 8 fifth-bit masks (64 bytes), then Q4's 4 chunks of
// nibbles. 2,880 bytes against the 16 packed blocks' 2,816 (+2.3%: the scales unpacked). Until
// the twenty-first session the quants were a byte each (4,416 bytes, +57%).
constexpr int64_t Q5K_SUB = 320;

// Bytes of the copy for 16 rows' packed blocks of one type's block (32 elements; the K-quants' 256)
static inline int64_t rows16_block_bytes(int type) {
  switch (type) {
    case T_Q4_0: return 16 * (int64_t)sizeof(bq4_0);
    case T_Q4_1: return 16 * (int64_t)sizeof(bq4_1);
    case T_Q8_0: return 16 * (int64_t)sizeof(bq8_0);
    case T_Q5_0: return 16 * (int64_t)sizeof(bq5_0);
    case T_Q5_1: return 16 * (int64_t)sizeof(bq5_1);
    case T_Q4_K: return Q4K_HDR + 8 * Q4K_SUB;  // a super-block
    case T_Q6_K: return Q6K_HDR + 16 * q6k_sub_bytes();
    case T_Q5_K: return Q4K_HDR + 8 * Q5K_SUB;
    default: return 0;
  }
}

// Where a 32-element block type's parts lie in the copy: its scales (d, then Q4_1's / Q5_1's m),
// Q5's masks, the quants
constexpr bool rows16_has_min(int type) { return type == T_Q4_1 || type == T_Q5_1; }
constexpr bool rows16_q5(int type) { return type == T_Q5_0 || type == T_Q5_1; }
constexpr int64_t rows16_scales_bytes(int type) { return rows16_has_min(type) ? 64 : 32; }
constexpr int64_t rows16_quants_at(int type) { return rows16_scales_bytes(type) + (rows16_q5(type) ? 64 : 0); }

// Element e (0 .. 31) of a packed Q4_0 / Q4_1 block's quants qs[16]: its nibble
static inline uint8_t q4_nibble(const uint8_t* qs, int64_t e) { return e < 16 ? qs[e] & 15 : qs[e - 16] >> 4; }

// packed rows [16 * groups, rb] -> interleaved groups g0 .. g1 (out: the whole copy)
// Q4_K's and Q5_K's copies (their blocks share d, dmin, scales[12] at the front and qs[128]
// at the end): the header of row r, then each sub-block's quants (element l of sub-block sb:
// qs[32 (sb / 2) + l]'s low (sb even) or high nibble; Q5_K's fifth bit, bit sb of qh[l], in
// the sub-block's masks as for Q5_0)
template <class B>
static void interleave16_k_min(int type, const uint8_t* W, int64_t rb, int64_t K, int64_t g0, int64_t g1, uint8_t* out) {
  const int64_t ns = K / 256, BB = rows16_block_bytes(type);
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t i = 0; i < ns; ++i) {
      uint8_t* p = out + (g * ns + i) * BB;
      constexpr bool five = std::is_same_v<B, bq5_K>;
      const int64_t sub = five ? Q5K_SUB : Q4K_SUB, qat = five ? 64 : 0;  // a sub-block's bytes, its nibbles
      uint64_t masks[8][8] = {};                                           // Q5_K's, [sub-block][mask]
      for (int64_t r = 0; r < 16; ++r) {
        const B& blk = reinterpret_cast<const B*>(W + (g * 16 + r) * rb)[i];
        std::memcpy(p + 2 * r, &blk.d, 2);
        std::memcpy(p + 32 + 2 * r, &blk.dmin, 2);
        for (int sb = 0; sb < 8; ++sb) {
          int sc, m;
          scalar::scale_min_k4(sb, blk.scales, &sc, &m);
          p[64 + 16 * sb + r] = uint8_t(sc);
          p[192 + 16 * sb + r] = uint8_t(m);
          auto q = [&](int64_t l) { return uint8_t((blk.qs[32 * (sb / 2) + l] >> (4 * (sb % 2))) & 15); };
          auto bit5 = [&](int64_t l) -> uint64_t {
            if constexpr (five) return (blk.qh[l] >> sb) & 1;
            return 0;
          };
          uint8_t* dst = p + Q4K_HDR + sub * sb + qat;  // Q4_1's chunks
          for (int64_t c = 0; c < 4; ++c)
            for (int64_t h = 0; h < 2; ++h)
              for (int64_t s = 0; s < 2; ++s) {
                const int64_t e = 4 * c + 2 * h + 16 * s, b = 16 * (r / 4) + 8 * h + 2 * (r % 4) + s;
                dst[64 * c + b] = q(e) | q(e + 1) << 4;
                masks[sb][2 * c] |= bit5(e) << b;
                masks[sb][2 * c + 1] |= bit5(e + 1) << b;
              }
        }
      }
      if constexpr (five)
        for (int sb = 0; sb < 8; ++sb) std::memcpy(p + Q4K_HDR + sub * sb, masks[sb], sizeof(masks[sb]));
    }
}

// Q6_K's element e (0 .. 255) of a block, minus 32 (ggml's order: halves of 128, in each four
// runs of 32 from ql's low / high nibbles and qh's bit pairs)
static inline int8_t q6k_quant(const bq6_K& b, int e) {
  const int n = e / 128, k = (e % 128) / 32, l = e % 32;
  const uint8_t* ql = b.ql + 64 * n + (k & 1) * 32;
  const int lo = k < 2 ? ql[l] & 15 : ql[l] >> 4;
  return int8_t((lo | ((b.qh[32 * n + l] >> (2 * k)) & 3) << 4) - 32);
}

// field f (0 .. 31) of a six-bit run |= v (0 .. 63); the run's bytes start zeroed
static inline void put_six_bits(uint8_t* run, int f, unsigned v) {
  const int bit = 6 * f, at = bit / 8, sh = bit % 8;
  run[at] |= uint8_t(v << sh);
  if (sh > 2) run[at + 1] |= uint8_t(v >> (8 - sh));
}

static void interleave16_q6k(const uint8_t* W, int64_t rb, int64_t K, int64_t g0, int64_t g1, uint8_t* out) {
  const int64_t ns = K / 256, BB = rows16_block_bytes(T_Q6_K);
  const bool six = ::q6k_six_bits();
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t i = 0; i < ns; ++i) {
      uint8_t* p = out + (g * ns + i) * BB;
      std::memset(p, 0, BB);
      for (int64_t r = 0; r < 16; ++r) {
        const bq6_K& blk = reinterpret_cast<const bq6_K*>(W + (g * 16 + r) * rb)[i];
        std::memcpy(p + 2 * r, &blk.d, 2);
        for (int sb = 0; sb < 16; ++sb) p[32 + 16 * sb + r] = uint8_t(blk.scales[sb]);
        for (int e = 0; e < 256; ++e) {
          const int8_t q = q6k_quant(blk, e);
          if (six)  // sub-block e / 16, run (e % 16) / 2, field 2 r + e % 2
            put_six_bits(p + Q6K_HDR + Q6K_SUB6 * (e / 16) + 24 * ((e % 16) / 2), int(2 * r + e % 2), unsigned(q + 32));
          else
            p[Q6K_HDR + Q6K_SUB * (e / 16) + 16 * (e % 16) + r] = uint8_t(q);
        }
      }
    }
}

static void interleave16(int type, const uint8_t* W, int64_t rb, int64_t K, int64_t g0, int64_t g1, uint8_t* out) {
  if (type == T_Q4_K) return interleave16_k_min<bq4_K>(type, W, rb, K, g0, g1, out);
  if (type == T_Q5_K) return interleave16_k_min<bq5_K>(type, W, rb, K, g0, g1, out);
  if (type == T_Q6_K) return interleave16_q6k(W, rb, K, g0, g1, out);
  const int64_t nb = K / 32, bb = rb / nb, BB = rows16_block_bytes(type), hdr = rows16_quants_at(type);
  const bool q5 = rows16_q5(type), has_min = rows16_has_min(type);
  const int64_t qoff = (has_min ? 4 : 2) + (q5 ? 4 : 0);  // past d (and m), Q5's qh
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t i = 0; i < nb; ++i) {
      uint8_t* p = out + (g * nb + i) * BB;
      uint64_t masks[8] = {};
      for (int64_t r = 0; r < 16; ++r) {
        const uint8_t* blk = W + (g * 16 + r) * rb + i * bb;
        std::memcpy(p + 2 * r, blk, 2);                             // d
        if (has_min) std::memcpy(p + 32 + 2 * r, blk + 2, 2);  // m
        const uint8_t* qs = blk + qoff;
        if (type == T_Q8_0) {
          for (int64_t j = 0; j < 32; ++j) p[hdr + j * 16 + r] = qs[j];
          continue;
        }
        uint32_t qh = 0;
        if (q5) std::memcpy(&qh, qs - 4, 4);
        for (int64_t c = 0; c < 4; ++c)
          for (int64_t h = 0; h < 2; ++h)
            for (int64_t s = 0; s < 2; ++s) {
              const int64_t e = 4 * c + 2 * h + 16 * s, b = 16 * (r / 4) + 8 * h + 2 * (r % 4) + s;
              p[hdr + 64 * c + b] = q4_nibble(qs, e) | q4_nibble(qs, e + 1) << 4;
              masks[2 * c] |= uint64_t((qh >> e) & 1) << b;
              masks[2 * c + 1] |= uint64_t((qh >> (e + 1)) & 1) << b;
            }
      }
      if (q5) std::memcpy(p + rows16_scales_bytes(type), masks, sizeof(masks));
    }
}

// The low and high bytes of the bfloat16 of each nibble value plus an offset (the kernels'
// vpshufb tables, per 128-bit lane): Q4_1's 0 .. 15, Q4_0's 0 - 8 .. 15 - 8; Q5's two halves
// 0 .. 15 and 16 .. 31 (Q5_0: both minus 16)
constexpr int NIBBLE_OFFSETS[4] = {0, -8, -16, 16};
struct Q4Bytes {
  alignas(16) uint8_t lo[4][16], hi[4][16];  // [offset][nibble]
  Q4Bytes() {
    for (int t = 0; t < 4; ++t)
      for (int q = 0; q < 16; ++q) {
        const float v = float(q + NIBBLE_OFFSETS[t]);
        uint32_t u;
        std::memcpy(&u, &v, 4);  // small integers: the float's top half is their bfloat16, exactly
        lo[t][q] = uint8_t(u >> 16);
        hi[t][q] = uint8_t(u >> 24);
      }
  }
};
static inline const Q4Bytes& q4_bytes() {
  static const Q4Bytes b;
  return b;
}
// Q4Bytes' row (offset) of a type's nibble lookup: without the fifth bit, and with it (Q5's;
// Q4's second is not used); each kernel broadcasts the row to its vector width
constexpr int q4_table(int type) { return type == T_Q4_0 ? 1 : type == T_Q5_0 ? 2 : 0; }
constexpr int q5_high_table(int type) { return type == T_Q5_0 ? 0 : 3; }

// A tile reads one group of 16 rows, block after block: one sequential stream, which the
// hardware prefetchers follow. Two groups a tile (two streams 5.8 KB apart, the layout of
// sections 39-44) read from memory at half the rate: 1-row products of 120 [1536, 576] Q4_1
// layers (66 MB), bf16 kernel, 2-vCPU Zen 4, 46.3 -> 29.5 us a layer; one thread 8.8 -> 17.0
// GB/s, as fast as torch's sum over the same bytes (BENCHMARKS section 46). The prefetch below
// adds nothing to 1-2 rows' stream, but without it 4-8 rows (more arithmetic a byte) lost
// 10-25% in L3.
constexpr int64_t ROWS16_PREFETCH_BLOCKS = 8;

// the cache lines of block i + ROWS16_PREFETCH_BLOCKS of group g (a hint: an address past the
// copy's end does not fault)
static inline void prefetch_ahead(const uint8_t* WI, int64_t g, int64_t nb, int64_t i, int64_t BB) {
  const char* p = reinterpret_cast<const char*>(WI + (g * nb + i + ROWS16_PREFETCH_BLOCKS) * BB);
  for (int64_t c = 0; c < BB; c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
}

// The K-quant tiles' prefetch (every kernel): a fixed distance ahead in the group's stream (about
// the other types' 8 blocks), at sub-block sb of nsub the lines of its share of the super-block
// at p (BB bytes), and one more
static inline void prefetch_sub_block(const uint8_t* p, int64_t BB, int64_t nsub, int64_t sb) {
  const char* pf = reinterpret_cast<const char*>(p + sb * (BB / nsub) + 8 * 320);
  for (int64_t c = 0; c < BB / nsub + 64; c += 64) _mm_prefetch(pf + c, _MM_HINT_T0);
}

// f(std::integral_constant<int, TYPE>) for a copy's type (Q8_0 for any other): the one switch
// through which every interleaved kernel instantiates its walk per type
template <class F>
static void with_rows16_type(int type, const F& f) {
  using std::integral_constant;
  switch (type) {
    case T_Q4_0: return f(integral_constant<int, T_Q4_0>{});
    case T_Q4_1: return f(integral_constant<int, T_Q4_1>{});
    case T_Q5_0: return f(integral_constant<int, T_Q5_0>{});
    case T_Q5_1: return f(integral_constant<int, T_Q5_1>{});
    case T_Q4_K: return f(integral_constant<int, T_Q4_K>{});
    case T_Q5_K: return f(integral_constant<int, T_Q5_K>{});
    case T_Q6_K: return f(integral_constant<int, T_Q6_K>{});
    default: return f(integral_constant<int, T_Q8_0>{});
  }
}

// Every (group, row tile) of groups g0 .. g1 and M activation rows, as tile(MT, g, m0) with MT a
// std::integral_constant: tiles of up to MAXT rows (8; the AVX2 kernel's 4, for its 16 registers).
// Every interleaved kernel walks its tiles so.
template <int MAXT = 8, class Tile>
static void for_each_tile(int64_t M, int64_t g0, int64_t g1, const Tile& tile) {
  using std::integral_constant;
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t mt = std::min<int64_t>(MAXT, M - m0);
    auto each = [&](auto MT) {
      if constexpr (decltype(MT)::value <= MAXT)  // (tiles above MAXT are never made)
        for (int64_t g = g0; g < g1; ++g) tile(MT, g, m0);
    };
    switch (mt) {
      case 1: each(integral_constant<int, 1>{}); break;
      case 2: each(integral_constant<int, 2>{}); break;
      case 3: each(integral_constant<int, 3>{}); break;
      case 4: each(integral_constant<int, 4>{}); break;
      case 5: each(integral_constant<int, 5>{}); break;
      case 6: each(integral_constant<int, 6>{}); break;
      case 7: each(integral_constant<int, 7>{}); break;
      default: each(integral_constant<int, 8>{}); break;
    }
    m0 += mt;
  }
}
