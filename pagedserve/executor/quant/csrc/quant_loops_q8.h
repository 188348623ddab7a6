// The ISA-neutral act_q8 few-row loop over an ISA's integer tiles (gemm_q8_tile<TYPE, MT>,
// gemm_q8_tile_kmin<TYPE, MT> for Q4_K / Q5_K, gemm_q8_tile_q6k<MT>), included by quant_loops.h
// in each ISA's namespace and by quant_kernels.cpp in namespace avx_vnni (quant_avx2_q8.h's
// tiles compiled for AVX-VNNI). No include guard on purpose.

template <int TYPE>
static void gemm_q8(const GemmQ8Args& g, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    row_tiles(g.M, [&](auto mt, int64_t m0) {
      if constexpr (TYPE == T_Q4_K || TYPE == T_Q5_K)
        gemm_q8_tile_kmin<TYPE, decltype(mt)::value>(g, n, m0);
      else if constexpr (TYPE == T_Q6_K)
        gemm_q8_tile_q6k<decltype(mt)::value>(g, n, m0);
      else
        gemm_q8_tile<TYPE, decltype(mt)::value>(g, n, m0);
    });
}

static void gemm_q8_rows(const GemmQ8Args& g, int64_t n0, int64_t n1) {
  switch (g.type) {
    case T_Q4_K: gemm_q8<T_Q4_K>(g, n0, n1); break;
    case T_Q5_K: gemm_q8<T_Q5_K>(g, n0, n1); break;
    case T_Q6_K: gemm_q8<T_Q6_K>(g, n0, n1); break;
    case T_Q4_0: gemm_q8<T_Q4_0>(g, n0, n1); break;
    case T_Q4_1: gemm_q8<T_Q4_1>(g, n0, n1); break;
    default: gemm_q8<T_Q8_0>(g, n0, n1); break;
  }
}
