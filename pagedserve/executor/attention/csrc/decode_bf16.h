#pragma once
// Decode attention in bfloat16 on the AVX512-BF16 dot products (vdpbf16ps): a bf16 model's
// decode rows (and speculative verification rows, each its own row) over a bf16 cache, K/V
// read in place through the block table, no conversion to float32 on the way in.
//
//   q    [n, h, d] bf16, row stride qs (the query part of fused QKV rows), heads contiguous
//   out  [n, h, d] bf16, contiguous
//   k_cache, v_cache [num_blocks, bs, kvh, d] bf16; d a multiple of 64 (paged_decode routes
//   d <= 256 here, the prefill kernels' bound)
//
// Per query head: S = q . k in float32 (products of bf16 pairs are exact; 32 products per
// vdpbf16ps, two per lane, then the 16 lanes reduced), the prefill kernel's softmax (softmax_rows: scale folded
// into the exponent, P rounded to bf16 as torch's bf16 attention rounds it, its sum in float32),
// O = P V with V's rows interleaved two by two (vdpbf16ps over pairs of tokens; the
// accumulators hold the head's dims in unpack order and are put back in order once), divided
// by the sum and rounded once to bf16. No float copies of q or out (the float kernel's route
// for bf16 made both).
//
// Work: one job per sequence (every KV head, tokens in chunks of 32: a block's rows are read
// once, in order, each head prefetching its slice a chunk ahead) when there are at least twice
// as many sequences as threads, else one per (sequence, KV head). A head's arithmetic is the
// same in both. A context longer than PART tokens (from its window's start) is cut into
// ceil(L / PART) near-equal parts, one job each over every KV head, whose softmax sums are
// merged (flash decoding); the parts depend on L alone, never on the step's other rows or
// threads, so a row's result has the same bits alone or among others (a 1-row decode step and
// a verification step agree).
//
// Measured against the float kernel on a Zen 4 (BENCHMARKS section 45). Built where the
// compiler targets AVX512-BF16 (the module then has set_decode_bf16, which turns it off: the
// Python side does where the kernels run on a path below avx512_bf16).
#if defined(PAGEDSERVE_PREFILL_BF16)
#define PAGEDSERVE_DECODE_BF16 1

namespace bf16_decode {

constexpr int64_t CH = 32;  // tokens per chunk: even, so P's pairs never straddle two chunks
// Tokens ahead whose K / V slices are prefetched (into L2). Each KV head's pass prefetches its
// own slice of the rows PFD_BF16 tokens on (one chunk, so the next chunk's), not the first head's
// pass whole rows: then two thirds of a chunk's passes issued no loads from memory, and the
// prefetches of the third came in bursts the core's miss buffers could not take. Zen 4, 30
// layers, random block tables, builds alternating (8 rounds): 64 rows x 320 25.2 -> 21.1 ms,
// 16 x 320 6.6 -> 5.4, 12 x 2,500 40.3 -> 30.5, 1 x 1,000 1.02 -> 0.88 (BENCHMARKS section 48;
// 16 tokens ahead then lost 10-20%, 48-64 nothing more, chunks of 16 or 64 tokens no better).
constexpr int64_t PFD_BF16 = 32;
// Longest context attended whole. A batch-1 step had one job per KV head (3 for 2 threads),
// each reading its head's slice of every row (128 of 384 bytes); longer contexts now take
// near-equal parts of whole rows. Zen 4, 30 layers, the two builds alternating: 1 row at
// context 1,000 1.22 -> 0.91 ms, 4,000 5.73 -> 5.02; rows (2,500, 100) 4.64 -> 3.80; a bf16
// engine's batch-1 decode step at 4,000 12.8 -> 11.3 ms (BENCHMARKS section 47). Contexts up
// to PART keep their bits.
constexpr int64_t PART = 512;
inline int64_t parts_of(int64_t L) { return L <= PART ? 1 : (L + PART - 1) / PART; }

inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// sc[gi * ld + t] = q[gi] . k[t] (unscaled) for t < n and G (<= 3) query heads of one KV head
// (token t's K slice at krows[t] + off). pfn elements from krows[t + PFD_BF16] + pf_off are
// prefetched (0: none) while t + PFD_BF16 < avail (rows krows may point at).
template <int G>
inline void scores(const uint16_t* q, const uint16_t* const* krows, int64_t off, int64_t n, int64_t ld, int64_t d,
                   float* sc, int64_t pf_off, int64_t pfn, int64_t avail) {
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    if (pfn && t + PFD_BF16 + 8 <= avail)
      for (int j = 0; j < 8; ++j) prefetch_row(krows[t + PFD_BF16 + j] + pf_off, pfn);
    __m512 acc[G][8];
    for (int gi = 0; gi < G; ++gi)
      for (int j = 0; j < 8; ++j) acc[gi][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 32) {
      __m512bh qv[G];
      for (int gi = 0; gi < G; ++gi) qv[gi] = load_bh(q + gi * d + c);
      for (int j = 0; j < 8; ++j) {
        const __m512bh kv = load_bh(krows[t + j] + off + c);
        for (int gi = 0; gi < G; ++gi) acc[gi][j] = _mm512_dpbf16_ps(acc[gi][j], kv, qv[gi]);
      }
    }
    for (int gi = 0; gi < G; ++gi) hsum8x16(acc[gi], sc + gi * ld + t);
  }
  for (; t < n; ++t)
    for (int gi = 0; gi < G; ++gi) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t c = 0; c < d; c += 32) a = _mm512_dpbf16_ps(a, load_bh(krows[t] + off + c), load_bh(q + gi * d + c));
      sc[gi * ld + t] = _mm512_reduce_add_ps(a);
    }
}

// o[gi][c0 : c0 + 64] (+)= sum_t p[gi][t] v[t][c0 : c0 + 64], t < n, for G (<= 3) heads, in
// unpack order (per 32 dims: the low halves' 16, then the high halves'). p of head gi at
// p + gi * ldp (bf16, zero past the context, so an odd n pairs its last token with a zero
// row); token t's V slice at vrows[t] + off; acc_in: add to o. pfn / pf_off / avail as in
// scores.
template <int G>
inline void pv(const uint16_t* p, int64_t ldp, int64_t n, const uint16_t* const* vrows, int64_t off, int64_t c0,
               float* o, int64_t ostride, bool acc_in, int64_t pf_off, int64_t pfn, int64_t avail) {
  alignas(64) static const uint16_t zero[64] = {};
  __m512 acc[G][4];
  for (int gi = 0; gi < G; ++gi)
    for (int c = 0; c < 4; ++c) acc[gi][c] = acc_in ? _mm512_loadu_ps(o + gi * ostride + c0 + 16 * c) : _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 2) {
    if (pfn)
      for (int64_t j = t + PFD_BF16; j < t + PFD_BF16 + 2 && j < avail; ++j) prefetch_row(vrows[j] + pf_off, pfn);
    const uint16_t* a = vrows[t] + off + c0;
    const uint16_t* b = t + 1 < n ? vrows[t + 1] + off + c0 : zero;
    const __m512i a0 = _mm512_loadu_si512(a), a1 = _mm512_loadu_si512(a + 32);
    const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 32);
    const __m512bh v[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0), (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                           (__m512bh)_mm512_unpacklo_epi16(a1, b1), (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
    for (int gi = 0; gi < G; ++gi) {
      int32_t pair;
      std::memcpy(&pair, p + gi * ldp + t, sizeof(pair));
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < 4; ++c) acc[gi][c] = _mm512_dpbf16_ps(acc[gi][c], v[c], pp);
    }
  }
  for (int gi = 0; gi < G; ++gi)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + gi * ostride + c0 + 16 * c, acc[gi][c]);
}

// out[0:d] = o (d dims in pv's unpack order) * inv, in order, rounded to bf16
inline void store_row(const float* o, float inv, int64_t d, uint16_t* out) {
  const __m512i lo_first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i lo_second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 s = _mm512_set1_ps(inv);
  for (int64_t c = 0; c < d; c += 32) {
    const __m512 lo = _mm512_loadu_ps(o + c), hi = _mm512_loadu_ps(o + c + 16);
    const __m512 x0 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, lo_first, hi), s);
    const __m512 x1 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, lo_second, hi), s);
    _mm512_storeu_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
  }
}

// Scratch of one thread.
struct Scratch {
  std::vector<const uint16_t*> krows, vrows;
  std::vector<float> sc, o;
  std::vector<uint16_t> p;
  std::vector<float> inv, mx, sum;
};

// One sequence's query heads of KV heads kh0 .. kh1 - 1 (g a KV head) over L positions:
// krows[t] / vrows[t] point at the whole K / V row ([kvh, d]) of the t-th. q: the sequence's
// query row ([h, d]). Leaves per head x (from kh0's first) the unnormalized output in w.o[x * d]
// (pv's unpack order), 1 / the sum of its exponentials in w.inv[x], the exponent's offset in
// w.mx[x] and that sum in w.sum[x].
inline void attend_sums(const uint16_t* q, int64_t L, int64_t kh0, int64_t kh1, int64_t kvh, int64_t g, int64_t d,
                        float scale, Scratch& w) {
  const int64_t width = (L + 15) / 16 * 16, heads = (kh1 - kh0) * g;
  w.sc.resize(heads * width), w.p.resize(heads * width), w.o.resize(heads * d), w.inv.resize(heads);
  w.mx.resize(heads), w.sum.resize(heads);
  const uint16_t* const* kr = w.krows.data();
  const uint16_t* const* vr = w.vrows.data();
  const int64_t pf_off = kh0 * d, pfn = (kh1 - kh0) * d;  // the job's heads' part of a row
  // Each pass's first PFD_BF16 rows are prefetched before it (K's) or before the softmax (V's),
  // which the passes' own prefetches never cover. Alternating, 10 rounds, 30 layers: 64 x 320
  // 28.3 -> 27.3 / 27.7 -> 26.3 ms, 64 x 128 13.1 -> 11.8, 16 x 320 7.8 -> 7.2; 1 row unchanged.
  for (int64_t t = 0; t < std::min(PFD_BF16, L); ++t) prefetch_row(kr[t] + pf_off, pfn);
  for (int64_t t0 = 0; t0 < L; t0 += CH) {
    const int64_t n = std::min(CH, L - t0);
    for (int64_t kh = kh0; kh < kh1; ++kh)
      for (int64_t g0 = 0; g0 < g; g0 += 3) {
        const int64_t x = (kh - kh0) * g + g0, pf = g0 == 0 ? d : 0;  // a head's first group prefetches its slice
        with_heads(std::min<int64_t>(3, g - g0), [&](auto G) {
          scores<decltype(G)::value>(q + (kh * g + g0) * d, kr + t0, kh * d, n, width, d, w.sc.data() + x * width + t0,
                                     kh * d, pf, L - t0);
        });
      }
  }
  for (int64_t t = 0; t < std::min(PFD_BF16, L); ++t) prefetch_row(vr[t] + pf_off, pfn);
  for (int64_t x = 0; x < heads; ++x)
    bf16_prefill::softmax_rows<1>(w.sc.data() + x * width, width, &L, scale, w.p.data() + x * width, &w.inv[x],
                                  &w.mx[x], &w.sum[x]);
  for (int64_t t0 = 0; t0 < L; t0 += CH) {
    const int64_t n = std::min(CH, L - t0);
    for (int64_t kh = kh0; kh < kh1; ++kh)
      for (int64_t g0 = 0; g0 < g; g0 += 3) {
        const int64_t x = (kh - kh0) * g + g0;
        for (int64_t c0 = 0; c0 < d; c0 += 64) {
          const int64_t pf = g0 == 0 ? 64 : 0;  // the 64 dims this call reads, of the rows ahead
          with_heads(std::min<int64_t>(3, g - g0), [&](auto G) {
            pv<decltype(G)::value>(w.p.data() + x * width + t0, width, n, vr + t0, kh * d, c0, w.o.data() + x * d, d,
                                   t0 > 0, kh * d + c0, pf, L - t0);
          });
        }
      }
  }
}

// attend_sums, then the output row's heads kh0 * g .. kh1 * g - 1 (out: the sequence's [h, d])
inline void attend(const uint16_t* q, int64_t L, int64_t kh0, int64_t kh1, int64_t kvh, int64_t g, int64_t d,
                   float scale, Scratch& w, uint16_t* out) {
  attend_sums(q, L, kh0, kh1, kvh, g, d, scale, w);
  for (int64_t x = 0; x < (kh1 - kh0) * g; ++x) store_row(w.o.data() + x * d, w.inv[x], d, out + (kh0 * g + x) * d);
}

// A split context's parts merged, per head x of h: out = sum_s e^(mx_s - M) o_s / sum_s
// e^(mx_s - M) sum_s (M the parts' largest offset), parts in order. o: [S, h, d] (unpack
// order), mx, sum: [S, h].
inline void merge_parts(const float* o, const float* mx, const float* sum, int64_t S, int64_t h, int64_t d,
                        uint16_t* out, std::vector<float>& acc) {
  acc.resize(d);
  for (int64_t x = 0; x < h; ++x) {
    float M = -std::numeric_limits<float>::infinity(), l = 0.f;
    for (int64_t s = 0; s < S; ++s) M = std::max(M, mx[s * h + x]);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t s = 0; s < S; ++s) {
      const float a = std::exp(mx[s * h + x] - M);
      l += a * sum[s * h + x];
      const float* os = o + (s * h + x) * d;
      for (int64_t c = 0; c < d; ++c) acc[c] += a * os[c];
    }
    store_row(acc.data(), 1.f / l, d, out + x * d);
  }
}

// decode_avx2's contract for bf16 q, K/V and out (n rows, q row stride qs), no soft-capping
// (the caller checks). Jobs run through run_jobs (paged_decode.cpp): inline for a small step,
// else costliest first over the threads; split contexts' parts are merged after them.
inline void decode(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc, const int64_t* bt,
                   const int64_t* seq_lens, uint16_t* out, int64_t n, int64_t h, int64_t kvh, int64_t d, int64_t bs,
                   int64_t max_blocks, float scale, int64_t window) {
  const int64_t g = h / kvh, nthr = at::get_num_threads();
  const bool per_seq = n >= 2 * nthr;  // else one job per (sequence, KV head) of a whole context
  struct Job {
    int64_t i, kh0, kh1, part;  // part: -1 for a whole context
  };
  std::vector<Job> jobs;
  std::vector<int64_t> cost, first(n + 1, 0);  // first[i]: sequence i's first part's index
  for (int64_t i = 0; i < n; ++i) {
    const int64_t L = seq_lens[i] - window_start(seq_lens[i], window), S = parts_of(L);
    first[i + 1] = first[i] + (S > 1 ? S : 0);
    if (S > 1) {
      for (int64_t s = 0; s < S; ++s)
        jobs.push_back({i, 0, kvh, s}), cost.push_back((L * (s + 1) / S - L * s / S) * h * d * 2);
    } else if (per_seq) {
      jobs.push_back({i, 0, kvh, -1}), cost.push_back(L * h * d * 2);
    } else {
      for (int64_t kh = 0; kh < kvh; ++kh) jobs.push_back({i, kh, kh + 1, -1}), cost.push_back(L * g * d * 2);
    }
  }
  const int64_t nparts = first[n];
  std::vector<float> po(nparts * h * d), pm(nparts * h), pl(nparts * h);  // the parts' sums
  run_jobs(cost, [] { return Scratch(); }, [&](Scratch& w, int64_t k) {
    const Job& j = jobs[k];
    const int64_t Ls = seq_lens[j.i], lo = window_start(Ls, window), L = Ls - lo;
    if (j.part < 0) {
      row_pointers(kc, vc, bt + j.i * max_blocks, bs, kvh * d, 0, lo, L, w.krows, w.vrows);
      attend(q + j.i * qs, L, j.kh0, j.kh1, kvh, g, d, scale, w, out + j.i * h * d);
      return;
    }
    const int64_t S = parts_of(L), t0 = L * j.part / S, t1 = L * (j.part + 1) / S, at = first[j.i] + j.part;
    row_pointers(kc, vc, bt + j.i * max_blocks, bs, kvh * d, 0, lo + t0, t1 - t0, w.krows, w.vrows);
    attend_sums(q + j.i * qs, t1 - t0, 0, kvh, kvh, g, d, scale, w);
    std::copy(w.o.begin(), w.o.begin() + h * d, po.begin() + at * h * d);
    std::copy(w.mx.begin(), w.mx.begin() + h, pm.begin() + at * h);
    std::copy(w.sum.begin(), w.sum.begin() + h, pl.begin() + at * h);
  });
  std::vector<float> acc;
  for (int64_t i = 0; i < n; ++i)
    if (first[i + 1] > first[i])
      merge_parts(&po[first[i] * h * d], &pm[first[i] * h], &pl[first[i] * h], first[i + 1] - first[i], h, d,
                  out + i * h * d, acc);
}

}  // namespace bf16_decode

#endif  // PAGEDSERVE_PREFILL_BF16
