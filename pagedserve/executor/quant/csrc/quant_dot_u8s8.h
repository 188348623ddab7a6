// The integer sums of unsigned x signed byte products in the act_q8 kernels written in AVX2
// (quant_avx2_q8.h, quant_avx2_q8_many.h, quant_rows16_q8_avx2.h), for the target they are
// compiled for. AVX2: vpmaddubsw sums pairs in 16 bits, dot_add adds a step's pairs to 16-bit
// sums and dot_widen takes them to 32 bits (vpmaddwd by ones); each site bounds its 16-bit sums
// (none saturates or overflows). AVX-VNNI (QK_AVX_VNNI 1, quant_kernels.cpp's avx_vnni
// namespaces): one vpdpbusd per step into 32-bit sums, dot_widen the identity. The same integers
// either way: the AVX-VNNI kernels give the AVX2 kernels' bits. Included inside each kernel
// file's namespace. No include guard on purpose.
#if QK_AVX_VNNI
constexpr bool kVnni = true;
static inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
static inline __m256i dot_widen(__m256i acc) { return acc; }
#else
constexpr bool kVnni = false;
static inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
}
static inline __m256i dot_widen(__m256i acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
#endif
