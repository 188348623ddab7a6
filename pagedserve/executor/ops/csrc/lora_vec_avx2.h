// The AVX2 + FMA vector primitives of the LoRA kernels (lora_tiles.h): 8 floats a vector, tails
// through a stack buffer. Included by lora_kernels.cpp inside `namespace avx2` and its target
// region, before lora_tiles.h. No include guard on purpose.

constexpr int VW = 8;  // floats per vector
using vf = __m256;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vset1(float v) { return _mm256_set1_ps(v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vload(const float* p, int n) {
  if (n >= 8) return _mm256_loadu_ps(p);
  alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(t, p, sizeof(float) * n);
  return _mm256_load_ps(t);
}
static inline vf vload(const uint16_t* p, int n) {
  __m128i h;
  if (n >= 8) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(t, p, sizeof(uint16_t) * n);
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(t));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline void vstore(float* p, vf v, int n) {
  if (n >= 8) return _mm256_storeu_ps(p, v);
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  std::memcpy(p, t, sizeof(float) * n);
}
static inline void vstore(uint16_t* p, vf v, int n) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int i = 0; i < std::min(n, 8); ++i) p[i] = f2bf(t[i]);
}
constexpr int NC = 1;  // column vectors per expand block
