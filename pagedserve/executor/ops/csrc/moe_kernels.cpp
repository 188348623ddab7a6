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

#include "work_queue.h"

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
  // items (expert, chunk of its rows, column block), costliest (most rows) first from a shared
  // counter: routing is uneven, and a static split of the items left one thread with the big
  // experts' chunks. Consecutive items of a thread mostly share a chunk of rows, which stays in
  // L2 while the blocks stream past it.
  struct Item {
    int64_t cost, e, r0, r1, b;
  };
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r0 = off[e]; r0 < off[e + 1]; r0 += CHUNK)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t r1 = std::min(off[e + 1], r0 + CHUNK);
        items.push_back({r1 - r0, e, r0, r1, b});
      }
  const at::BFloat16* X = x.data_ptr<at::BFloat16>();
  const at::BFloat16* W = wp.data_ptr<at::BFloat16>();
  at::BFloat16* O = out.data_ptr<at::BFloat16>();
  struct Thread {  // a thread's float sums; the micro-kernel's hardware state released at the end
    std::vector<float> c;
    explicit Thread(int64_t n) : c(n) {}
    Thread(const Thread&) = delete;
    ~Thread() { at::native::cpublas::brgemm_release(); }
  };
  costliest_first(
      items, [&] { return Thread(BM * bn); },
      [&](Thread& t, const Item& it) {
        const at::BFloat16* B = W + (it.e * nb + it.b) * K * bn;
        for (int64_t m0 = it.r0; m0 < it.r1; m0 += BM) {
          const int64_t mb = std::min(BM, it.r1 - m0);
          at::native::cpublas::brgemm(mb, bn, K, K, bn, bn, false, X + m0 * K, B, t.c.data());
          for (int64_t r = 0; r < mb; ++r) to_bf16(t.c.data() + r * bn, O + (m0 + r) * N + it.b * bn, bn);
        }
      });
  return out;
}

// out[t] = sum_j bf16(ys[inv[t * k + j]] * w[t, j]) for the T tokens: each token's k expert
// outputs (rows of ys in expert order; inv: row of pair (t, j)) weighted and summed, each
// product rounded to bf16 and the sum (in float32) rounded once, as the unfused
// `(pairs.float() * w).to(bf16).sum(1)` (w float32) or `(pairs * w).sum(1)` (w bf16) does.
// One pass instead of a gather, a float copy, a product, a rounding and a sum.
torch::Tensor combine(torch::Tensor ys, torch::Tensor inv, torch::Tensor w) {
  TORCH_CHECK(ys.scalar_type() == at::kBFloat16 && ys.dim() == 2 && ys.is_contiguous(), "ys: contiguous bf16 [R, H]");
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16), "w: [T, k] f32/bf16");
  const int64_t T = w.size(0), k = w.size(1), H = ys.size(1), R = ys.size(0);
  auto iv = inv.contiguous();
  TORCH_CHECK(iv.scalar_type() == at::kLong && iv.numel() == T * k && R == T * k, "inv: int64 [T * k]; ys: T * k rows");
  const auto wf = w.to(at::kFloat).contiguous();
  const int64_t* ip = iv.data_ptr<int64_t>();
  for (int64_t i = 0; i < T * k; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < R, "inv: a row outside ys");
  auto out = torch::empty({T, H}, ys.options());
  const at::BFloat16* Y = ys.data_ptr<at::BFloat16>();
  const float* Wt = wf.data_ptr<float>();
  at::BFloat16* O = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(H);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const at::BFloat16* y = Y + ip[t * k + j] * H;
        const float wj = Wt[t * k + j];
        for (int64_t h = 0; h < H; ++h) acc[h] += static_cast<float>(at::BFloat16(static_cast<float>(y[h]) * wj));
      }
      to_bf16(acc.data(), O + t * H, H);
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this CPU's brgemm packs bf16 (AMX or AVX512-BF16 micro-kernels)");
  m.def("pack_experts", &pack_experts, py::arg("w"), py::arg("bn"));
  m.def("experts_mm", &experts_mm, py::arg("x"), py::arg("offsets"), py::arg("wp"));
  m.def("combine", &combine, py::arg("ys"), py::arg("inv"), py::arg("w"));
}
