// Paged decode attention on the CPU: one query token per sequence, K/V read in place from
// the paged cache through the block table (no gathered copy), GQA-aware (each K/V row is
// read once for all query heads that share it). Parallel over sequences.
//
//   q        [n, h, d]                  (float32 or bfloat16)
//   k_cache  [num_blocks, bs, kvh, d]   (same dtype)
//   v_cache  [num_blocks, bs, kvh, d]
//   block_tables [n, max_blocks] int64, seq_lens [n] int64
//   returns  [n, h, d]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* seq_lens, T* out,
                          int64_t n, int64_t h, int64_t kvh, int64_t d, int64_t bs, int64_t max_blocks, float scale) {
  // One job per sequence, all heads together: a token's K (and V) rows for every KV head
  // are contiguous in the cache ([.., kvh, d]), so each job streams through memory in order.
  const int64_t g = h / kvh;
  // Rows per task: at least ~1M multiply-adds each. Small steps (a decode at batch 1, a few
  // speculative rows) run inline: waking OpenMP's team costs more than they do.
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += seq_lens[i];
  const int64_t per_row = std::max<int64_t>(1, total / std::max<int64_t>(n, 1)) * h * d * 2;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / per_row);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(h * d), acc(h * d), scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t L = seq_lens[i];
      for (int64_t x = 0; x < h * d; ++x) qf[x] = to_f(q[i * h * d + x]) * scale;
      scores.assign(h * L, 0.f);
      // pass 1: scores[head, t] = q[head] . k[t, head / g]
      for (int64_t t = 0; t < L; ++t) {
        const int64_t blk = bt[i * max_blocks + t / bs];
        const T* krow = kc + (blk * bs + t % bs) * kvh * d;
        for (int64_t kh = 0; kh < kvh; ++kh) {
          const T* k = krow + kh * d;
          for (int64_t gi = 0; gi < g; ++gi) {
            const float* qq = &qf[(kh * g + gi) * d];
            float s = 0.f;
            for (int64_t x = 0; x < d; ++x) s += qq[x] * to_f(k[x]);
            scores[(kh * g + gi) * L + t] = s;
          }
        }
      }
      // softmax per query head
      for (int64_t hh = 0; hh < h; ++hh) {
        float* sc = &scores[hh * L];
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < L; ++t) m = std::max(m, sc[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          sc[t] = std::exp(sc[t] - m);
          sum += sc[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sc[t] *= inv;
      }
      // pass 2: out[head] = sum_t p[head, t] * v[t, head / g]
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t blk = bt[i * max_blocks + t / bs];
        const T* vrow = vc + (blk * bs + t % bs) * kvh * d;
        for (int64_t kh = 0; kh < kvh; ++kh) {
          const T* v = vrow + kh * d;
          for (int64_t gi = 0; gi < g; ++gi) {
            const float p = scores[(kh * g + gi) * L + t];
            float* a = &acc[(kh * g + gi) * d];
            for (int64_t x = 0; x < d; ++x) a[x] += p * to_f(v[x]);
          }
        }
      }
      for (int64_t x = 0; x < h * d; ++x) out[i * h * d + x] = static_cast<T>(acc[x]);
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [n,h,d], k_cache [nb,bs,kvh,d]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  const int64_t n = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2);
  TORCH_CHECK(h % kvh == 0 && k_cache.size(3) == d, "head shapes");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    decode_kernel<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), bt.data_ptr<int64_t>(),
                         sl.data_ptr<int64_t>(), out.data_ptr<float>(), n, h, kvh, d, bs, bt.size(1), (float)scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    using B = at::BFloat16;
    decode_kernel<B>(q.data_ptr<B>(), k_cache.data_ptr<B>(), v_cache.data_ptr<B>(), bt.data_ptr<int64_t>(),
                     sl.data_ptr<int64_t>(), out.data_ptr<B>(), n, h, kvh, d, bs, bt.size(1), (float)scale);
  } else {
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16 only");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "paged decode attention (CPU)"); }
