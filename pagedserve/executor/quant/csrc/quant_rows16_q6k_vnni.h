// Q6_K under act_q8 ("gguf_q8": int8 activations) on its row-interleaved copy, AVX512-VNNI:
// one vpdpbusd adds 4 products to a dword of each of 16 output rows, as quant_rows16_vnni.h does
// for the other types. Included twice by quant_kernels.cpp: inside namespace avx512_vnni_rows16
// (the byte layout, SIX = false: CPUs without AVX512-VBMI, such as Cascade Lake) and inside
// namespace avx512_vnni_vbmi, a target region that adds AVX512-VBMI (the six-bit layout, SIX =
// true). No include guard on purpose.
//
// A step reads elements 4 s .. 4 s + 3 of a sub-block of 16 for the 16 rows into one register,
// lane r: row r's four quants as unsigned bytes, in order:
//   six bits (quant_rows16_layout.h: run p holds the pairs (2 p, 2 p + 1), field 2 r + h at bits
//   6 (2 r + h)): the runs 2 s and 2 s + 1 are 48 adjacent bytes. One vpermb puts the 3 + 3 bytes
//   of rows 2 j and 2 j + 1 in qword j, one vpmultishiftqb takes each quant's byte from its bit
//   (lane 2 j: bits 0, 6, 24, 30; lane 2 j + 1: 12, 18, 36, 42), an and keeps 6 bits: the
//   quant + 32, 0 .. 63;
//   bytes (byte [e][r] = row r's quant - 32, int8): Q8_0's transpose (a dword permute and a
//   vpshufb), xor 0x80: the quant + 96, 96 .. 159.
// The offset (32, or 128 from the centred quant) is taken back exactly: each half block's sum
// starts from -32 (or -128) * sum(its 16 x quants) (GemmQ8Args::xc holds -32 * that sum).
//
// Numerics: the VNNI many-row kernel's (quant_vnni.h's q8_micro16 for Q6_K), lane for lane: per
// output row and block of 32 the exact integer s = sa * sum_a + sb * sum_b (the two halves'
// centred sums times their int8 scales; at most 2 * 16 * 32 * 127 * 128 < 2^24 in magnitude), then acc =
// fma(float(s), d_w * d_x, acc). So a row's bits equal the many-row kernel's on the packed rows
// (tests), do not depend on the rows computed with it, and prefill and decode round alike.

struct Q6kQ8Steps {
  __m512i gather, shifts;  // (six bits) qword j's bytes; each byte's bit in its qword
  __m512i dwords, bytes;   // (bytes) Q8_0's transpose
};

static inline Q6kQ8Steps q6k_q8_steps() {
  alignas(64) uint8_t gather[64];
  for (int b = 0; b < 64; ++b) {
    const int j = b / 8, k = b % 8;  // qword j, byte k: run 2 s's bytes 3 j .. 3 j + 2, then run 2 s + 1's
    gather[b] = uint8_t(k < 3 ? 3 * j + k : k < 6 ? 24 + 3 * j + k - 3 : 0);
  }
  return {_mm512_load_si512(gather), _mm512_set1_epi64(0x2A24120C1E180600ll),
          _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
          _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15))};
}

// Step s (0 .. 3) of the sub-block at q: lane r = row r's quants 4 s .. 4 s + 3, unsigned
template <bool SIX>
static inline __m512i q6k_q8_step(const uint8_t* q, int64_t s, const Q6kQ8Steps& st) {
  if constexpr (SIX) {  // 48 bytes (a masked load: none past the copy's end)
    const __m512i v = _mm512_maskz_loadu_epi8(0xFFFFFFFFFFFFull, q + 48 * s);
    const __m512i f = _mm512_multishift_epi64_epi8(st.shifts, _mm512_permutexvar_epi8(st.gather, v));
    return _mm512_and_si512(f, _mm512_set1_epi8(63));
  } else {
    const __m512i v = _mm512_loadu_si512(q + 64 * s);
    const __m512i t = _mm512_shuffle_epi8(_mm512_permutexvar_epi32(st.dwords, v), st.bytes);
    return _mm512_xor_si512(t, _mm512_set1_epi8((char)0x80));
  }
}

// out[m0 + t][16 g .. 16 g + 15] for group g and MT activation rows from m0 (a.xq in K order,
// a.xc the half blocks' -32 * sum(x quants)). Prefetch as the other K-quant tiles, from 2 rows.
template <bool SIX, int MT>
static void rows16_q8_tile_q6k(const GemmQ8Args& a, const uint8_t* WI, int64_t g, int64_t m0, const Q6kQ8Steps& st) {
  const int64_t ns = a.K / 256, nb = a.K / 32, kd = a.K / 4;
  const int64_t sub = SIX ? Q6K_SUB6 : Q6K_SUB, BB = Q6K_HDR + 16 * sub;
  const int32_t start = SIX ? 1 : 4;  // xc times this: the offset 32 (six bits) or 128 (bytes)
  const int32_t* x = reinterpret_cast<const int32_t*>(a.xq) + m0 * kd;  // row t's dword k: x[t kd + k]
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < ns; ++i) {
    const uint8_t* p = WI + (g * ns + i) * BB;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t b = i * 8 + j;  // the block of 32 along K: sub-blocks 2 j and 2 j + 1
      __m512i s[2][MT];
      for (int64_t h = 0; h < 2; ++h) {
        if constexpr (MT >= 2) prefetch_sub_block(p, BB, 16, 2 * j + h);
        const uint8_t* q = p + Q6K_HDR + sub * (2 * j + h);
        for (int t = 0; t < MT; ++t) s[h][t] = _mm512_set1_epi32(start * a.xc[((m0 + t) * nb + b) * 2 + h]);
#pragma GCC unroll 4
        for (int64_t k = 0; k < 4; ++k) {
          const __m512i w = q6k_q8_step<SIX>(q, k, st);
          for (int t = 0; t < MT; ++t)
            s[h][t] = _mm512_dpbusd_epi32(s[h][t], w, _mm512_set1_epi32(x[t * kd + 8 * b + 4 * h + k]));
        }
      }
      auto scales = [&](int64_t sb) {
        return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * sb)));
      };
      const __m512i sa = scales(2 * j), sb = scales(2 * j + 1);
      for (int t = 0; t < MT; ++t) {
        const __m512i i32 = _mm512_add_epi32(_mm512_mullo_epi32(s[0][t], sa), _mm512_mullo_epi32(s[1][t], sb));
        const __m512 sc = _mm512_mul_ps(d, _mm512_set1_ps(a.xd[(m0 + t) * nb + b]));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32), sc, acc[t]);
      }
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16, acc[t]);
}

// Groups g0 .. g1 of the copy WI (16 output rows each) for all a.M activation rows
template <bool SIX>
static void gemm_rows16_q8_q6k(const GemmQ8Args& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  const Q6kQ8Steps st = q6k_q8_steps();
  for_each_tile(a.M, g0, g1, [&](auto MT, int64_t g, int64_t m0) {
    rows16_q8_tile_q6k<SIX, decltype(MT)::value>(a, WI, g, m0, st);
  });
}
