// Paged decode attention on the CPU: one query token per sequence, K/V read in place from
// the paged cache through the block table (no gathered copy), GQA-aware (each K/V row is
// read once for all query heads that share it). Parallel over sequences (the AVX2 float32 path
// below: over sequences and KV heads). bf16 queries over a bf16 cache take the vdpbf16ps kernel
// where the module has it and its switch is on (decode_bf16.h: head_dim a multiple of 64 up to
// 256, contiguous heads, no soft cap); other bf16 queries are widened to float32.
//
//   q        [n, h, d]                  (float32 or bfloat16)
//   k_cache  [num_blocks, bs, kvh, d]   (q's dtype, or float16 / bfloat16 / float8 e4m3fn /
//                                        float8 e5m2: kv_cache_dtype; converted to float as it
//                                        is read)
//   v_cache  [num_blocks, bs, kvh, d]
//   block_tables [n, max_blocks] int64, seq_lens [n] int64
//   window   > 0: sliding window, each row attends to its last `window` positions only
//            (blocks wholly before them are never read: their ids may be stale)
//   softcap  > 0: scores = softcap * tanh(scores / softcap) before the softmax (Gemma 2)
//   returns  [n, h, d]
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "work_queue.h"  // costliest_first

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

// krows[t] / vrows[t] = kc / vc + (the cache row of position t0 + t) * row + off for t < n: one
// sequence's positions t0 .. t0 + n - 1 through its block-table row `table`, block by block (no
// division per token; t0 may fall inside a block, as a window's start does)
template <typename KV>
static inline void row_pointers(const KV* kc, const KV* vc, const int64_t* table, int64_t bs, int64_t row,
                                int64_t off, int64_t t0, int64_t n, std::vector<const KV*>& krows,
                                std::vector<const KV*>& vrows) {
  krows.resize(n);
  vrows.resize(n);
  for (int64_t b = t0 / bs, t = 0; t < n; ++b) {
    const int64_t o0 = t == 0 ? t0 - b * bs : 0, row0 = table[b] * bs, nt = std::min(bs - o0, n - t);
    for (int64_t o = o0; o < o0 + nt; ++o, ++t) {
      krows[t] = kc + (row0 + o) * row + off;
      vrows[t] = vc + (row0 + o) * row + off;
    }
  }
}

// body(state, job) for jobs 0 .. cost.size() - 1 (cost: each job's multiply-adds), each thread
// making its state once with make(). A step of under ~1M multiply-adds runs inline on the
// calling thread: waking OpenMP's team for less cost more than it saved (its spinning threads
// fought the packed GEMMs' pool for the cores). Else costliest first from a shared counter
// (work_queue.h), so that no thread is left with every long context of a step that mixes
// short requests and long ones (a split by count could: 12 rows of 2,500 tokens beside 52 of
// 320, 30 layers, bf16 kernel: 91.4 -> 65.8 ms). Which thread runs a job never changes its result.
template <typename Make, typename Body>
static void run_jobs(const std::vector<int64_t>& cost, Make make, Body body) {
  int64_t work = 0;
  for (int64_t c : cost) work += c;
  const int64_t n = static_cast<int64_t>(cost.size());
  if (n <= 1 || at::get_num_threads() == 1 || work < (int64_t(1) << 20)) {
    auto state = make();
    for (int64_t j = 0; j < n; ++j) body(state, j);
    return;
  }
  struct Item {
    int64_t job, cost;
  };
  std::vector<Item> items(n);
  for (int64_t j = 0; j < n; ++j) items[j] = {j, cost[j]};
  costliest_first(items, make, [&](auto& state, const Item& it) { body(state, it.job); });
}

// sc[0:L] = exp(sc - max), in place (one query head's scores); *m = the max, returns the sum
static inline float exp_scores(float* sc, int64_t L, float* m_out) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < L; ++t) m = std::max(m, sc[t]);
  float sum = 0.f;
  for (int64_t t = 0; t < L; ++t) {
    sc[t] = std::exp(sc[t] - m);
    sum += sc[t];
  }
  *m_out = m;
  return sum;
}

// sc[0:L] = cap * tanh(sc / cap), in place (cap > 0)
static inline void softcap_inplace(float* sc, int64_t L, float cap) {
  const float inv = 1.f / cap;
  for (int64_t t = 0; t < L; ++t) sc[t] = cap * std::tanh(sc[t] * inv);
}

// first position a row of context length L sees
static inline int64_t window_start(int64_t L, int64_t window) { return window > 0 ? std::max<int64_t>(0, L - window) : 0; }

// sc[0:L] = softmax(sc[0:L]), in place
static inline void softmax_inplace(float* sc, int64_t L) {
  float m;
  const float inv = 1.f / exp_scores(sc, L, &m);
  for (int64_t t = 0; t < L; ++t) sc[t] *= inv;
}

template <typename T, typename KV>
static void decode_kernel(const T* q, const KV* kc, const KV* vc, const int64_t* bt, const int64_t* seq_lens, T* out,
                          int64_t n, int64_t h, int64_t kvh, int64_t d, int64_t bs, int64_t max_blocks, float scale,
                          int64_t window, float softcap) {
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
      const int64_t lo = window_start(seq_lens[i], window), L = seq_lens[i] - lo;
      for (int64_t x = 0; x < h * d; ++x) qf[x] = to_f(q[i * h * d + x]) * scale;
      scores.assign(h * L, 0.f);
      // pass 1: scores[head, t] = q[head] . k[lo + t, head / g]
      for (int64_t t = 0; t < L; ++t) {
        const int64_t blk = bt[i * max_blocks + (lo + t) / bs];
        const KV* krow = kc + (blk * bs + (lo + t) % bs) * kvh * d;
        for (int64_t kh = 0; kh < kvh; ++kh) {
          const KV* k = krow + kh * d;
          for (int64_t gi = 0; gi < g; ++gi) {
            const float* qq = &qf[(kh * g + gi) * d];
            float s = 0.f;
            for (int64_t x = 0; x < d; ++x) s += qq[x] * to_f(k[x]);
            scores[(kh * g + gi) * L + t] = s;
          }
        }
      }
      for (int64_t hh = 0; hh < h; ++hh) {
        if (softcap > 0.f) softcap_inplace(&scores[hh * L], L, softcap);
        softmax_inplace(&scores[hh * L], L);
      }
      // pass 2: out[head] = sum_t p[head, t] * v[t, head / g]
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t blk = bt[i * max_blocks + (lo + t) / bs];
        const KV* vrow = vc + (blk * bs + (lo + t) % bs) * kvh * d;
        for (int64_t kh = 0; kh < kvh; ++kh) {
          const KV* v = vrow + kh * d;
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// float32, AVX2: one job per (sequence, KV head), so a batch-1 step's heads and a verify
// step's rows spread over the threads; the g query heads that share the KV head are done
// together. Scores: 4 tokens x 3 heads (12 accumulators) per pass over d, K rows read once
// for all heads, four dot products reduced at once (hadd); P.V: 8 accumulators over d per
// head. 30 layers of 64 rows at context 320 (K/V from memory): 85.6 -> 68.6 ms; 5 verify
// rows of one request: 3.55 -> 1.9-2.0 ms (BENCHMARKS section 20). At 64 rows it reads K/V at
// ~14 GB/s, half of what a contiguous read gets on this machine: the (row, KV head) slices
// are strided (software prefetch, below, recovers part of it). A batch-1 step (3 jobs for 2 threads)
// cuts each context in parts (split-context, merged by softmax maxima and sums): 30 layers
// of 1 row at context 320 0.74-0.8 -> 0.54-0.56 ms; a batch-1 decode step 10.6-11.0 -> 9.7-10.0 ms.
// Tokens ahead whose K (V) rows are prefetched: a context's rows are scattered over its
// blocks (one KV head's slice of each row), so the hardware prefetchers miss them. 64 rows at
// context 325, 30 layers: float16 KV 66-75 -> 42-49 ms, float32 79-83 -> 69-72 ms (4: less, 12: same).
// The prefetches go to L2 (T1): to L1 (T0) they stalled on the core's fill buffers (perf: half of
// the scores loop's samples on the prefetch). AMX Xeon, bf16 K/V, 30 layers, alternating A/B x3:
// 12 rows at context 2500 50.4 -> 46.2 ms, 64 rows at 320 33.6 -> 31.1 ms, 1 row unchanged.
constexpr int PFD = 8;
template <typename KV>
static inline void prefetch_row(const KV* p, int64_t n) {  // the cache lines of p[0:n], into L2
  for (int64_t c = 0; c < n * (int64_t)sizeof(KV); c += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + c, _MM_HINT_T1);
}
// 8 K/V elements as floats: float32 as is; float16 through F16C; bfloat16 by a shift (exact).
// float8 (exact too): e5m2 is the top byte of a float16, so a byte shift makes the float16;
// e4m3fn's sign, exponent and mantissa go to the float16 fields one bit lower (an arithmetic
// shift copies the sign into the exponent's top bit, which is then cleared), which reads as
// the value / 256 (the exponent bias 15 against 7), subnormals included: kv_unit<KV> below
// is that 1 / 256, folded into the scaled query (scores) and into the output (P.V). Its NaN
// bytes (0x7f / 0xff, never written: a write saturates at +-448) would read as +-480.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#if defined(__F16C__)
static inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
static inline __m256 load8(const c10::Float8_e5m2* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), b));
}
static inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i b = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(b, 1), _mm_set1_epi16((short)0xBFFF)));
}
#endif
template <typename KV>
constexpr float kv_unit = std::is_same_v<KV, c10::Float8_e4m3fn> ? 256.f : 1.f;  // value = load8 * kv_unit

static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {  // [sum a, sum b, sum c, sum d]
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// scores[gi * L + t] = q[gi] . k[t] for the G (<= 3) heads of one KV head; d % 8 == 0
template <int G, typename KV>
static void scores_avx2(const float* q, const KV* const* krows, int64_t L, int64_t d, float* scores) {
  int64_t t = 0;
  for (; t + 4 <= L; t += 4) {
    if (t + PFD + 4 <= L)
      for (int j = 0; j < 4; ++j) prefetch_row(krows[t + PFD + j], d);
    __m256 acc[G][4];
    for (int gi = 0; gi < G; ++gi)
      for (int j = 0; j < 4; ++j) acc[gi][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
      __m256 qv[G];
      for (int gi = 0; gi < G; ++gi) qv[gi] = _mm256_loadu_ps(q + gi * d + c);
      for (int j = 0; j < 4; ++j) {
        const __m256 kv = load8(krows[t + j] + c);
        for (int gi = 0; gi < G; ++gi) acc[gi][j] = _mm256_fmadd_ps(kv, qv[gi], acc[gi][j]);
      }
    }
    for (int gi = 0; gi < G; ++gi) _mm_storeu_ps(scores + gi * L + t, hsum4(acc[gi][0], acc[gi][1], acc[gi][2], acc[gi][3]));
  }
  for (; t < L; ++t)
    for (int gi = 0; gi < G; ++gi) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8) a = _mm256_fmadd_ps(load8(krows[t] + c), _mm256_loadu_ps(q + gi * d + c), a);
      scores[gi * L + t] = hsum(a);
    }
}

// One (sequence, KV head) slice of tokens [0, L): the G query heads' scores into `scores`
// ([G, L]) and, with S == 1, their softmax-weighted V rows into out[gi * ostride ..]. With a
// split context (part of a sequence), the scores are exponentiated against the part's own
// maximum, left unnormalized, and part_m / part_l get each head's maximum and sum (the
// caller merges the parts: flash-decoding).
template <typename KV>
static void attend_avx2(const float* qf, const KV* const* krows, const KV* const* vrows, int64_t L, int64_t g,
                        int64_t d, float* scores, float* out, int64_t ostride, float* part_m, float* part_l,
                        float softcap) {
  for (int64_t g0 = 0; g0 < g; g0 += 3) {  // heads in threes (12 accumulators)
    const int64_t gn = std::min<int64_t>(3, g - g0);
    float* sc = scores + g0 * L;
    const float* qq = qf + g0 * d;
    if (gn == 3) scores_avx2<3>(qq, krows, L, d, sc);
    else if (gn == 2) scores_avx2<2>(qq, krows, L, d, sc);
    else scores_avx2<1>(qq, krows, L, d, sc);
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    float* sc = scores + gi * L;
    if (softcap > 0.f) softcap_inplace(sc, L, softcap);
    if (part_m == nullptr) softmax_inplace(sc, L);
    else part_l[gi] = exp_scores(sc, L, &part_m[gi]);
  }
  const __m256 unit = _mm256_set1_ps(kv_unit<KV>);
  for (int64_t gi = 0; gi < g; ++gi) {  // out[head] = sum_t p[t] v[t], d in chunks of 64
    const float* sc = scores + gi * L;
    float* o = out + gi * ostride;
    int64_t c0 = 0;
    for (; c0 + 64 <= d; c0 += 64) {  // 8 accumulators in registers (a fixed count)
      __m256 acc[8];
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
      for (int64_t t = 0; t < L; ++t) {
        if (t + PFD < L) prefetch_row(vrows[t + PFD] + c0, 64);
        const __m256 p = _mm256_set1_ps(sc[t]);
        const KV* v = vrows[t] + c0;
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(p, load8(v + 8 * c), acc[c]);
      }
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o + c0 + 8 * c, _mm256_mul_ps(acc[c], unit));
    }
    for (; c0 < d; c0 += 8) {  // head sizes that are not a multiple of 64
      __m256 acc = _mm256_setzero_ps();
      for (int64_t t = 0; t < L; ++t) acc = _mm256_fmadd_ps(_mm256_set1_ps(sc[t]), load8(vrows[t] + c0), acc);
      _mm256_storeu_ps(o + c0, _mm256_mul_ps(acc, unit));
    }
  }
}

#if defined(__AVX512F__)
// The same attend on 16-wide registers (this module is built for the machine's CPU), for
// float32 / bfloat16 / float16 / float8 K/V and head sizes that are multiples of 64. Scores: eight
// tokens' K rows at a time against the G query heads (24 accumulators), eight dot products
// reduced together (hsum8x16); P.V: each V row is read and converted once for the G heads
// (the AVX2 path reads it once per head). Measured on an AMX Xeon (BENCHMARKS section 33).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// float8: the AVX2 path's exact conversions (load8), 16 bytes at a time (e4m3fn reads as the
// value / 256: kv_unit, folded into the scaled query and applied to the output, scale_out16)
static inline __m256i fp8_to_f16_bits(const void* p) {  // each byte in the high half of a 16-bit lane
  return _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
}
static inline __m512 load16(const c10::Float8_e5m2* p) { return _mm512_cvtph_ps(fp8_to_f16_bits(p)); }
static inline __m512 load16(const c10::Float8_e4m3fn* p) {
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(fp8_to_f16_bits(p), 1), _mm256_set1_epi16((short)0xBFFF)));
}
// (every K/V type the kernel takes has a load16: the 16-wide paths need no type test)

// out[r * stride + x] *= kv_unit<KV> for r < rows, x < d (nothing unless KV is float8 e4m3fn)
template <typename KV>
static inline void scale_out16(float* out, int64_t rows, int64_t stride, int64_t d) {
  if constexpr (kv_unit<KV> != 1.f) {
    const __m512 u = _mm512_set1_ps(kv_unit<KV>);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t x = 0; x < d; x += 16) _mm512_storeu_ps(out + r * stride + x, _mm512_mul_ps(_mm512_loadu_ps(out + r * stride + x), u));
  }
}

// f(std::integral_constant<int, G>{}) for a group of gn (1 to 3) query heads: the kernels'
// head count as a compile-time constant
template <typename F>
static inline void with_heads(int64_t gn, F&& f) {
  if (gn == 3) f(std::integral_constant<int, 3>{});
  else if (gn == 2) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}

#include "avx512_exp.h"  // exp16: the softmax's exponentials

// the first min(n, 16) lanes (n >= 1)
static inline __mmask16 tail_mask16(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// exp_scores on 16 lanes (the tail through a mask, so every position takes the same path)
static inline float exp_scores16(float* sc, int64_t L, float* m_out) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 k = tail_mask16(L - t);
    mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, sc + t));
  }
  const float m = _mm512_reduce_max_ps(mv);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 k = tail_mask16(L - t);
    const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + t), vm)));
    _mm512_mask_storeu_ps(sc + t, k, e);
    sum = _mm512_add_ps(sum, e);
  }
  *m_out = m;
  return _mm512_reduce_add_ps(sum);
}

// softmax_inplace on 16 lanes: exp_scores16, then one multiply by 1 / sum
static inline void softmax16(float* sc, int64_t L) {
  float m;
  const __m512 inv = _mm512_set1_ps(1.f / exp_scores16(sc, L, &m));
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 k = tail_mask16(L - t);
    _mm512_mask_storeu_ps(sc + t, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sc + t), inv));
  }
}

// out[j] = the sum of a[j]'s 16 lanes, j < 8 (halves, quarters, pairs, then one permute)
static inline void hsum8x16(const __m512* a, float* out) {
  __m512 b[4];
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  __m512 e = _mm512_add_ps(_mm512_unpacklo_ps(c0, c1), _mm512_unpackhi_ps(c0, c1));
  e = _mm512_add_ps(e, _mm512_permute_ps(e, 0x4E));  // 128-bit lane k: [sum a[k], sum a[4 + k], ..]
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, e)));
}

// scores[gi * L + t] = q[gi] . k[t] for the G (<= 3) heads of one KV head; d % 16 == 0
// (krows[t] + off: token t's K slice; scores of head gi at scores[gi * ld + t]; pfn elements
// from the slice of the rows pfd tokens ahead are prefetched, 0: none; avail: rows krows may
// point at)
template <int G, typename KV>
static void scores_avx512(const float* q, const KV* const* krows, int64_t off, int64_t L, int64_t ld, int64_t d,
                          float* scores, int64_t pfn, int64_t avail, int64_t pfd = PFD) {
  int64_t t = 0;
  for (; t + 8 <= L; t += 8) {
    if (pfn && t + pfd + 8 <= avail)
      for (int j = 0; j < 8; ++j) prefetch_row(krows[t + pfd + j] + off, pfn);
    __m512 acc[G][8];
    for (int gi = 0; gi < G; ++gi)
      for (int j = 0; j < 8; ++j) acc[gi][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
      __m512 qv[G];
      for (int gi = 0; gi < G; ++gi) qv[gi] = _mm512_loadu_ps(q + gi * d + c);
      for (int j = 0; j < 8; ++j) {
        const __m512 kv = load16(krows[t + j] + off + c);
        for (int gi = 0; gi < G; ++gi) acc[gi][j] = _mm512_fmadd_ps(kv, qv[gi], acc[gi][j]);
      }
    }
    for (int gi = 0; gi < G; ++gi) hsum8x16(acc[gi], scores + gi * ld + t);
  }
  for (; t < L; ++t)
    for (int gi = 0; gi < G; ++gi) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t c = 0; c < d; c += 16)
        a = _mm512_fmadd_ps(load16(krows[t] + off + c), _mm512_loadu_ps(q + gi * d + c), a);
      scores[gi * ld + t] = _mm512_reduce_add_ps(a);
    }
}

// out[gi][c0 : c0 + 64] (+)= sum_t p[gi][t] v[t][c0 : c0 + 64] for G (<= 3) heads (p of head
// gi at sc[gi * ld + t], token t's V slice at vrows[t] + off; acc_in: add to out): 4G
// accumulators, each V slice read once; pfn / avail / pfd as in scores_avx512 (from the
// slice's dims c0 on)
template <int G, typename KV>
static void pv_avx512(const float* sc, int64_t ld, int64_t L, const KV* const* vrows, int64_t off, int64_t c0,
                      float* out, int64_t ostride, int64_t pfn, int64_t avail, bool acc_in, int64_t pfd = PFD) {
  __m512 acc[G][4];
  for (int gi = 0; gi < G; ++gi)
    for (int c = 0; c < 4; ++c)
      acc[gi][c] = acc_in ? _mm512_loadu_ps(out + gi * ostride + c0 + 16 * c) : _mm512_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    if (pfn && t + pfd < avail) prefetch_row(vrows[t + pfd] + off + c0, pfn);
    const KV* v = vrows[t] + off + c0;
    const __m512 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
    for (int gi = 0; gi < G; ++gi) {
      const __m512 p = _mm512_set1_ps(sc[gi * ld + t]);
      acc[gi][0] = _mm512_fmadd_ps(p, v0, acc[gi][0]);
      acc[gi][1] = _mm512_fmadd_ps(p, v1, acc[gi][1]);
      acc[gi][2] = _mm512_fmadd_ps(p, v2, acc[gi][2]);
      acc[gi][3] = _mm512_fmadd_ps(p, v3, acc[gi][3]);
    }
  }
  for (int gi = 0; gi < G; ++gi)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + gi * ostride + c0 + 16 * c, acc[gi][c]);
}

// attend_avx2's contract; KV float32 / bfloat16 / float16 / float8, d % 64 == 0. row_tail: elements
// from a head's K/V slice to the end of its token's row (the first KV head's job prefetches
// the whole rows, so the jobs of the other heads, which follow on the same thread, find them
// in cache: the rows of one block are then read in order)
template <typename KV>
static void attend_avx512(const float* qf, const KV* const* krows, const KV* const* vrows, int64_t L, int64_t g,
                          int64_t d, float* scores, float* out, int64_t ostride, float* part_m, float* part_l,
                          float softcap, int64_t row_tail) {
  for (int64_t g0 = 0; g0 < g; g0 += 3) {
    const int64_t gn = std::min<int64_t>(3, g - g0);
    float* sc = scores + g0 * L;
    const float* qq = qf + g0 * d;
    with_heads(gn, [&](auto G) { scores_avx512<decltype(G)::value>(qq, krows, 0, L, L, d, sc, row_tail, L); });
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    float* sc = scores + gi * L;
    if (softcap > 0.f) softcap_inplace(sc, L, softcap);
    if (part_m == nullptr) softmax16(sc, L);
    else part_l[gi] = exp_scores16(sc, L, &part_m[gi]);
  }
  for (int64_t g0 = 0; g0 < g; g0 += 3) {
    const int64_t gn = std::min<int64_t>(3, g - g0);
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
      float* o = out + g0 * ostride;
      const int64_t pfn = c0 == 0 ? std::max<int64_t>(64, row_tail) : 64;
      with_heads(gn, [&](auto G) { pv_avx512<decltype(G)::value>(scores + g0 * L, L, L, vrows, 0, c0, o, ostride, pfn, L, false); });
    }
  }
  scale_out16<KV>(out, g, ostride, d);
}

// One sequence, every KV head: krows[t] / vrows[t] point at token t's whole K / V row
// ([kvh, d]). Tokens go in chunks of 32; within a chunk each KV head in turn, so a block's
// rows are read from memory once, in order, each head's pass prefetching its own slice of the
// next chunk's rows (decode_bf16.h's scheme: the first head's pass prefetching whole rows left
// two thirds of the passes with no loads from memory; Zen 4, bf16 K/V, 30 layers: BENCHMARKS
// section 48). scores [h, L] (workspace), out [h, d]: the normalized result. Dot products,
// softmax and sums are those of attend_avx512, in the same order per head.
template <typename KV>
static void attend_seq_avx512(const float* qf, const KV* const* krows, const KV* const* vrows, int64_t L, int64_t kvh,
                              int64_t g, int64_t d, float* scores, float* out, float softcap) {
  constexpr int64_t CH = 32;
  const int64_t row = kvh * d;
  // each pass's first CH rows, which its own prefetches never cover (as decode_bf16.h; Zen 4,
  // 30 layers, alternating: 16 x 320 bf16 K/V 10.0 -> 9.3 ms, 64 x 320 35.8 -> 35.2, fp8 equal)
  for (int64_t t = 0; t < std::min<int64_t>(CH, L); ++t) prefetch_row(krows[t], row);
  for (int64_t t0 = 0; t0 < L; t0 += CH) {
    const int64_t n = std::min(CH, L - t0);
    for (int64_t kh = 0; kh < kvh; ++kh)
      for (int64_t g0 = 0; g0 < g; g0 += 3) {
        const int64_t gn = std::min<int64_t>(3, g - g0), pfn = g0 == 0 ? d : 0;
        float* sc = scores + (kh * g + g0) * L + t0;
        const float* qq = qf + (kh * g + g0) * d;
        with_heads(gn, [&](auto G) { scores_avx512<decltype(G)::value>(qq, krows + t0, kh * d, n, L, d, sc, pfn, L - t0, CH); });
      }
  }
  for (int64_t t = 0; t < std::min<int64_t>(CH, L); ++t) prefetch_row(vrows[t], row);
  for (int64_t x = 0; x < kvh * g; ++x) {
    if (softcap > 0.f) softcap_inplace(scores + x * L, L, softcap);
    softmax16(scores + x * L, L);
  }
  for (int64_t t0 = 0; t0 < L; t0 += CH) {
    const int64_t n = std::min(CH, L - t0);
    for (int64_t kh = 0; kh < kvh; ++kh)
      for (int64_t g0 = 0; g0 < g; g0 += 3) {
        const int64_t gn = std::min<int64_t>(3, g - g0);
        const float* sc = scores + (kh * g + g0) * L + t0;
        float* o = out + (kh * g + g0) * d;
        for (int64_t c0 = 0; c0 < d; c0 += 64) {
          const int64_t pfn = g0 == 0 ? 64 : 0;
          with_heads(gn, [&](auto G) { pv_avx512<decltype(G)::value>(sc, L, n, vrows + t0, kh * d, c0, o, d, pfn, L - t0, t0 > 0, CH); });
        }
      }
  }
  scale_out16<KV>(out, kvh * g, d, d);
}

// decode_avx2 without split contexts, one job per sequence (attend_seq_avx512)
template <typename KV>
static void decode_seq_avx512(const float* q, int64_t qs, const KV* kc, const KV* vc, const int64_t* bt,
                              const int64_t* seq_lens, float* out, int64_t n, int64_t h, int64_t kvh, int64_t d,
                              int64_t bs, int64_t max_blocks, float scale, int64_t window, float softcap) {
  struct Scratch {
    std::vector<float> qf, scores;
    std::vector<const KV*> krows, vrows;
  };
  std::vector<int64_t> cost(n);
  for (int64_t i = 0; i < n; ++i) cost[i] = (seq_lens[i] - window_start(seq_lens[i], window)) * h * d * 2;
  run_jobs(cost, [] { return Scratch(); }, [&](Scratch& w, int64_t i) {
    const int64_t L = seq_lens[i], lo = window_start(L, window), Lp = L - lo;
    w.qf.resize(h * d);
    for (int64_t x = 0; x < h * d; ++x) w.qf[x] = q[i * qs + x] * (scale * kv_unit<KV>);
    row_pointers(kc, vc, bt + i * max_blocks, bs, kvh * d, 0, lo, Lp, w.krows, w.vrows);
    w.scores.resize(h * Lp);
    attend_seq_avx512(w.qf.data(), w.krows.data(), w.vrows.data(), Lp, kvh, h / kvh, d, w.scores.data(),
                      out + i * h * d, softcap);
  });
}
#endif

// One job's attend: the 16-wide kernel where it applies, else the 8-wide one
template <typename KV>
static inline void attend_cpu(const float* qf, const KV* const* krows, const KV* const* vrows, int64_t L, int64_t g,
                              int64_t d, float* scores, float* out, int64_t ostride, float* part_m, float* part_l,
                              float softcap, int64_t row_tail) {
#if defined(__AVX512F__)
  if (d % 64 == 0)
    return attend_avx512(qf, krows, vrows, L, g, d, scores, out, ostride, part_m, part_l, softcap, row_tail);
#else
  (void)row_tail;
#endif
  attend_avx2(qf, krows, vrows, L, g, d, scores, out, ostride, part_m, part_l, softcap);
}

// q rows may be strided (qs = q.stride(0): the q part of a fused QKV row, read in place).
// When the step has fewer (sequence, KV head) jobs than twice the threads (a batch-1 decode:
// 3 jobs on 2 threads), each sequence's context is cut into S parts of whole blocks so
// that every thread gets work; the parts are merged by their softmax maxima and sums.
template <typename KV>
static void decode_avx2(const float* q, int64_t qs, const KV* kc, const KV* vc, const int64_t* bt,
                        const int64_t* seq_lens, float* out, int64_t n, int64_t h, int64_t kvh, int64_t d, int64_t bs,
                        int64_t max_blocks, float scale, int64_t window, float softcap, bool split = true) {
  const int64_t g = h / kvh;
  int64_t min_len = std::numeric_limits<int64_t>::max();
  for (int64_t i = 0; i < n; ++i)  // from the first block read
    min_len = std::min(min_len, seq_lens[i] - window_start(seq_lens[i], window) / bs * bs);
  const int64_t nthr = at::get_num_threads();
  int64_t S = 1;
  if (split && nthr > 1 && n * kvh < 2 * nthr) {
    S = (2 * nthr + n * kvh - 1) / (n * kvh);
    S = std::max<int64_t>(1, std::min<int64_t>({S, min_len / (4 * bs), 64}));  // parts of >= 4 blocks
  }
#if defined(__AVX512F__)
  if (S == 1 && d % 64 == 0 && n >= 2 * nthr)  // enough sequences for the threads: one job each
    return decode_seq_avx512(q, qs, kc, vc, bt, seq_lens, out, n, h, kvh, d, bs, max_blocks, scale, window, softcap);
#endif
  // split parts: unnormalized outputs [n, kvh, S, g, d] and their (max, sum) [n, kvh, S, g]
  std::vector<float> part_o(S > 1 ? n * kvh * S * g * d : 0), part_m(S > 1 ? n * kvh * S * g : 0),
      part_l(part_m.size());
  struct Scratch {
    std::vector<float> qf, scores;
    std::vector<const KV*> krows, vrows;
  };
  // with many sequences for the threads a sequence's KV heads stay on one thread, in order
  // (a head's job then finds the rows the one before it read in cache: the AVX2 path); with
  // few, one item per (sequence, KV head) spreads them more evenly
  const int64_t per_item = S == 1 && n >= 8 * nthr ? kvh : 1, items = n * kvh * S / per_item;
  std::vector<int64_t> cost(items);
  for (int64_t it = 0; it < items; ++it) {
    const int64_t L = seq_lens[it * per_item / S / kvh];
    cost[it] = std::max<int64_t>(1, (L - window_start(L, window)) / S) * g * d * 2 * per_item;
  }
  auto attend_job = [&](Scratch& w, int64_t job) {
    const int64_t s = job % S, i = job / S / kvh, kh = job / S % kvh, L = seq_lens[i];
    const int64_t lo = window_start(L, window), bfirst = lo / bs, nblk = (L + bs - 1) / bs - bfirst;
    const int64_t b0 = bfirst + nblk * s / S, b1 = bfirst + nblk * (s + 1) / S;
    const int64_t t0 = std::max(lo, b0 * bs), t1 = std::min(L, b1 * bs), Lp = std::max<int64_t>(0, t1 - t0);
    const float* qrow = q + i * qs + kh * g * d;
    w.qf.resize(g * d);
    for (int64_t x = 0; x < g * d; ++x) w.qf[x] = qrow[x] * (scale * kv_unit<KV>);
    row_pointers(kc, vc, bt + i * max_blocks, bs, kvh * d, kh * d, t0, Lp, w.krows, w.vrows);  // t0 in block b0
    w.scores.resize(g * Lp);
    if (S == 1) {
      attend_cpu(w.qf.data(), w.krows.data(), w.vrows.data(), Lp, g, d, w.scores.data(), out + (i * h + kh * g) * d,
                 d, nullptr, nullptr, softcap, (kvh - kh) * d);
    } else {
      attend_cpu(w.qf.data(), w.krows.data(), w.vrows.data(), Lp, g, d, w.scores.data(), &part_o[job * g * d], d,
                 &part_m[job * g], &part_l[job * g], softcap, (kvh - kh) * d);
    }
  };
  if (S > 1) {  // one context's equal parts: every thread takes its share, in order
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      Scratch w;
      for (int64_t job = begin; job < end; ++job) attend_job(w, job);
    });
  } else {
    run_jobs(cost, [] { return Scratch(); }, [&](Scratch& w, int64_t it) {
      for (int64_t job = it * per_item; job < (it + 1) * per_item; ++job) attend_job(w, job);
    });
  }
  if (S == 1) return;
  for (int64_t i = 0; i < n; ++i)  // merge: out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s
    for (int64_t kh = 0; kh < kvh; ++kh)
      for (int64_t gi = 0; gi < g; ++gi) {
        const int64_t base = (i * kvh + kh) * S;
        float M = -std::numeric_limits<float>::infinity(), l = 0.f;
        for (int64_t s = 0; s < S; ++s) M = std::max(M, part_m[(base + s) * g + gi]);
        float w[64];  // S <= 2 * threads / jobs; capped below
        for (int64_t s = 0; s < S; ++s) l += (w[s] = std::exp(part_m[(base + s) * g + gi] - M)) * part_l[(base + s) * g + gi];
        float* o = out + (i * h + kh * g + gi) * d;
        for (int64_t x = 0; x < d; ++x) {
          float a = 0.f;
          for (int64_t s = 0; s < S; ++s) a += w[s] * part_o[((base + s) * g + gi) * d + x];
          o[x] = a / l;
        }
      }
}
#endif

#include "prefill_bf16.h"  // prefill_bf16: prefill chunks in bf16 on vdpbf16ps (where built), and what the tiles share
#include "decode_bf16.h"   // bf16_decode: decode rows in bf16 on vdpbf16ps (where built)

#if defined(PAGEDSERVE_DECODE_BF16)
// Whether bf16 decode rows over a bf16 cache take bf16_decode; the Python side clears it where
// the kernels run on a path below avx512_bf16 (PAGEDSERVE_CPU_ISA). The module has
// set_decode_bf16 only where it was built with the kernel.
static bool g_decode_bf16 = true;
static bool set_decode_bf16(bool on) {
  const bool prev = g_decode_bf16;
  g_decode_bf16 = on;
  return prev;
}
#endif

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [n,h,d], k_cache [nb,bs,kvh,d]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  const int64_t n = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2);
  TORCH_CHECK(h % kvh == 0 && k_cache.size(3) == d, "head shapes");
  auto out = torch::empty({n, h, d}, q.options());
  const auto kt = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kt, "k_cache and v_cache: one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "paged_decode: float32 or bfloat16 q");
  TORCH_CHECK(kt == q.scalar_type() || kt == at::kHalf || kt == at::kBFloat16 || kt == at::kFloat8_e4m3fn ||
                  kt == at::kFloat8_e5m2,
              "paged_decode: the KV cache in q's dtype, float16, bfloat16, float8_e4m3fn or float8_e5m2");
  auto run = [&](auto* q_type, auto* kv_type) {
    using T = std::remove_pointer_t<decltype(q_type)>;
    using KV = std::remove_pointer_t<decltype(kv_type)>;
#if defined(PAGEDSERVE_DECODE_BF16)
    if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<KV, at::BFloat16>) {
      if (g_decode_bf16 && d % 64 == 0 && d <= 256 && softcap <= 0.0 && q.stride(2) == 1 && q.stride(1) == d) {
        const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
        bf16_decode::decode(qp, q.stride(0), reinterpret_cast<const uint16_t*>(k_cache.data_ptr<KV>()),
                            reinterpret_cast<const uint16_t*>(v_cache.data_ptr<KV>()), bt.data_ptr<int64_t>(),
                            sl.data_ptr<int64_t>(), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), n, h,
                            kvh, d, bs, bt.size(1), (float)scale, window);
        return;
      }
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
#if defined(__F16C__)
    constexpr bool kv_ok = true;
#else
    // float16 and float8 K/V need F16C's conversion
    constexpr bool kv_ok = std::is_same_v<KV, float> || std::is_same_v<KV, at::BFloat16>;
#endif
    if constexpr (std::is_same_v<T, float> && kv_ok) {
      if (d % 8 == 0 && q.stride(2) == 1 && q.stride(1) == d) {  // rows may be strided
        decode_avx2<KV>(q.data_ptr<float>(), q.stride(0), k_cache.data_ptr<KV>(), v_cache.data_ptr<KV>(),
                        bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), out.data_ptr<float>(), n, h, kvh, d, bs,
                        bt.size(1), (float)scale, window, (float)softcap);
        return;
      }
    }
    if constexpr (std::is_same_v<T, at::BFloat16> && kv_ok) {
      // a bfloat16 model: its queries to float32 (a few KB), the same float kernel, the
      // result rounded to bf16 (the scalar kernel below took twice as long). No split
      // contexts: a row's result is then the same bits whatever else the step holds (a
      // 1-row decode step and a speculative verification step agree; the bf16 rounding
      // after attention would turn the split's last-bit differences into other tokens)
      if (d % 8 == 0) {
        auto qf = q.to(at::kFloat).contiguous();
        auto of = torch::empty({n, h, d}, qf.options());
        decode_avx2<KV>(qf.data_ptr<float>(), h * d, k_cache.data_ptr<KV>(), v_cache.data_ptr<KV>(),
                        bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), of.data_ptr<float>(), n, h, kvh, d, bs,
                        bt.size(1), (float)scale, window, (float)softcap, false);
        out.copy_(of);
        return;
      }
    }
#endif
    auto qc = q.contiguous();
    decode_kernel<T, KV>(qc.data_ptr<T>(), k_cache.data_ptr<KV>(), v_cache.data_ptr<KV>(), bt.data_ptr<int64_t>(),
                         sl.data_ptr<int64_t>(), out.data_ptr<T>(), n, h, kvh, d, bs, bt.size(1), (float)scale, window,
                         (float)softcap);
  };
  auto with_q = [&](auto* q_type) {
    using T = std::remove_pointer_t<decltype(q_type)>;
    if (kt == q.scalar_type()) run(q_type, static_cast<T*>(nullptr));
    else if (kt == at::kHalf) run(q_type, static_cast<at::Half*>(nullptr));
    else if (kt == at::kFloat8_e4m3fn) run(q_type, static_cast<c10::Float8_e4m3fn*>(nullptr));
    else if (kt == at::kFloat8_e5m2) run(q_type, static_cast<c10::Float8_e5m2*>(nullptr));
    else run(q_type, static_cast<at::BFloat16*>(nullptr));
  };
  if (q.scalar_type() == at::kFloat) with_q(static_cast<float*>(nullptr));
  else with_q(static_cast<at::BFloat16*>(nullptr));
  return out;
}

// The same over the rows of a fused QKV output [n, >= h * d] (its first h * d columns are
// the query heads): a decode-only step's attention straight from the projection, [n, h * d]
// out, ready for o_proj (models/llama.py's lean decode loop).
torch::Tensor paged_decode_qkv(torch::Tensor qkv, int64_t h, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window,
                               double softcap) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && k_cache.dim() == 4, "qkv [n, width], k_cache [nb,bs,kvh,d]");
  const int64_t n = qkv.size(0), d = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) >= h * d, "qkv row shorter than the query heads");
  auto q = qkv.as_strided({n, h, d}, {qkv.stride(0), d, 1});
  return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap).view({n, h * d});
}

#include "prefill_paged.h"  // prefill_paged: a step's prefill chunks, fresh or after cached context
#include "prefill_amx.h"     // prefill_amx: a step's prefill chunks on the AMX tiles (where built)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_paged", &prefill_paged, "causal prefill attention of paged chunks (CPU, float32 arithmetic)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("out"), py::arg("starts"), py::arg("qlens"),
        py::arg("seq_lens"), py::arg("block_tables"), py::arg("scale"));
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("paged_decode_qkv", &paged_decode_qkv, "paged decode attention from fused QKV rows (CPU)", py::arg("qkv"),
        py::arg("h"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
#if defined(PAGEDSERVE_DECODE_BF16)
  m.def("set_decode_bf16", &set_decode_bf16, "bf16 decode rows on vdpbf16ps (returns the previous setting)",
        py::arg("on"));
#endif
#if defined(PAGEDSERVE_PREFILL_BF16)
  m.def("prefill_bf16", &prefill_bf16, "causal prefill attention of paged chunks on the AVX512-BF16 dot products",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("out"), py::arg("starts"), py::arg("qlens"),
        py::arg("seq_lens"), py::arg("block_tables"), py::arg("scale"));
#endif
#if defined(PAGEDSERVE_PREFILL_AMX)
  m.def("prefill_amx", &prefill_amx, "causal prefill attention of paged chunks on the AMX tiles (bf16)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("out"), py::arg("starts"), py::arg("qlens"),
        py::arg("seq_lens"), py::arg("block_tables"), py::arg("scale"));
#endif
}
