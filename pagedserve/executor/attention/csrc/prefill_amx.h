#pragma once
// Prefill attention on the AMX tiles, bfloat16: every listed request's query rows (a prompt
// chunk, fresh or after cached context) attend causally to keys 0 .. their own position, K/V
// read through the block table from the paged cache (written before the call). One call for
// all of a step's prefill chunks: a step of many short prompts is not one SDPA call per prompt
// and layer (~150-250 us each for 64-256 tokens on two cores), and a chunk over a cached
// prefix reads the cache in place instead of a gathered copy.
//
//   q        [T, h, d] bf16, heads contiguous in a row (the row stride may be larger)
//   k_cache, v_cache  [num_blocks, bs, kvh, d] bf16
//   out      [T, h, d] bf16, heads contiguous in a row; the listed requests' rows are written
//   starts, qlens, seq_lens  int64 [R]: request r's queries are rows starts[r] ..
//            starts[r] + qlens[r] - 1, at positions seq_lens[r] - qlens[r] .. seq_lens[r] - 1
//   block_tables  int64 [R, max_blocks] (row r: request r's blocks)
//
// d a multiple of 32, at most 256. Per (request, KV head), K is packed once as TDPBF16PS's B
// operand for Q K^T (16 keys x 32 dims a tile, pairs of dims interleaved) and V as the B
// operand for P V (16 dims x 32 keys a tile, pairs of keys interleaved), zero past the last key.
// Per (request, query head, block of 32 query rows): S = Q K^T on the tiles in float32, an
// exact softmax per row, four rows at a time (max over the row, Cephes exponentials, the
// scale folded in; P rounded to bf16 for the tiles, its sum kept in float32), O = P V on the
// tiles, divided by the sum and rounded once to bf16. Blocks are handed out from a shared
// counter, costliest first. Built only where the compiler targets AMX-BF16 (this module is
// built for the machine's CPU); callers check that the module has `prefill_amx` and that the
// kernels run on an AMX path (cpu_kernels.amx_prefill_usable).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BW__)
#define PAGEDSERVE_PREFILL_AMX 1
#include <immintrin.h>

#include "amx_tiles.h"  // TileConfig, load_tile_config, tiles_granted
#include "chunk_args.h"  // ChunkArgs: the requests' rows and block tables, checked
#include "work_queue.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace amx_prefill {

constexpr int64_t QROWS = 32;  // query rows per work item: two 16-row A tiles
constexpr int64_t KEYS = 32;  // keys per step: two 16-key tiles of K^T, one 32-key tile of V
constexpr int64_t MAX_D = 256;  // head_dim at most (prefill_amx checks it)

// Every tile 16 rows x 64 bytes: 0-3 float32 sums (16 x 16), 4-5 A (16 rows x 32 bf16),
// 6-7 B (16 pairs x 16 columns x 2 bf16).
inline void configure() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  load_tile_config(c);
}

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
// exponentials are latency chains).
template <int R>
inline void softmax_rows(const float* s, int64_t width, const int64_t* n, float scale, uint16_t* p, float* inv) {
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
  for (int i = 0; i < R; ++i) inv[i] = n[i] ? 1.f / _mm512_reduce_add_ps(sum[i]) : 0.f;
}

// Scratch of one thread: the query block, scores, probabilities and output sums.
struct Scratch {
  std::vector<uint16_t> qb, pb;
  std::vector<float> sb, ob;
};

// A thread's part of a call: the tiles configured while it lives, its scratch.
struct TileThread {
  Scratch scratch;
  TileThread() { configure(); }
  ~TileThread() { _tile_release(); }
  TileThread(const TileThread&) = delete;
  TileThread& operator=(const TileThread&) = delete;
};

// Query rows i0 .. i1 - 1 of request r (i1 - i0 <= QROWS), query head hq, against its packed
// K / V; the output rows written to out (row stride so).
inline void attend_block(const Req& r, int64_t hq, int64_t i0, int64_t i1, const uint16_t* q, int64_t sq,
                         const uint16_t* kp, const uint16_t* vp, int64_t d, float scale, uint16_t* out, int64_t so,
                         Scratch& w) {
  const int64_t mb = i1 - i0, halves = mb > 16 ? 2 : 1, nc = d / 32, nu = d / 16;
  const int64_t keys = r.ctx + i1, nt = (keys + KEYS - 1) / KEYS, ls = nt * KEYS;  // keys the block sees
  // Q's tiles read in place when the block fills them (16 or 32 rows), else from a zero-padded copy
  const uint16_t* qa = q + (r.start + i0) * sq + hq * d;
  int64_t qs = sq;
  if (mb != 16 * halves) {
    w.qb.assign(QROWS * d, 0);
    for (int64_t i = 0; i < mb; ++i) std::memcpy(w.qb.data() + i * d, qa + i * sq, d * sizeof(uint16_t));
    qa = w.qb.data(), qs = d;
  }
  if ((int64_t)w.sb.size() < QROWS * ls) w.sb.resize(QROWS * ls), w.pb.resize(QROWS * ls);
  float* S = w.sb.data();
  uint16_t* P = w.pb.data();
  for (int64_t t = 0; t < nt; ++t) {  // S = Q K^T, 32 x 32 keys at a time
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < nc; ++c) {
      _tile_loadd(4, qa + c * 32, qs * 2);
      _tile_loadd(6, kp + ((2 * t) * nc + c) * 512, 64);
      _tile_loadd(7, kp + ((2 * t + 1) * nc + c) * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (halves == 2) {
        _tile_loadd(5, qa + 16 * qs + c * 32, qs * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, S + t * KEYS, ls * 4);
    _tile_stored(1, S + t * KEYS + 16, ls * 4);
    if (halves == 2) {
      _tile_stored(2, S + 16 * ls + t * KEYS, ls * 4);
      _tile_stored(3, S + 16 * ls + t * KEYS + 16, ls * 4);
    }
  }
  float inv[QROWS];
  int64_t n[QROWS];  // keys row i sees; none for the padding rows past mb (their P is zero)
  for (int64_t i = 0; i < halves * 16; ++i) n[i] = i < mb ? r.ctx + i0 + i + 1 : 0;
  for (int64_t i = 0; i < halves * 16; i += 4) softmax_rows<4>(S + i * ls, ls, n + i, scale, P + i * ls, inv + i);
  if ((int64_t)w.ob.size() < 16 * d) w.ob.resize(16 * d);
  float* O = w.ob.data();
  for (int64_t hh = 0; hh < halves; ++hh) {
    const int64_t last = std::min(r.ctx + i0 + 16 * hh + 16, keys);  // keys these 16 rows see
    const int64_t th = (last + KEYS - 1) / KEYS;
    for (int64_t u0 = 0; u0 < nu; u0 += 4) {  // 64 output dims (four tiles) at a time
      const int64_t un = std::min<int64_t>(4, nu - u0);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t t = 0; t < th; ++t) {
        _tile_loadd(4, P + 16 * hh * ls + t * KEYS, ls * 2);
        const uint16_t* vt = vp + (t * nu + u0) * 512;
        _tile_loadd(6, vt, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (un > 1) {
          _tile_loadd(7, vt + 512, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (un > 2) {
          _tile_loadd(6, vt + 1024, 64);
          _tile_dpbf16ps(2, 4, 6);
          _tile_loadd(7, vt + 1536, 64);
          _tile_dpbf16ps(3, 4, 7);
        }
      }
      _tile_stored(0, O + u0 * 16, d * 4);
      if (un > 1) _tile_stored(1, O + u0 * 16 + 16, d * 4);
      if (un > 2) {
        _tile_stored(2, O + u0 * 16 + 32, d * 4);
        _tile_stored(3, O + u0 * 16 + 48, d * 4);
      }
    }
    for (int64_t i = 16 * hh; i < std::min(mb, 16 * hh + 16); ++i) {
      uint16_t* o = out + (r.start + i0 + i) * so + hq * d;
      const __m512 vi = _mm512_set1_ps(inv[i]);
      for (int64_t x = 0; x < d; x += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + x),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(O + (i - 16 * hh) * d + x), vi)));
    }
  }
}

}  // namespace amx_prefill

// prefill_amx(q, k_cache, v_cache, out, starts, qlens, seq_lens, block_tables, scale): see the
// top of this file.
inline void prefill_amx(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                        torch::Tensor starts, torch::Tensor qlens, torch::Tensor seq_lens, torch::Tensor block_tables,
                        double scale) {
  using namespace amx_prefill;
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q/out [T,h,d], k_cache/v_cache [nb,bs,kvh,d]");
  const int64_t T = q.size(0), h = q.size(1), d = q.size(2), bs = k_cache.size(1), kvh = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && h % kvh == 0 && out.sizes() == q.sizes(), "head shapes");
  TORCH_CHECK(d % 32 == 0 && d <= MAX_D, "prefill_amx: head_dim a multiple of 32, at most 256");
  TORCH_CHECK(tiles_granted(), "prefill_amx: Linux refused this process the AMX tile state");
  for (const auto& x : {q, k_cache, v_cache, out}) TORCH_CHECK(x.scalar_type() == at::kBFloat16, "prefill_amx: bf16");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && out.stride(2) == 1 && out.stride(1) == d,
              "q/out: rows of contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches contiguous");
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
  static std::vector<uint16_t> kpack, vpack;  // reused across layers (calls hold the GIL)
  kpack.resize(packed);
  vpack.resize(packed);
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  at::parallel_for(0, R * kvh, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Req& r = reqs[i / kvh];
      const int64_t g = i % kvh, off = r.packed + g * r.nt * KEYS * d;
      pack_kv(r, g, kc, vc, bs, kvh, d, kpack.data() + off, vpack.data() + off);
    }
  });
  struct Item {
    int64_t cost, r, hq, i0;
  };
  std::vector<Item> items;
  for (int64_t i = 0; i < R; ++i)
    for (int64_t i0 = 0; i0 < reqs[i].qlen; i0 += QROWS)
      for (int64_t hq = 0; hq < h; ++hq) {
        const int64_t i1 = std::min(reqs[i].qlen, i0 + QROWS);  // cost: rows x keys they see
        items.push_back({(i1 - i0) * (reqs[i].ctx + i1 + KEYS), i, hq, i0});
      }
  const int64_t g = h / kvh;
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  costliest_first(
      items, [] { return TileThread(); },
      [&](TileThread& w, const Item& it) {
        const Req& r = reqs[it.r];
        const int64_t off = r.packed + (it.hq / g) * r.nt * KEYS * d;
        attend_block(r, it.hq, it.i0, std::min(r.qlen, it.i0 + QROWS), qd, q.stride(0), kpack.data() + off,
                     vpack.data() + off, d, (float)scale, od, out.stride(0), w.scratch);
      });
}
#endif  // AMX-BF16
