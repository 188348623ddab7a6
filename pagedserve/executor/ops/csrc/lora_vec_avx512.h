// The AVX-512 F/BW/VL vector primitives of the LoRA kernels (lora_tiles.h): 16 floats a
// vector, tails by mask. Included by lora_kernels.cpp inside `namespace avx512` (and
// `avx512_bf16`) and its target region, before lora_tiles.h. No include guard on purpose.

constexpr int VW = 16;  // floats per vector
using vf = __m512;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vset1(float v) { return _mm512_set1_ps(v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline __mmask16 lanes(int n) { return (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1u); }
static inline vf vload(const float* p, int n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
static inline vf vload(const uint16_t* p, int n) {
  const __m256i h = _mm256_maskz_loadu_epi16(lanes(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline void vstore(float* p, vf v, int n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
static inline void vstore(uint16_t* p, vf v, int n) {  // round to nearest even, NaN quiet (as c10)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtepi32_epi16(r));
}
constexpr int NC = 2;  // column vectors per expand block (8 rows x 2: 16 accumulators)
