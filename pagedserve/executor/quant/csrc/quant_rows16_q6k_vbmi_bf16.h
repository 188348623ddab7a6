// The bf16 kernel's tile on Q6_K's six-bit copy (few-row products of bf16 models: decode at
// batch 1-8, verification rows), on CPUs with AVX512-VBMI beside AVX512-BF16 (Zen 4, Sapphire
// Rapids and later): quant_rows16_q6k_vbmi.h's run decoder, then quant_rows16_bf16.h's vdpbf16ps
// chains. Included once by quant_kernels.cpp inside namespace avx512_bf16_vbmi within the
// AVX512-BF16 + VBMI target region. No include guard on purpose.

// quant_rows16_bf16.h's tile_q6k on the six-bit layout: per sub-block of 16 elements its 8 runs,
// pair p into chain p & 1, then acc += (s_even + s_odd) * (d sc)
template <int MT>
static void tile_q6k_six(const avx512_bf16_rows16::Rows16Bf16Args& a, const uint8_t* WI, int64_t g, int64_t m0,
                         const avx512_vbmi::SixBitTables& tb) {
  using rows16_layout::Q6K_HDR, rows16_layout::Q6K_SUB6;
  const int64_t ns = a.K / 256, BB = Q6K_HDR + 16 * Q6K_SUB6;
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < ns; ++i) {
    const uint8_t* p = WI + (g * ns + i) * BB;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int64_t sb = 0; sb < 16; ++sb) {
      rows16_layout::prefetch_sub_block(p, BB, 16, sb);
      const __m512 scale = avx512_rows16::q6k_scale(p, d, sb);
      __m512 s[2][MT];
      for (int e = 0; e < 2; ++e)
        for (int t = 0; t < MT; ++t) s[e][t] = _mm512_setzero_ps();
      const uint8_t* q = p + Q6K_HDR + Q6K_SUB6 * sb;
      const uint32_t* x = a.X2 + (i * 256 + sb * 16) / 2;
#pragma GCC unroll 8
      for (int64_t pr = 0; pr < 8; ++pr) {
        const __m512bh wq = (__m512bh)avx512_vbmi::six_bit_run(q, pr, tb);
        for (int t = 0; t < MT; ++t)
          s[pr & 1][t] = avx512_bf16_rows16::dp_bcast(s[pr & 1][t], wq, x + (m0 + t) * (a.K / 2) + pr);
      }
      for (int t = 0; t < MT; ++t) acc[t] = _mm512_fmadd_ps(_mm512_add_ps(s[0][t], s[1][t]), scale, acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_storeu_ps(a.out + (m0 + t) * a.ldo + g * 16, acc[t]);
}

// Groups g0 .. g1 of every activation row, in the other kernels' tiles
static void gemm_q6k_six(const avx512_bf16_rows16::Rows16Bf16Args& a, const uint8_t* WI, int64_t g0, int64_t g1) {
  const avx512_vbmi::SixBitTables tb = avx512_vbmi::six_bit_tables();
  rows16_layout::for_each_tile(a.M, g0, g1, [&](auto MT, int64_t g, int64_t m0) {
    tile_q6k_six<decltype(MT)::value>(a, WI, g, m0, tb);
  });
}
