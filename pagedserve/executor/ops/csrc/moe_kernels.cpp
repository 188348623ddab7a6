// MoE experts on the CPU's matrix units, one call per layer and product for every expert (the
// way SGLang's and vLLM's CPU fused MoE run them): rows grouped by expert (offsets), work items
// (expert, chunk of rows, block of columns) handed to OpenMP's team costliest first, float32 sums
// rounded once to bf16. Idle experts cost nothing; each block of weights is read once per step
// from memory whatever the number of rows, then from L2 for each further 32 rows.
//
// Weights: each expert's [N, K] matrix (F.linear's layout) packed once into blocks of bn output
// columns in the VNNI layout ([N / bn][K / 2][bn][2], by cpublas::pack). Two kernels:
//   - AMX-BF16 (compiled where the compiler targets it, run where Linux grants the tiles), bn =
//     16: a 16-column block is K * 16 contiguous elements, so each B tile (16 pairs of K x 16
//     columns) is 1 KB of contiguous memory, streamed in order; C in 32 x 32 blocks, four float
//     tiles over the whole K. Items: up to AMX_CHUNK rows x up to 256 columns (~1 MB of
//     weights, kept in L2 across the item's row blocks). 1.3-1.4x brgemm at 64-1,024 rows an
//     expert, the same bits (BENCHMARKS section 39).
//   - any other block (bn = 64 elsewhere): PyTorch's brgemm micro-kernel (at::native::cpublas:
//     oneDNN's ukernel: AMX or AVX512-BF16), BM rows x bn columns a call, items of up to CHUNK
//     rows x one block.
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "work_queue.h"

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDSERVE_MOE_AMX 1
#include "amx_tiles.h"  // TileConfig, load_tile_config, tiles_granted
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

#if PAGEDSERVE_MOE_AMX
// The AMX kernel's tiles: 0-1 A (rows 0-15, 16-31 of a 32-row block), 2-3 B (two 16-column
// blocks), 4-7 C (float32 sums, rows 0-15 / 16-31 x columns 0-15 / 16-31).
namespace amx {

constexpr int64_t AMX_CHUNK = 1024;  // rows an item runs (more rows per item: fewer reloads of its columns)

// tiles for a block of m rows (1..32)
inline void configure(int64_t m) {
  TileConfig c;
  const uint8_t m0 = static_cast<uint8_t>(std::min<int64_t>(m, 16)), m1 = static_cast<uint8_t>(std::max<int64_t>(m - 16, 1));
  const uint8_t rows[8] = {m0, m1, 16, 16, m0, m0, m1, m1};
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = rows[i];
  }
  load_tile_config(c);
}

// C[m x 32] (float, ldc) = A[m x K] (lda) @ B, B two 16-column groups at b0 and b0 + K * 16
template <bool TWO>
inline void block(const at::BFloat16* a, int64_t lda, const at::BFloat16* b0, int64_t K, float* c, int64_t ldc) {
  const at::BFloat16* b1 = b0 + K * 16;
  const at::BFloat16* a1 = a + 16 * lda;
  _tile_zero(4);
  _tile_zero(5);
  if (TWO) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(0, a + k, lda * 2);
    _tile_stream_loadd(2, b0 + k * 16, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_stream_loadd(3, b1 + k * 16, 64);
    _tile_dpbf16ps(5, 0, 3);
    if (TWO) {
      _tile_loadd(1, a1 + k, lda * 2);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, c, ldc * 4);
  _tile_stored(5, c + 16, ldc * 4);
  if (TWO) {
    _tile_stored(6, c + 16 * ldc, ldc * 4);
    _tile_stored(7, c + 16 * ldc + 16, ldc * 4);
  }
}

struct Thread {
  int64_t m = -1;  // rows of the loaded tile config
  alignas(64) float c[32 * 32];
  Thread() = default;
  Thread(const Thread&) = delete;
  ~Thread() { _tile_release(); }
};

}  // namespace amx
#endif

constexpr int64_t BM = 32;     // brgemm: activation rows per micro-kernel call
constexpr int64_t CHUNK = 512;  // brgemm: rows an item runs against its block (1 MB of K = 1024 bf16: L2)

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

#if PAGEDSERVE_MOE_AMX
// experts_mm on the tiles (weights packed with bn = 16; N and K multiples of 32): an item runs
// its rows 32 at a time, each block against its columns 32 at a time.
void amx_experts_mm(const at::BFloat16* X, const int64_t* off, int64_t E, int64_t K, int64_t N,
                    const at::BFloat16* W, at::BFloat16* O) {
  // columns per item: their weights (NT x K bf16) at most ~1 MB, half this L2, 32 to 256
  const int64_t NT = std::min(N, std::clamp<int64_t>((int64_t{1} << 19) / K / 32 * 32, 32, 256));
  struct Item {
    int64_t cost, e, r0, r1, n0, n1;
  };
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r0 = off[e]; r0 < off[e + 1]; r0 += amx::AMX_CHUNK)
      for (int64_t n0 = 0; n0 < N; n0 += NT) {
        const int64_t r1 = std::min(off[e + 1], r0 + amx::AMX_CHUNK);
        items.push_back({r1 - r0, e, r0, r1, n0, std::min(N, n0 + NT)});
      }
  costliest_first(
      items, [] { return amx::Thread(); },
      [&](amx::Thread& t, const Item& it) {
        const at::BFloat16* B = W + it.e * N * K;
        for (int64_t m0 = it.r0; m0 < it.r1; m0 += 32) {
          const int64_t mb = std::min<int64_t>(32, it.r1 - m0);
          if (mb != t.m) {
            amx::configure(mb);
            t.m = mb;
          }
          for (int64_t n = it.n0; n < it.n1; n += 32) {
            if (mb > 16)
              amx::block<true>(X + m0 * K, K, B + n * K, K, t.c, 32);
            else
              amx::block<false>(X + m0 * K, K, B + n * K, K, t.c, 32);
            for (int64_t r = 0; r < mb; ++r) to_bf16(t.c + r * 32, O + (m0 + r) * N + n, 32);
          }
        }
      });
}
#endif

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
#if PAGEDSERVE_MOE_AMX
  if (bn == 16 && N % 32 == 0 && K % 32 == 0 && tiles_granted()) {
    amx_experts_mm(x.data_ptr<at::BFloat16>(), off, E, K, N, wp.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
    return out;
  }
#endif
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
  m.def("amx", [] {
#if PAGEDSERVE_MOE_AMX
    return tiles_granted();
#else
    return false;
#endif
  }, "whether experts_mm runs its own AMX tiles on 16-column blocks");
  m.def("pack_experts", &pack_experts, py::arg("w"), py::arg("bn"));
  m.def("experts_mm", &experts_mm, py::arg("x"), py::arg("offsets"), py::arg("wp"));
  m.def("combine", &combine, py::arg("ys"), py::arg("inv"), py::arg("w"));
}
