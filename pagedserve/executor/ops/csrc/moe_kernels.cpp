// MoE experts on the CPU's matrix units through PyTorch's brgemm micro-kernel
// (at::native::cpublas::brgemm: oneDNN's ukernel, AMX tiles where the CPU has them), one call
// per layer and product for every expert, the way SGLang's and vLLM's CPU fused MoE run them.
//
// Weights: each expert's [N, K] matrix (F.linear's layout) packed once into blocks of BN output
// columns in the micro-kernel's VNNI layout ([N / BN][K / 2][BN][2] for bf16, by
// cpublas::pack). A product: rows grouped by expert (offsets), work items (expert, column
// block, chunk of up to CHUNK rows) split over OpenMP's team; each item runs its rows, BM at a
// time, against its block (which stays in L2), float32 sums rounded once to bf16. Idle experts cost
// nothing; each block of weights is read once per step whatever the number of rows.
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#include <immintrin.h>
#endif

namespace {

// o[j] = bf16(s[j]), round to nearest even (the conversion costs as much as a 32 x 64 block's
// product when done one element at a time)
inline void to_bf16(const float* s, at::BFloat16* o, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  for (; j + 16 <= n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + j)));
#endif
  for (; j < n; ++j) o[j] = at::BFloat16(s[j]);
}

constexpr int64_t BM = 32;     // activation rows per micro-kernel call
constexpr int64_t CHUNK = 512;  // rows an item runs against its block (1 MB of K = 1024 bf16: L2)

bool available() { return at::native::cpublas::could_pack(at::kBFloat16); }

// w [E, N, K] bf16 -> [E, N / bn, K / 2, bn, 2] (the micro-kernel's B blocks)
torch::Tensor pack_experts(torch::Tensor w, int64_t bn) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 3 && w.is_contiguous(), "w: contiguous bf16 [E, N, K]");
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK(bn > 0 && N % bn == 0 && K % 2 == 0, "N must be a multiple of the block, K even");
  TORCH_CHECK(available(), "this CPU's brgemm does not pack bf16");
  auto out = torch::empty({E, N / bn, K / 2, bn, 2}, w.options());
  const int64_t nb = N / bn;
  at::parallel_for(0, E * nb, 1, [&](int64_t i0, int64_t i1) {
    std::vector<at::BFloat16> t(K * bn);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = i / nb, b = i % nb;
      const at::BFloat16* src = w.data_ptr<at::BFloat16>() + (e * N + b * bn) * K;
      for (int64_t n = 0; n < bn; ++n)  // [bn, K] rows -> [K, bn] (B = W^T)
        for (int64_t k = 0; k < K; ++k) t[k * bn + n] = src[n * K + k];
      at::native::cpublas::pack(K, bn, bn, bn, at::kBFloat16, at::kBFloat16, t.data(),
                                out.data_ptr<at::BFloat16>() + (e * nb + b) * K * bn);
    }
  });
  return out;
}

// out[rows of e] = x[rows of e] @ W_e^T for every expert e: x [R, K] bf16 rows grouped by
// expert (offsets int64 [E + 1]), wp = pack_experts(W, bn) -> [R, N] bf16
torch::Tensor experts_mm(torch::Tensor x, torch::Tensor offsets, torch::Tensor wp) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bf16 [R, K]");
  TORCH_CHECK(wp.scalar_type() == at::kBFloat16 && wp.dim() == 5 && wp.is_contiguous() && wp.size(4) == 2,
              "wp: pack_experts' blocks");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.is_contiguous() &&
                  offsets.device().is_cpu() && offsets.size(0) == wp.size(0) + 1,
              "offsets: int64 [E + 1] on the CPU");
  const int64_t R = x.size(0), K = x.size(1), E = wp.size(0), nb = wp.size(1), bn = wp.size(3), N = nb * bn;
  TORCH_CHECK(wp.size(2) * 2 == K, "x's K must be the packed weights' K");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == R, "offsets must start at 0 and end at x's row count");
  for (int64_t e = 0; e < E; ++e) TORCH_CHECK(off[e + 1] >= off[e], "offsets must not decrease");
  auto out = torch::empty({R, N}, x.options());
  // items (expert, chunk of its rows, column block), in that order: a thread's consecutive
  // items share a chunk of rows, which stays in L2 while the blocks stream past it
  struct Item {
    int64_t e, r0, r1, b;
  };
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r0 = off[e]; r0 < off[e + 1]; r0 += CHUNK)
      for (int64_t b = 0; b < nb; ++b) items.push_back({e, r0, std::min(off[e + 1], r0 + CHUNK), b});
  const at::BFloat16* X = x.data_ptr<at::BFloat16>();
  const at::BFloat16* W = wp.data_ptr<at::BFloat16>();
  at::BFloat16* O = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, (int64_t)items.size(), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> c(BM * bn);
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      const int64_t b = it.b;
      const at::BFloat16* B = W + (it.e * nb + b) * K * bn;
      for (int64_t m0 = it.r0; m0 < it.r1; m0 += BM) {
        const int64_t mb = std::min(BM, it.r1 - m0);
        at::native::cpublas::brgemm(mb, bn, K, K, bn, bn, false, X + m0 * K, B, c.data());
        for (int64_t r = 0; r < mb; ++r) to_bf16(c.data() + r * bn, O + (m0 + r) * N + b * bn, bn);
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this CPU's brgemm packs bf16 (AMX or AVX512-BF16 micro-kernels)");
  m.def("pack_experts", &pack_experts, py::arg("w"), py::arg("bn"));
  m.def("experts_mm", &experts_mm, py::arg("x"), py::arg("offsets"), py::arg("wp"));
}
