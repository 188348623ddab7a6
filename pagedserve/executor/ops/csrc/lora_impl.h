// The fused LoRA shrink + expand of one instruction set. Included by lora_kernels.cpp once per
// ISA, inside a namespace and a target region, with LK_W = 16 (AVX-512 F/BW/VL) or 8 (AVX2 +
// FMA). No include guard on purpose.
//
// One tile = up to 8 token rows of one adapter segment. Per tile: the rows are gathered and
// widened to float once, h = x @ A (rank R, float accumulators; rounded to the weights' dtype,
// as PyTorch's bf16 product rounds it), then, per part of a fused layer, y[:, part's columns]
// += h[:, part's rank rows] @ B[part's rows, part's columns], accumulated in float and added to
// y in place (one rounding to y's dtype). B's zero blocks (other parts) are never read.

#if LK_W == 16
using vf = __m512;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vset1(float v) { return _mm512_set1_ps(v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline __mmask16 lanes(int n) { return (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1u); }
static inline vf vload(const float* p, int n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
static inline vf vload(const uint16_t* p, int n) {
  const __m256i h = _mm256_maskz_loadu_epi16(lanes(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline void vstore(float* p, vf v, int n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
static inline void vstore(uint16_t* p, vf v, int n) {  // round to nearest even, NaN quiet (as c10)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtepi32_epi16(r));
}
constexpr int NC = 2;  // column vectors per expand block (8 rows x 2: 16 accumulators)
#else
using vf = __m256;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vset1(float v) { return _mm256_set1_ps(v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vload(const float* p, int n) {
  if (n >= 8) return _mm256_loadu_ps(p);
  alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(t, p, sizeof(float) * n);
  return _mm256_load_ps(t);
}
static inline vf vload(const uint16_t* p, int n) {
  __m128i h;
  if (n >= 8) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(t, p, sizeof(uint16_t) * n);
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(t));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline void vstore(float* p, vf v, int n) {
  if (n >= 8) return _mm256_storeu_ps(p, v);
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  std::memcpy(p, t, sizeof(float) * n);
}
static inline void vstore(uint16_t* p, vf v, int n) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int i = 0; i < std::min(n, 8); ++i) p[i] = f2bf(t[i]);
}
constexpr int NC = 1;
#endif

static inline float to_f(float v) { return v; }
static inline float to_f(uint16_t v) { return bf2f(v); }
static inline float same_prec(float v, const float*) { return v; }
static inline float same_prec(float v, const uint16_t*) { return bf2f(f2bf(v)); }

// y[rows[t], col : col + NB*LK_W (the last vector: n_last lanes)] += h[t, r0:r1] @ B[r0:r1, col...]
template <int NT, int NB, typename TW, typename TY>
static inline void expand_block(const float* h, int64_t R, const TW* B, int64_t ldb, int64_t r0, int64_t r1,
                                TY* const* yrow, int64_t col, int n_last) {
  vf acc[NT][NB];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < NB; ++j) acc[t][j] = vzero();
  for (int64_t r = r0; r < r1; ++r) {
    const TW* br = B + r * ldb + col;
    vf w[NB];
    for (int j = 0; j < NB; ++j) w[j] = vload(br + j * LK_W, j == NB - 1 ? n_last : LK_W);
    for (int t = 0; t < NT; ++t) {
      const vf hb = vset1(h[t * R + r]);
      for (int j = 0; j < NB; ++j) acc[t][j] = vfma(hb, w[j], acc[t][j]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    TY* yp = yrow[t] + col;
    for (int j = 0; j < NB; ++j) {
      const int n = j == NB - 1 ? n_last : LK_W;
      vstore(yp + j * LK_W, vadd(vload(yp + j * LK_W, n), acc[t][j]), n);
    }
  }
}

template <int NT, typename TW, typename TY>
static void lora_tile(const LoraArgs<TW, TY>& g, int64_t slot, const int64_t* rows, float* xf, float* h) {
  const int64_t K = g.in, R = g.R, N = g.out;
  // gather and widen the tile's activation rows
  for (int t = 0; t < NT; ++t) {
    const TW* xr = g.x + rows[t] * g.sx;
    float* d = xf + t * K;
    int64_t k = 0;
    for (; k + LK_W <= K; k += LK_W) vstore(d + k, vload(xr + k, LK_W), LK_W);
    for (; k < K; ++k) d[k] = to_f(xr[k]);
  }
  // shrink: h[t, :] = x[t, :] @ A   (A [K, R] row-major)
  const TW* A = g.a + slot * K * R;
  for (int64_t c = 0; c < R; c += LK_W) {
    const int n = (int)std::min<int64_t>(LK_W, R - c);
    vf acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = vzero();
    for (int64_t k = 0; k < K; ++k) {
      const vf w = vload(A + k * R + c, n);
      for (int t = 0; t < NT; ++t) acc[t] = vfma(vset1(xf[t * K + k]), w, acc[t]);
    }
    alignas(64) float tmp[LK_W];
    for (int t = 0; t < NT; ++t) {
      vstore(tmp, acc[t], LK_W);
      for (int i = 0; i < n; ++i) h[t * R + c + i] = same_prec(tmp[i], g.a);
    }
  }
  // expand, part by part: y[:, cols of p] += h[:, rank rows of p] @ B
  const TW* B = g.b + slot * R * N;
  TY* yrow[NT];
  for (int t = 0; t < NT; ++t) yrow[t] = g.y + rows[t] * g.sy;
  for (int64_t p = 0; p < g.parts; ++p) {
    const int64_t r0 = g.parts == 1 ? 0 : p * g.rank, r1 = g.parts == 1 ? R : std::min(R, r0 + g.rank);
    const int64_t c0 = g.cols[p], c1 = g.cols[p + 1];
    int64_t col = c0;
    for (; col + NC * LK_W <= c1; col += NC * LK_W) expand_block<NT, NC>(h, R, B, N, r0, r1, yrow, col, LK_W);
    for (; col < c1; col += LK_W)
      expand_block<NT, 1>(h, R, B, N, r0, r1, yrow, col, (int)std::min<int64_t>(LK_W, c1 - col));
  }
}

template <typename TW, typename TY>
static void lora_tiles(const LoraArgs<TW, TY>& g, const int64_t* tiles, int64_t t0, int64_t t1) {
  std::vector<float> xf(8 * g.in), h(8 * g.R);
  for (int64_t i = t0; i < t1; ++i) {
    const int64_t slot = tiles[3 * i], lo = tiles[3 * i + 1], nt = tiles[3 * i + 2];
    const int64_t* rows = g.rows + lo;
    switch (nt) {
      case 1: lora_tile<1>(g, slot, rows, xf.data(), h.data()); break;
      case 2: lora_tile<2>(g, slot, rows, xf.data(), h.data()); break;
      case 3: lora_tile<3>(g, slot, rows, xf.data(), h.data()); break;
      case 4: lora_tile<4>(g, slot, rows, xf.data(), h.data()); break;
      case 5: lora_tile<5>(g, slot, rows, xf.data(), h.data()); break;
      case 6: lora_tile<6>(g, slot, rows, xf.data(), h.data()); break;
      case 7: lora_tile<7>(g, slot, rows, xf.data(), h.data()); break;
      default: lora_tile<8>(g, slot, rows, xf.data(), h.data()); break;
    }
  }
}

#if LK_BF16
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
#endif  // LK_BF16
