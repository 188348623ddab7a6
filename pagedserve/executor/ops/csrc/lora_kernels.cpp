// Many LoRA adapters in one batch on the CPU (pagedserve.executor.lora): the fused shrink +
// expand of one wrapped layer for all of a step's adapter segments (Punica's SGMV idea).
//
//   lora_apply_(x [T, in], y [T, out] (in place), a [S, in, R], b [S, R, out], rows [n],
//               tiles [G, 3], cols [P + 1], rank)
//     rows: the adapter tokens' row ids, grouped by slot; tiles: (slot, offset into rows,
//     count <= 8) per tile of one segment; cols: the column bounds of the P parts of a fused
//     layer (q/k/v, gate/up: B block-diagonal, part p's rank rows p*rank.. meet only its
//     columns; P = 1: every row meets every column).
//     y[rows[i]] += (x[rows[i]] @ a[slot]) @ b[slot], per tile: A and B read once for its rows,
//     no gathered copies, no index_add; tiles split over OpenMP's team (at::parallel_for).
//   x, a, b: float32 or bfloat16 (one dtype); y: float32 or bfloat16.
//
// One file of vector primitives per ISA (lora_vec_avx2.h, lora_vec_avx512.h) under one kernel
// source (lora_tiles.h), plus vdpbf16ps kernels for AVX512-BF16 (lora_bf16.h); each ISA is a
// target region of this file (no -march flags), chosen at run time (CPUID; `set_isa` forces one,
// tests run each). A CPU with none: `isa_available(1)` is false and the Python side runs its
// PyTorch reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "isa_target.h"  // ISA_TARGET_BEGIN / END: a region compiled for one instruction set

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LK_X86 1
#else
#define LK_X86 0
#endif

static inline float bf2f(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f2bf(float f) {  // c10::BFloat16's rounding: nearest even, NaN -> 0x7fc0
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename TW, typename TY>
struct LoraArgs {
  const TW* x;
  TY* y;
  const TW* a;
  const TW* b;
  const int64_t* rows;
  const int64_t* cols;
  int64_t sx, sy, in, R, out, parts, rank;
};

#if LK_X86
ISA_TARGET_BEGIN("avx2,fma")
namespace avx2 {
#include "lora_vec_avx2.h"
#include "lora_tiles.h"
}  // namespace avx2
ISA_TARGET_END()

ISA_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx2,fma")
namespace avx512 {
#include "lora_vec_avx512.h"
#include "lora_tiles.h"
}  // namespace avx512
ISA_TARGET_END()

ISA_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")
namespace avx512_bf16 {
#include "lora_vec_avx512.h"
#include "lora_tiles.h"
#include "lora_bf16.h"
}  // namespace avx512_bf16
ISA_TARGET_END()
#endif  // LK_X86

enum { ISA_NONE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3 };

static bool cpu_has(int64_t isa) {
#if LK_X86 && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == ISA_AVX2) return avx2;
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  if (isa == ISA_AVX512) return avx512;
  if (isa == ISA_AVX512_BF16) return avx512 && __builtin_cpu_supports("avx512bf16");
#endif
  return isa == ISA_NONE;
}

static int64_t g_isa = -1;
static int64_t current() {
  if (g_isa < 0) {
    g_isa = ISA_NONE;
    for (int64_t i = ISA_AVX512_BF16; i > ISA_NONE && g_isa == ISA_NONE; --i)
      if (cpu_has(i)) g_isa = i;
  }
  return g_isa;
}
bool isa_available(int64_t isa) { return cpu_has(isa); }
int64_t get_isa() { return current(); }
int64_t set_isa(int64_t isa) {
  TORCH_CHECK(isa >= ISA_AVX2 && isa <= ISA_AVX512_BF16 && cpu_has(isa), "lora kernels: this CPU lacks ISA ", isa);
  const int64_t prev = current();
  g_isa = isa;
  return prev;
}

// The tiles over the threads, or on this one when the step's work is small (no team wake-up):
// MACs per token in * R + R * out / parts; one thread under 2^min_log2 MACs in all.
template <typename TW, typename TY, typename F>
static void split_tiles(const LoraArgs<TW, TY>& g, int64_t n_tiles, int min_log2, F body) {
  const int64_t per_tile = 8 * (g.in * g.R + g.R * g.out / std::max<int64_t>(1, g.parts));
  if (n_tiles <= 1 || n_tiles * per_tile < (int64_t)1 << min_log2)
    body(0, n_tiles);
  else
    at::parallel_for(0, n_tiles, 1, body);
}

template <typename TW, typename TY>
static void run(const LoraArgs<TW, TY>& g, const int64_t* tiles, int64_t n_tiles) {
  split_tiles(g, n_tiles, 19, [&](int64_t t0, int64_t t1) {
#if LK_X86
    if (current() >= ISA_AVX512)
      avx512::lora_tiles(g, tiles, t0, t1);
    else
      avx2::lora_tiles(g, tiles, t0, t1);
#endif
  });
}

template <typename TY>
static void run_bf16(const LoraArgs<uint16_t, TY>& g, const int64_t* tiles, int64_t n_tiles) {
  split_tiles(g, n_tiles, 20, [&](int64_t t0, int64_t t1) {
#if LK_X86
    avx512_bf16::lora_tiles_bf16(g, tiles, t0, t1);
#endif
  });
}

// packed: a [S, in/2, R, 2] and b [S, RP/2, out, 2] in bf16 (lora_bf16.h's layouts, the
// avx512_bf16 level); else a [S, in, R], b [S, R, out] (the PyTorch path's layouts).
void lora_apply_(const torch::Tensor& x, torch::Tensor& y, const torch::Tensor& a, const torch::Tensor& b,
                 const torch::Tensor& rows, const torch::Tensor& tiles, const torch::Tensor& cols, int64_t rank,
                 bool packed) {
  TORCH_CHECK(current() != ISA_NONE, "lora kernels: no AVX2 on this CPU");
  TORCH_CHECK(!packed || current() == ISA_AVX512_BF16, "lora_apply_: packed weights need the avx512_bf16 level");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == (packed ? 4 : 3) && b.dim() == (packed ? 4 : 3),
              "lora_apply_: bad ranks");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && a.is_contiguous() && b.is_contiguous(), "lora_apply_: layout");
  TORCH_CHECK(x.scalar_type() == a.scalar_type() && a.scalar_type() == b.scalar_type(), "lora_apply_: dtypes");
  TORCH_CHECK(rows.scalar_type() == at::kLong && tiles.scalar_type() == at::kLong && cols.scalar_type() == at::kLong &&
                  rows.is_contiguous() && tiles.is_contiguous() && cols.is_contiguous(),
              "lora_apply_: index tensors must be contiguous int64");
  const auto xt = x.scalar_type(), yt = y.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16, "lora_apply_: x must be float32 or bfloat16");
  TORCH_CHECK(yt == at::kFloat || yt == at::kBFloat16, "lora_apply_: y must be float32 or bfloat16");
  TORCH_CHECK(!packed || xt == at::kBFloat16, "lora_apply_: packed weights are bfloat16");
  const int64_t parts = cols.numel() - 1, K = x.size(1), N = y.size(1), S = a.size(0), R = a.size(2);
  TORCH_CHECK(parts >= 1 && cols.data_ptr<int64_t>()[0] == 0 && cols.data_ptr<int64_t>()[parts] == N,
              "lora_apply_: cols must run from 0 to out");
  TORCH_CHECK(parts == 1 || (rank >= 1 && parts * rank <= R), "lora_apply_: parts * rank exceeds R");
  const int64_t RP = parts == 1 ? R : rank;
  if (packed) {
    TORCH_CHECK(a.size(1) * 2 == K && a.size(3) == 2 && b.size(0) == S && b.size(1) * 2 == RP && b.size(2) == N &&
                    b.size(3) == 2 && R % 2 == 0,
                "lora_apply_: packed shapes");
  } else {
    TORCH_CHECK(a.size(1) == K && b.size(0) == S && b.size(1) == R && b.size(2) == N, "lora_apply_: shapes");
  }
  TORCH_CHECK(tiles.dim() == 2 && tiles.size(1) == 3, "lora_apply_: tiles must be [G, 3]");
  const int64_t n_tiles = tiles.size(0), n_rows = rows.numel(), T = x.size(0);
  TORCH_CHECK(y.size(0) == T, "lora_apply_: x and y rows differ");
  const int64_t* tp = tiles.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n_tiles; ++i)
    TORCH_CHECK(tp[3 * i] >= 0 && tp[3 * i] < S && tp[3 * i + 1] >= 0 && tp[3 * i + 2] >= 1 && tp[3 * i + 2] <= 8 &&
                    tp[3 * i + 1] + tp[3 * i + 2] <= n_rows,
                "lora_apply_: tile ", i, " out of range");
  for (int64_t i = 0; i < n_rows; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < T, "lora_apply_: row out of range");
  auto go = [&](auto* xp, auto* yp) {
    using TW = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    using TY = std::remove_pointer_t<decltype(yp)>;
    LoraArgs<TW, TY> g{xp, yp, static_cast<const TW*>(a.data_ptr()), static_cast<const TW*>(b.data_ptr()),
                       rp, cols.data_ptr<int64_t>(), x.stride(0), y.stride(0), K, R, N, parts, rank};
    if constexpr (std::is_same_v<TW, uint16_t>) {
      if (packed) return run_bf16(g, tp, n_tiles);
    }
    run(g, tp, n_tiles);
  };
  const void* xv = x.data_ptr();
  void* yv = y.data_ptr();
  if (xt == at::kFloat) {
    if (yt == at::kFloat) go(static_cast<const float*>(xv), static_cast<float*>(yv));
    else go(static_cast<const float*>(xv), static_cast<uint16_t*>(yv));
  } else {
    if (yt == at::kFloat) go(static_cast<const uint16_t*>(xv), static_cast<float*>(yv));
    else go(static_cast<const uint16_t*>(xv), static_cast<uint16_t*>(yv));
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_apply_", &lora_apply_, "y[rows] += (x[rows] @ a[slot]) @ b[slot] per tile, in place", py::arg("x"),
        py::arg("y"), py::arg("a"), py::arg("b"), py::arg("rows"), py::arg("tiles"), py::arg("cols"), py::arg("rank"),
        py::arg("packed") = false);
  m.def("isa_available", &isa_available);
  m.def("get_isa", &get_isa);
  m.def("set_isa", &set_isa, "force 1 (avx2), 2 (avx512) or 3 (avx512_bf16); returns the previous one");
}
