#pragma once
// Prefill attention in bfloat16 on the AVX512-BF16 dot products (vdpbf16ps), and the pieces it
// shares with the AMX tile kernel (prefill_amx.h): every listed request's query rows (a prompt
// chunk, fresh or after cached context) attend causally to keys 0 .. their own position, K/V
// read through the block table from the paged cache (written before the call), all of a step's
// chunks in one call.
//
//   q        [T, h, d] bf16, heads contiguous in a row (the row stride may be larger)
//   k_cache, v_cache  [num_blocks, bs, kvh, d] bf16
//   out      [T, h, d] bf16, heads contiguous in a row; the listed requests' rows are written
//   starts, qlens, seq_lens  int64 [R]: request r's queries are rows starts[r] ..
//            starts[r] + qlens[r] - 1, at positions seq_lens[r] - qlens[r] .. seq_lens[r] - 1
//   block_tables  int64 [R, max_blocks] (row r: request r's blocks)
//
// d a multiple of 32, at most 256. Per (request, KV head), K and V are packed once in the tile
// kernel's layouts (pack_kv): for a pair of dims, 16 keys x 2 bf16 (one 512-bit vector whose
// lanes are keys), and for a pair of keys, 16 dims x 2 bf16 (lanes are dims): vdpbf16ps's B
// operand as they are TDPBF16PS's. Per (request, query head, block of 32 query rows): S = Q K^T
// in float32 (products of bf16 pairs are exact; sums in float32), an exact softmax per row with
// the scale folded in (softmax_rows: P rounded to bf16 as torch's bf16 flash attention rounds it,
// its sum kept in float32), O = P V in float32, divided by the sum and rounded once to bf16.
// Blocks are handed out from a shared counter, costliest first. Built where the compiler targets
// AVX512-BF16 (this module is built for the machine's CPU); the caller also checks that the
// kernels run on a path with native bf16 (PAGEDSERVE_CPU_ISA may choose one below).
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDSERVE_PREFILL_BF16 1
#include <immintrin.h>

#include "chunk_args.h"  // ChunkArgs: the requests' rows and block tables, checked
#include "work_queue.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace bf16_prefill {

constexpr int64_t QROWS = 32;  // query rows per work item (two 16-row A tiles on AMX)
constexpr int64_t KEYS = 32;  // keys per packed block: two 16-key blocks of K^T, one 32-key block of V
constexpr int64_t MAX_D = 256;  // head_dim at most (the entry points check it)

struct Req {
  int64_t start, qlen, ctx, nt;  // rows, query count, cached positions before them, 32-key blocks
  const int64_t* table;
  int64_t packed;  // offset of its (KV head 0) packed K / V, in bf16 elements
};

#include "avx512_transpose.h"  // transpose16x16_epi32

// Pack request r's keys and values of KV head g: K into [2 nt][d / 32][16 pairs][16 keys][2],
// V into [nt][d / 16][16 pairs][16 dims][2] (pairs of dims / keys interleaved), zero past the
// last key. Each buffer is nt * 32 * d elements. 16 keys at a time: K's 16 x 16 pairs
// transposed in registers, V's rows interleaved two by two.
inline void pack_kv(const Req& r, int64_t g, const uint16_t* kc, const uint16_t* vc, int64_t bs, int64_t kvh,
                    int64_t d, uint16_t* kp, uint16_t* vp) {
  static const uint16_t zero[MAX_D] = {};  // the rows past the last key
  const int64_t L = r.ctx + r.qlen, nc = d / 32, nu = d / 16;
  alignas(64) static const uint16_t pairs[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i interleave = _mm512_load_si512(pairs);
  for (int64_t kb = 0; kb < 2 * r.nt; ++kb) {
    const uint16_t *krow[16], *vrow[16];
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t j = kb * 16 + i, row = (j < L ? (r.table[j / bs] * bs + j % bs) * kvh + g : 0);
      krow[i] = j < L ? kc + row * d : zero;
      vrow[i] = j < L ? vc + row * d : zero;
    }
    for (int64_t c = 0; c < nc; ++c) {
      __m512i m[16];
      for (int i = 0; i < 16; ++i) m[i] = _mm512_loadu_si512(krow[i] + c * 32);
      transpose16x16_epi32(m);
      uint16_t* dst = kp + (kb * nc + c) * 512;
      for (int q = 0; q < 16; ++q) _mm512_storeu_si512(dst + q * 32, m[q]);
    }
    const int64_t t = kb / 2;
    for (int64_t pp = 0; pp < 8; ++pp) {
      const int64_t p = (kb % 2) * 8 + pp;
      for (int64_t u = 0; u < nu; ++u) {
        const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * pp] + u * 16)));
        const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * pp + 1] + u * 16)));
        _mm512_storeu_si512(vp + (t * nu + u) * 512 + p * 32, _mm512_permutex2var_epi16(a, interleave, b));
      }
    }
  }
}

// The softmax of R rows (row i: s + i * width, its first n[i] keys; n[i] = 0 for a padding
// row): P (bf16), zero from n[i] to `width` (a multiple of 16), and 1 / the float32 sum of
// each row's exponentials in inv. R rows at once: their max / exp / sum chains interleave
// (rows are short, 32-256 keys in an embedding step, and one row's reductions and
// exponentials are latency chains). With mx / sums: each row's scaled maximum (the exponent's
// offset) and its sum too (a part of a context, merged later: decode_bf16.h).
template <int R>
inline void softmax_rows(const float* s, int64_t width, const int64_t* n, float scale, uint16_t* p, float* inv,
                         float* mx = nullptr, float* sums = nullptr) {
  __m512 mv[R], vm[R], sum[R];
  for (int i = 0; i < R; ++i) mv[i] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < width; t += 16)
    for (int i = 0; i < R; ++i) {
      const __mmask16 k = t < n[i] ? ::tail_mask16(n[i] - t) : __mmask16(0);
      mv[i] = _mm512_mask_max_ps(mv[i], k, mv[i], _mm512_maskz_loadu_ps(k, s + i * width + t));
    }
  const __m512 vs = _mm512_set1_ps(scale);
  for (int i = 0; i < R; ++i) vm[i] = _mm512_set1_ps(_mm512_reduce_max_ps(mv[i]) * scale), sum[i] = _mm512_setzero_ps();
  for (int64_t t = 0; t < width; t += 16)
    for (int i = 0; i < R; ++i) {
      const __mmask16 k = t < n[i] ? ::tail_mask16(n[i] - t) : __mmask16(0);
      const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + i * width + t), vs, vm[i]);
      const __m512 e = _mm512_maskz_mov_ps(k, ::exp16(x));
      sum[i] = _mm512_add_ps(sum[i], e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i * width + t), (__m256i)_mm512_cvtneps_pbh(e));
    }
  for (int i = 0; i < R; ++i) {
    const float total = _mm512_reduce_add_ps(sum[i]);
    inv[i] = n[i] ? 1.f / total : 0.f;
    if (mx) mx[i] = _mm512_cvtss_f32(vm[i]), sums[i] = total;
  }
}

// Scratch of one thread: the query block, scores, probabilities and output sums.
struct Scratch {
  std::vector<uint16_t> qb, pb;
  std::vector<float> sb, ob;

  // The query rows of a block (mb rows from qa, row stride sq), `rows` of them as the kernel
  // reads them (its row groups): in place when mb fills them, else a zero-padded copy. Returns
  // the rows and sets *stride.
  const uint16_t* query_rows(const uint16_t* qa, int64_t sq, int64_t mb, int64_t rows, int64_t d, int64_t* stride) {
    *stride = sq;
    if (mb == rows) return qa;
    qb.assign(rows * d, 0);
    for (int64_t i = 0; i < mb; ++i) std::memcpy(qb.data() + i * d, qa + i * sq, d * sizeof(uint16_t));
    *stride = d;
    return qb.data();
  }

  // Room for QROWS rows of scores and probabilities over ls keys.
  void fit(int64_t ls) {
    if ((int64_t)sb.size() < QROWS * ls) sb.resize(QROWS * ls), pb.resize(QROWS * ls);
  }
};

// Writes rows [r0, r0 + n) of a 16-row group's float32 output sums O ([16][d]) times their
// 1 / sum, rounded to bf16, to out (query head hq).
inline void store_rows(const Req& r, int64_t hq, int64_t row0, int64_t n, const float* O, const float* inv, int64_t d,
                       uint16_t* out, int64_t so) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t* o = out + (r.start + row0 + i) * so + hq * d;
    const __m512 vi = _mm512_set1_ps(inv[i]);
    for (int64_t x = 0; x < d; x += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + x),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(O + i * d + x), vi)));
  }
}

// The packed K / V of a call: one pair of buffers for both kernels, reused across layers
// (calls hold the GIL: one at a time), so they keep one layer's peak, not one per kernel.
struct Packed {
  std::vector<uint16_t> k, v;
};
inline Packed& packed_kv() {
  static Packed p;
  return p;
}

// The items of a call: (request, query head, block of QROWS query rows), cost = rows x keys seen.
struct Item {
  int64_t cost, r, hq, i0;
};

// The common part of a call (prefill_bf16 and prefill_amx): the arguments checked, every
// request's K / V packed per KV head, then attend(thread_state, req, hq, i0, i1, q, sq, kp, vp,
// d, scale, out, so) on every block, costliest first, each thread's state made by make().
template <typename Make, typename Attend>
inline void run(const char* name, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                torch::Tensor starts, torch::Tensor qlens, torch::Tensor seq_lens, torch::Tensor block_tables,
                double scale, Make make, Attend attend) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), name,
              ": q/out [T,h,d], k_cache/v_cache [nb,bs,kvh,d]");
  const int64_t T = q.size(0), h = q.size(1), d = q.size(2), bs = k_cache.size(1), kvh = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && h % kvh == 0 && out.sizes() == q.sizes(), name, ": head shapes");
  TORCH_CHECK(d % 32 == 0 && d <= MAX_D, name, ": head_dim a multiple of 32, at most 256");
  for (const auto& x : {q, k_cache, v_cache, out}) TORCH_CHECK(x.scalar_type() == at::kBFloat16, name, ": bf16");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && out.stride(2) == 1 && out.stride(1) == d, name,
              ": q/out rows of contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), name, ": caches contiguous");
  const auto args = ChunkArgs::make(starts, qlens, seq_lens, block_tables, T, bs, k_cache.size(0));
  const int64_t R = args.R;
  std::vector<Req> reqs(R);
  int64_t packed = 0;
  for (int64_t i = 0; i < R; ++i) {
    Req& r = reqs[i];
    r.start = args.start(i), r.qlen = args.qlen(i);
    r.ctx = args.seq_len(i) - r.qlen;
    r.nt = (r.ctx + r.qlen + KEYS - 1) / KEYS;
    r.table = args.table(i);
    r.packed = packed;
    packed += kvh * r.nt * KEYS * d;
  }
  Packed& pk = packed_kv();
  pk.k.resize(packed);
  pk.v.resize(packed);
  uint16_t *kpack = pk.k.data(), *vpack = pk.v.data();
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  at::parallel_for(0, R * kvh, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Req& r = reqs[i / kvh];
      const int64_t g = i % kvh, off = r.packed + g * r.nt * KEYS * d;
      pack_kv(r, g, kc, vc, bs, kvh, d, kpack + off, vpack + off);
    }
  });
  std::vector<Item> items;
  for (int64_t i = 0; i < R; ++i)
    for (int64_t i0 = 0; i0 < reqs[i].qlen; i0 += QROWS)
      for (int64_t hq = 0; hq < h; ++hq) {
        const int64_t i1 = std::min(reqs[i].qlen, i0 + QROWS);
        items.push_back({(i1 - i0) * (reqs[i].ctx + i1 + KEYS), i, hq, i0});
      }
  const int64_t g = h / kvh;
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  costliest_first(items, make, [&](auto& w, const Item& it) {
    const Req& r = reqs[it.r];
    const int64_t off = r.packed + (it.hq / g) * r.nt * KEYS * d;
    attend(w, r, it.hq, it.i0, std::min(r.qlen, it.i0 + QROWS), qd, q.stride(0), kpack + off, vpack + off, d,
           (float)scale, od, out.stride(0));
  });
}

inline __m512bh pair_of(const uint16_t* p) {  // two bf16 at p, broadcast to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// S rows [m0, m0 + 8) x 32 keys of block t: acc[row][half] (16 keys each) over every pair of
// dims; A (queries) broadcast a pair at a time, B (packed K) one vector per pair and half.
inline void scores_8x32(const uint16_t* qa, int64_t qs, const uint16_t* kp, int64_t t, int64_t nc, float* S,
                        int64_t ls) {
  __m512 acc[8][2];
  for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < nc; ++c) {
    const uint16_t* k0 = kp + ((2 * t) * nc + c) * 512;
    const uint16_t* k1 = kp + ((2 * t + 1) * nc + c) * 512;
    for (int p = 0; p < 16; ++p) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(k0 + p * 32);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(k1 + p * 32);
      for (int i = 0; i < 8; ++i) {
        const __m512bh a = pair_of(qa + i * qs + c * 32 + 2 * p);
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
      }
    }
  }
  for (int i = 0; i < 8; ++i) {
    _mm512_storeu_ps(S + i * ls + t * KEYS, acc[i][0]);
    _mm512_storeu_ps(S + i * ls + t * KEYS + 16, acc[i][1]);
  }
}

// O rows [0, 4) x dims [16 u0, 16 (u0 + UN)) = P V over key pairs [0, pairs): acc[row][u], P
// broadcast a pair of keys at a time, V one vector (16 dims x 2 keys) per pair and u.
template <int UN>
inline void pv_4rows(const uint16_t* P, int64_t ls, const uint16_t* vp, int64_t u0, int64_t nu, int64_t pairs,
                     float* O, int64_t d) {
  __m512 acc[4][UN];
  for (int i = 0; i < 4; ++i)
    for (int u = 0; u < UN; ++u) acc[i][u] = _mm512_setzero_ps();
  for (int64_t j2 = 0; j2 < pairs; ++j2) {
    const uint16_t* vt = vp + ((j2 / 16) * nu + u0) * 512 + (j2 % 16) * 32;
    __m512bh b[UN];
    for (int u = 0; u < UN; ++u) b[u] = (__m512bh)_mm512_loadu_si512(vt + u * 512);
    for (int i = 0; i < 4; ++i) {
      const __m512bh a = pair_of(P + i * ls + 2 * j2);
      for (int u = 0; u < UN; ++u) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], a, b[u]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int u = 0; u < UN; ++u) _mm512_storeu_ps(O + i * d + (u0 + u) * 16, acc[i][u]);
}

// Query rows i0 .. i1 - 1 of request r (i1 - i0 <= QROWS), query head hq, against its packed
// K / V, on the vdpbf16ps dot products; the output rows written to out (row stride so).
inline void attend_dpbf16(Scratch& w, const Req& r, int64_t hq, int64_t i0, int64_t i1, const uint16_t* q, int64_t sq,
                         const uint16_t* kp, const uint16_t* vp, int64_t d, float scale, uint16_t* out, int64_t so) {
  const int64_t mb = i1 - i0, rows = (mb + 7) / 8 * 8, nc = d / 32, nu = d / 16;
  const int64_t keys = r.ctx + i1, nt = (keys + KEYS - 1) / KEYS, ls = nt * KEYS;  // keys the block sees
  int64_t qs;  // Q in groups of 8 rows
  const uint16_t* qa = w.query_rows(q + (r.start + i0) * sq + hq * d, sq, mb, rows, d, &qs);
  w.fit(ls);
  float* S = w.sb.data();
  uint16_t* P = w.pb.data();
  for (int64_t m0 = 0; m0 < rows; m0 += 8) {
    const int64_t tn = std::min(nt, (r.ctx + i0 + m0 + 8 + KEYS - 1) / KEYS);  // blocks these rows see
    for (int64_t t = 0; t < tn; ++t) scores_8x32(qa + m0 * qs, qs, kp, t, nc, S + m0 * ls, ls);
  }
  float inv[QROWS];
  int64_t n[QROWS];  // keys row i sees; none for the padding rows past mb (their P is zero)
  const int64_t rows4 = (mb + 3) / 4 * 4;
  for (int64_t i = 0; i < rows4; ++i) n[i] = i < mb ? r.ctx + i0 + i + 1 : 0;
  for (int64_t i = 0; i < rows4; i += 4) softmax_rows<4>(S + i * ls, ls, n + i, scale, P + i * ls, inv + i);
  if ((int64_t)w.ob.size() < 4 * d) w.ob.resize(4 * d);
  float* O = w.ob.data();
  for (int64_t m0 = 0; m0 < mb; m0 += 4) {
    const int64_t pairs = (std::min(r.ctx + i0 + m0 + 4, keys) + 1) / 2;  // keys these rows see, in pairs
    for (int64_t u0 = 0; u0 < nu; u0 += 4) {  // nu = d / 16 is even (d % 32 == 0): 4 or a last 2
      if (nu - u0 >= 4) pv_4rows<4>(P + m0 * ls, ls, vp, u0, nu, pairs, O, d);
      else pv_4rows<2>(P + m0 * ls, ls, vp, u0, nu, pairs, O, d);
    }
    store_rows(r, hq, i0 + m0, std::min<int64_t>(4, mb - m0), O, inv + m0, d, out, so);
  }
}

}  // namespace bf16_prefill

// prefill_bf16(q, k_cache, v_cache, out, starts, qlens, seq_lens, block_tables, scale): see the
// top of this file.
inline void prefill_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                         torch::Tensor starts, torch::Tensor qlens, torch::Tensor seq_lens, torch::Tensor block_tables,
                         double scale) {
  using namespace bf16_prefill;
  run("prefill_bf16", q, k_cache, v_cache, out, starts, qlens, seq_lens, block_tables, scale,
      [] { return Scratch(); }, [](Scratch& w, auto&&... a) { attend_dpbf16(w, a...); });
}
#endif  // AVX512-BF16
