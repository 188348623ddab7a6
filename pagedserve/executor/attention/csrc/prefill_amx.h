#pragma once
// Prefill attention on the AMX tiles, bfloat16: every listed request's query rows (a prompt
// chunk, fresh or after cached context) attend causally to keys 0 .. their own position, K/V
// read through the block table from the paged cache (written before the call). One call for
// all of a step's prefill chunks: a step of many short prompts is not one SDPA call per prompt
// and layer (~150-250 us each for 64-256 tokens on two cores), and a chunk over a cached
// prefix reads the cache in place instead of a gathered copy.
//
// The arguments, K / V packing, softmax and work split are prefill_bf16.h's (bf16_prefill::run,
// pack_kv: K as TDPBF16PS's B operand for Q K^T, 16 keys x 32 dims a tile, pairs of dims
// interleaved; V as the B operand for P V, 16 dims x 32 keys a tile, pairs of keys
// interleaved). Here: per (request, query head, block of 32 query rows), S = Q K^T on the
// tiles in float32, softmax_rows four rows at a time, O = P V on the tiles, divided by the sum
// and rounded once to bf16. Built only where the compiler targets AMX-BF16 (this module is
// built for the machine's CPU); callers check that the module has `prefill_amx` and that the
// kernels run on an AMX path (cpu_kernels.amx_prefill_usable).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(PAGEDSERVE_PREFILL_BF16)
#define PAGEDSERVE_PREFILL_AMX 1
#include <immintrin.h>

#include "amx_tiles.h"  // TileConfig, load_tile_config, tiles_granted

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace amx_prefill {
using namespace bf16_prefill;

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
inline void attend_tiles(Scratch& w, const Req& r, int64_t hq, int64_t i0, int64_t i1, const uint16_t* q, int64_t sq,
                         const uint16_t* kp, const uint16_t* vp, int64_t d, float scale, uint16_t* out, int64_t so) {
  const int64_t mb = i1 - i0, halves = mb > 16 ? 2 : 1, nc = d / 32, nu = d / 16;
  const int64_t keys = r.ctx + i1, nt = (keys + KEYS - 1) / KEYS, ls = nt * KEYS;  // keys the block sees
  int64_t qs;  // Q in one or two 16-row tiles
  const uint16_t* qa = w.query_rows(q + (r.start + i0) * sq + hq * d, sq, mb, 16 * halves, d, &qs);
  w.fit(ls);
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
    store_rows(r, hq, i0 + 16 * hh, std::min<int64_t>(16, mb - 16 * hh), O, inv + 16 * hh, d, out, so);
  }
}

}  // namespace amx_prefill

// prefill_amx(q, k_cache, v_cache, out, starts, qlens, seq_lens, block_tables, scale): see the
// top of this file.
inline void prefill_amx(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                        torch::Tensor starts, torch::Tensor qlens, torch::Tensor seq_lens, torch::Tensor block_tables,
                        double scale) {
  using namespace amx_prefill;
  TORCH_CHECK(tiles_granted(), "prefill_amx: Linux refused this process the AMX tile state");
  run("prefill_amx", q, k_cache, v_cache, out, starts, qlens, seq_lens, block_tables, scale,
      [] { return TileThread(); }, [](TileThread& w, auto&&... a) { attend_tiles(w.scratch, a...); });
}
#endif  // AMX-BF16
