#pragma once
// transpose16x16_epi32: a 16 x 16 matrix of 32-bit elements, one row per AVX-512 register,
// transposed in registers. One definition for the quant kernels' bf16 tiles (quant_bf16.h,
// included inside that module's AVX-512 target region and namespace) and the attention
// module's K packing (prefill_amx.h); cpp_build copies it beside their sources.

// 16 x 16 dwords in place: afterwards e[s] lane c = (before) e[c] lane s
static inline void transpose16x16_epi32(__m512i* e) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // within each 128-bit lane: a0 b0 a1 b1 / a2 b2 a3 b3
    t[i] = _mm512_unpacklo_epi32(e[i], e[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(e[i], e[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + j], 128-bit lane L: rows i..i+3 of column 4L + j
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // a 4 x 4 transpose of 128-bit lanes over u[j], u[4 + j], u[8 + j], u[12 + j]
    const __m512i s0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), s1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    e[j] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    e[4 + j] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    e[8 + j] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    e[12 + j] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}
