#pragma once
// exp16: e^x on 16 float lanes (AVX-512), one definition for the kernels that need it: the
// attention module's softmaxes (paged decode, prefill on the AMX tiles) and the fused ops'
// bfloat16 SiLU. Built into each module (cpp_build copies it beside their sources).
#if defined(__AVX512F__)
#include <immintrin.h>

// exp(x) for 16 lanes (Cephes' expf: n = round(x log2 e), r = x - n ln 2 in two parts, a
// degree-7 polynomial, then scaled by 2^n; within 2 ulp of expf); lanes below -87.3 (where
// expf leaves the normal range) and -inf give 0, a NaN stays NaN. The softmax no longer
// depends on the compiler vectorizing std::exp: a build of this file with an unrelated
// change left the exponentials as scalar expf calls, a fifth of the kernel's time at 64
// rows of context 320 (BENCHMARKS section 36); where it does vectorize them (libmvec) this
// is as fast. (The AVX2 path keeps std::exp: not measured on an AVX2 CPU.)
static inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365447f), _CMP_NLT_UQ);
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}
#endif  // __AVX512F__
