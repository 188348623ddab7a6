// ISA-neutral loops over an ISA's kernels, included last by each ISA's kernel file
// (quant_scalar.h, quant_avx2.h, quant_avx512.h) inside that ISA's namespace. They need from
// the file: dot(), gemm_fused_tile<TYPE, MT>, gemm_q8_tile<TYPE, MT>, gemm_q8_tile_kmin<TYPE, MT>
// (Q4_K, Q5_K), gemm_q8_tile_q6k<MT>, deq_fast<TYPE> (the ISA's fastest Q4_0 / Q4_1 / Q8_0 row dequantizer)
// and gemm_avx2_tiles (its K-quant, Q5_0 and Q5_1 few-row products, or false:
// quant_kquant_avx2.h). No include guard on purpose (one copy per ISA namespace).

// The ISA's fastest row dequantizer of a type
static deq_fn best_deq_for(int type) {
  switch (type) {
    case T_Q4_0: return deq_fast<T_Q4_0>;
    case T_Q4_1: return deq_fast<T_Q4_1>;
    case T_Q8_0: return deq_fast<T_Q8_0>;
    default: return deq_for(type);
  }
}

// Any type: dequantize a row into buf, then one dot product per activation row.
static void gemm_generic(const GemmArgs& g, int64_t n0, int64_t n1) {
  std::vector<float> buf(g.K);
  deq_fn f = deq_for(g.type);
  for (int64_t n = n0; n < n1; ++n) {
    f(g.W + n * g.rb, buf.data(), g.K);
    for (int64_t m = 0; m < g.M; ++m) g.out[m * g.ldo + n] = dot(g.X + m * g.K, buf.data(), g.K);
  }
}

template <int TYPE>
static void gemm_fused(const GemmArgs& g, int64_t n0, int64_t n1) {
  // one output row at a time, all activation rows for it: the packed row is read from
  // memory once per call and stays in L1 for every tile
  for (int64_t n = n0; n < n1; ++n)
    row_tiles(g.M, [&](auto mt, int64_t m0) { gemm_fused_tile<TYPE, decltype(mt)::value>(g, n, m0); });
}

static void dequant_rows(int type, const uint8_t* W, int64_t rb, int64_t K, const int64_t* rows, int64_t r0,
                         int64_t r1, float* out) {
  const deq_fn f = best_deq_for(type);
  for (int64_t r = r0; r < r1; ++r) f(W + (rows ? rows[r] : r) * rb, out + r * K, K);
}

static void gemm_rows(const GemmArgs& g, int64_t n0, int64_t n1) {
  switch (g.type) {
    case T_Q4_0: gemm_fused<T_Q4_0>(g, n0, n1); break;
    case T_Q4_1: gemm_fused<T_Q4_1>(g, n0, n1); break;
    case T_Q8_0: gemm_fused<T_Q8_0>(g, n0, n1); break;
    default:
      if (!gemm_avx2_tiles(g, n0, n1)) gemm_generic(g, n0, n1);  // the AVX2 tiles (K-quants, Q5_0 / Q5_1), if any
      break;
  }
}

#include "quant_loops_q8.h"  // gemm_q8_rows
