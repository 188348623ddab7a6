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
// once, in order, the first head prefetching whole rows) when there are at least twice as many
// sequences as threads, else one per (sequence, KV head). A head's arithmetic is the same in
// both, and a context is never split over threads, so a row's result has the same bits alone
// or among others (a 1-row decode step and a verification step agree).
//
// Measured against the float kernel on a Zen 4 (BENCHMARKS section 45). Built where the
// compiler targets AVX512-BF16 (the module then has set_decode_bf16, which turns it off: the
// Python side does where the kernels run on a path below avx512_bf16).
#if defined(PAGEDSERVE_PREFILL_BF16)
#define PAGEDSERVE_DECODE_BF16 1

namespace bf16_decode {

constexpr int64_t CH = 32;  // tokens per chunk: even, so P's pairs never straddle two chunks
// Tokens ahead whose rows are prefetched (into L2, as the float kernel's PFD): this kernel takes
// less time a token, so it prefetches further; 16 against 8, 10 alternations each (Zen 4, 30
// layers): 64 rows x 320 31.2 -> 29.7 ms, 12 x 2,500 40.1 -> 39.5, 5 x 320 2.04 -> 1.91.
constexpr int64_t PFD_BF16 = 16;

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
  std::vector<float> inv;
};

// One sequence's query heads of KV heads kh0 .. kh1 - 1 (g a KV head) over its L positions
// from lo: krows[t] / vrows[t] point at the whole K / V row ([kvh, d]) of position lo + t.
// q: the sequence's query row ([h, d]); out: its output row.
inline void attend(const uint16_t* q, int64_t L, int64_t kh0, int64_t kh1, int64_t kvh, int64_t g, int64_t d,
                   float scale, Scratch& w, uint16_t* out) {
  const int64_t width = (L + 15) / 16 * 16, heads = (kh1 - kh0) * g;
  w.sc.resize(heads * width), w.p.resize(heads * width), w.o.resize(heads * d), w.inv.resize(heads);
  const uint16_t* const* kr = w.krows.data();
  const uint16_t* const* vr = w.vrows.data();
  const int64_t pf_off = kh0 * d, pfn = (kvh - kh0) * d;  // the first head's pass prefetches the rest of each row
  // Each pass's first PFD_BF16 rows are prefetched before it (K's) or before the softmax (V's),
  // which the passes' own prefetches never cover. Alternating, 10 rounds, 30 layers: 64 x 320
  // 28.3 -> 27.3 / 27.7 -> 26.3 ms, 64 x 128 13.1 -> 11.8, 16 x 320 7.8 -> 7.2; 1 row unchanged.
  for (int64_t t = 0; t < std::min(PFD_BF16, L); ++t) prefetch_row(kr[t] + pf_off, pfn);
  for (int64_t t0 = 0; t0 < L; t0 += CH) {
    const int64_t n = std::min(CH, L - t0);
    for (int64_t kh = kh0; kh < kh1; ++kh)
      for (int64_t g0 = 0; g0 < g; g0 += 3) {
        const int64_t x = (kh - kh0) * g + g0, pf = kh == kh0 && g0 == 0 ? pfn : 0;
        with_heads(std::min<int64_t>(3, g - g0), [&](auto G) {
          scores<decltype(G)::value>(q + (kh * g + g0) * d, kr + t0, kh * d, n, width, d, w.sc.data() + x * width + t0,
                                     pf_off, pf, L - t0);
        });
      }
  }
  for (int64_t t = 0; t < std::min(PFD_BF16, L); ++t) prefetch_row(vr[t] + pf_off, pfn);
  for (int64_t x = 0; x < heads; ++x)
    bf16_prefill::softmax_rows<1>(w.sc.data() + x * width, width, &L, scale, w.p.data() + x * width, &w.inv[x]);
  for (int64_t t0 = 0; t0 < L; t0 += CH) {
    const int64_t n = std::min(CH, L - t0);
    for (int64_t kh = kh0; kh < kh1; ++kh)
      for (int64_t g0 = 0; g0 < g; g0 += 3) {
        const int64_t x = (kh - kh0) * g + g0;
        for (int64_t c0 = 0; c0 < d; c0 += 64) {
          const int64_t pf = kh == kh0 && g0 == 0 && c0 == 0 ? pfn : 0;
          with_heads(std::min<int64_t>(3, g - g0), [&](auto G) {
            pv<decltype(G)::value>(w.p.data() + x * width + t0, width, n, vr + t0, kh * d, c0, w.o.data() + x * d, d,
                                   t0 > 0, pf_off, pf, L - t0);
          });
        }
      }
  }
  for (int64_t x = 0; x < heads; ++x) store_row(w.o.data() + x * d, w.inv[x], d, out + (kh0 * g + x) * d);
}

// decode_avx2's contract for bf16 q, K/V and out (n rows, q row stride qs), no split contexts,
// no soft-capping (the caller checks both). Jobs run through run_jobs (paged_decode.cpp):
// inline for a small step, else costliest first over the threads.
inline void decode(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc, const int64_t* bt,
                   const int64_t* seq_lens, uint16_t* out, int64_t n, int64_t h, int64_t kvh, int64_t d, int64_t bs,
                   int64_t max_blocks, float scale, int64_t window) {
  const int64_t g = h / kvh, nthr = at::get_num_threads();
  const bool per_seq = n >= 2 * nthr;  // else one job per (sequence, KV head)
  const int64_t jobs = per_seq ? n : n * kvh;
  std::vector<int64_t> cost(jobs);
  for (int64_t job = 0; job < jobs; ++job) {
    const int64_t i = per_seq ? job : job / kvh;
    cost[job] = (seq_lens[i] - window_start(seq_lens[i], window)) * (per_seq ? h : g) * d * 2;
  }
  run_jobs(cost, [] { return Scratch(); }, [&](Scratch& w, int64_t job) {
    const int64_t i = per_seq ? job : job / kvh, kh0 = per_seq ? 0 : job % kvh, kh1 = per_seq ? kvh : kh0 + 1;
    const int64_t Ls = seq_lens[i], lo = window_start(Ls, window), L = Ls - lo;
    row_pointers(kc, vc, bt + i * max_blocks, bs, kvh * d, 0, lo, L, w.krows, w.vrows);
    attend(q + i * qs, L, kh0, kh1, kvh, g, d, scale, w, out + i * h * d);
  });
}

}  // namespace bf16_decode

#endif  // PAGEDSERVE_PREFILL_BF16
