// avx512_bf16's LoRA kernel: bf16 weights and activations through vdpbf16ps. Included by
// lora_kernels.cpp inside `namespace avx512_bf16` after lora_vec_avx512.h and lora_tiles.h.
// No include guard on purpose.

// ---- avx512_bf16: bf16 weights and activations, vdpbf16ps (two products a lane) -----------
// Packed layouts (executor/lora.py writes them): A2 [S, in/2, R, 2] (A2[k2, r, i] = A[2 k2 + i, r]);
// B2 [S, RP/2, out, 2], RP = rank (P > 1: B's zero blocks dropped, part p's rank rows sit over
// its own columns) or R (P = 1). x rows are read in place (bf16 pairs broadcast), h is
// rounded to bf16 (as PyTorch's bf16 product rounds it), the float sums are added to y.
static inline __mmask32 pairs(int n) { return (__mmask32)(n >= 16 ? 0xffffffffu : (1u << (2 * n)) - 1u); }
static inline vf vdp(vf acc, const uint16_t* pair, __m512i w) {
  int32_t v;
  std::memcpy(&v, pair, 4);
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(v), (__m512bh)w);
}

template <int NT, int NB, typename TY>
static inline void expand_block_bf16(const uint16_t* h, int64_t R, const uint16_t* B2, int64_t N, int64_t r0,
                                     int64_t rp, TY* const* yrow, int64_t col, int n_last) {
  vf acc[NT][NB];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < NB; ++j) acc[t][j] = vzero();
  for (int64_t j2 = 0; j2 < rp / 2; ++j2) {
    const uint16_t* br = B2 + (j2 * N + col) * 2;
    __m512i w[NB];
    for (int j = 0; j < NB; ++j) w[j] = _mm512_maskz_loadu_epi16(pairs(j == NB - 1 ? n_last : 16), br + j * 32);
    for (int t = 0; t < NT; ++t)
      for (int j = 0; j < NB; ++j) acc[t][j] = vdp(acc[t][j], h + t * R + r0 + 2 * j2, w[j]);
  }
  for (int t = 0; t < NT; ++t) {
    TY* yp = yrow[t] + col;
    for (int j = 0; j < NB; ++j) {
      const int n = j == NB - 1 ? n_last : 16;
      vstore(yp + j * 16, vadd(vload(yp + j * 16, n), acc[t][j]), n);
    }
  }
}

template <int NT, typename TY>
static void lora_tile_bf16(const LoraArgs<uint16_t, TY>& g, int64_t slot, const int64_t* rows, uint16_t* h) {
  const int64_t K = g.in, R = g.R, N = g.out, RP = g.parts == 1 ? R : g.rank;
  const uint16_t* xr[NT];
  for (int t = 0; t < NT; ++t) xr[t] = g.x + rows[t] * g.sx;
  const uint16_t* A2 = g.a + slot * K * R;
  for (int64_t c = 0; c < R; c += 16) {
    const int n = (int)std::min<int64_t>(16, R - c);
    vf acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = vzero();
    for (int64_t k2 = 0; k2 < K / 2; ++k2) {
      const __m512i w = _mm512_maskz_loadu_epi16(pairs(n), A2 + (k2 * R + c) * 2);
      for (int t = 0; t < NT; ++t) acc[t] = vdp(acc[t], xr[t] + 2 * k2, w);
    }
    for (int t = 0; t < NT; ++t) vstore(h + t * R + c, acc[t], n);  // rounded to bf16
  }
  const uint16_t* B2 = g.b + slot * RP * N;
  TY* yrow[NT];
  for (int t = 0; t < NT; ++t) yrow[t] = g.y + rows[t] * g.sy;
  for (int64_t p = 0; p < g.parts; ++p) {
    const int64_t r0 = g.parts == 1 ? 0 : p * g.rank, c0 = g.cols[p], c1 = g.cols[p + 1];
    int64_t col = c0;
    for (; col + NC * 16 <= c1; col += NC * 16) expand_block_bf16<NT, NC>(h, R, B2, N, r0, RP, yrow, col, 16);
    for (; col < c1; col += 16)
      expand_block_bf16<NT, 1>(h, R, B2, N, r0, RP, yrow, col, (int)std::min<int64_t>(16, c1 - col));
  }
}

template <typename TY>
static void lora_tiles_bf16(const LoraArgs<uint16_t, TY>& g, const int64_t* tiles, int64_t t0, int64_t t1) {
  std::vector<uint16_t> h(8 * g.R + 2);
  for (int64_t i = t0; i < t1; ++i) {
    const int64_t slot = tiles[3 * i], lo = tiles[3 * i + 1], nt = tiles[3 * i + 2];
    const int64_t* rows = g.rows + lo;
    switch (nt) {
      case 1: lora_tile_bf16<1>(g, slot, rows, h.data()); break;
      case 2: lora_tile_bf16<2>(g, slot, rows, h.data()); break;
      case 3: lora_tile_bf16<3>(g, slot, rows, h.data()); break;
      case 4: lora_tile_bf16<4>(g, slot, rows, h.data()); break;
      case 5: lora_tile_bf16<5>(g, slot, rows, h.data()); break;
      case 6: lora_tile_bf16<6>(g, slot, rows, h.data()); break;
      case 7: lora_tile_bf16<7>(g, slot, rows, h.data()); break;
      default: lora_tile_bf16<8>(g, slot, rows, h.data()); break;
    }
  }
}
