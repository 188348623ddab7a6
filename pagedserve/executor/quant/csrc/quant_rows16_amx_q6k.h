// Q6_K's six-bit copy (quant_rows16_layout.h) as the AMX tile kernel's B operand
// (quant_rows16_amx.h): one block of 32 along K of a 16-row group, its two sub-blocks of 16, as 16
// tile rows of the 16 rows' element pairs in bf16. quant_rows16_q6k_vbmi.h's run decoder gives a
// run's pairs as bf16(q - 32) in the tile row's order already; each is scaled by its row's d sc in
// float32 (ggml's dequantization: d sc exact, times q - 32 rounded once) and rounded once to bf16
// (round to nearest even), the bf16 copy's weights. Included by quant_kernels.cpp inside namespace
// avx512_bf16_vbmi (AVX512-BF16 and VBMI; every AMX CPU has both), called by the tile kernel's
// NextItem (another target region: a call per block). No include guard on purpose.

// Block h (0 .. 7: sub-blocks 2 h, 2 h + 1) of the group's super-block at p -> 16 tile rows at dst
inline void amx_b_rows_q6k_six(const uint8_t* p, int64_t h, uint16_t* dst) {
  using rows16_layout::Q6K_HDR, rows16_layout::Q6K_SUB6;
  static const avx512_vbmi::SixBitTables tb = avx512_vbmi::six_bit_tables();
  const __m512i idx = _mm512_load_si512(rows16_layout::PAIR_INDEX), top = _mm512_set1_epi32(int(0xFFFF0000u));
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  for (int64_t s = 0; s < 2; ++s) {
    const int64_t sb = 2 * h + s;
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * sb));  // [sub-block][row]
    const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
    const uint8_t* q = p + Q6K_HDR + Q6K_SUB6 * sb;
    for (int64_t pr = 0; pr < 8; ++pr) {
      const __m512i w = avx512_vbmi::six_bit_run(q, pr, tb);  // row r: bf16(q[2 pr] - 32) | bf16(q[2 pr + 1] - 32) << 16
      const __m512 lo = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), scale);
      const __m512 hi = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(w, top)), scale);
      _mm512_storeu_si512(dst + 32 * (8 * s + pr), _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
}

// Sub-blocks sb .. sb + 3 (sb a multiple of 4) of the group's super-block at p -> 8 tile rows
// each, at dst + stride j, for the exact few-row kernel (quant_rows16_amx_exact.h): row pr = the
// 16 rows' pair (2 pr, 2 pr + 1) as bf16(q - 32), unscaled (exact: |q - 32| <= 32), as the run
// decoder gives them. Four a call: a call per sub-block cost a batch-1 step ~10%.
inline void amx_exact_words_q6k(const uint8_t* p, int64_t sb, uint16_t* dst, int64_t stride) {
  static const avx512_vbmi::SixBitTables tb = avx512_vbmi::six_bit_tables();
  for (int64_t j = 0; j < 4; ++j) {
    const uint8_t* q = p + rows16_layout::Q6K_HDR + rows16_layout::Q6K_SUB6 * (sb + j);
    for (int64_t pr = 0; pr < 8; ++pr) _mm512_storeu_si512(dst + stride * j + 32 * pr, avx512_vbmi::six_bit_run(q, pr, tb));
  }
}
