// The fused LoRA shrink + expand, written once over the vector primitives of the ISA being
// compiled (lora_vec_avx2.h or lora_vec_avx512.h, included first: vf, VW floats a vector,
// vzero / vset1 / vfma / vadd, vload / vstore with a lane count, NC). Included by
// lora_kernels.cpp inside each ISA's namespace and target region. No include guard on purpose.
//
// One tile = up to 8 token rows of one adapter segment. Per tile: the rows are gathered and
// widened to float once, h = x @ A (rank R, float accumulators; rounded to the weights' dtype,
// as PyTorch's bf16 product rounds it), then, per part of a fused layer, y[:, part's columns]
// += h[:, part's rank rows] @ B[part's rows, part's columns], accumulated in float and added to
// y in place (one rounding to y's dtype). B's zero blocks (other parts) are never read.

static inline float to_f(float v) { return v; }
static inline float to_f(uint16_t v) { return bf2f(v); }
static inline float same_prec(float v, const float*) { return v; }
static inline float same_prec(float v, const uint16_t*) { return bf2f(f2bf(v)); }

// y[rows[t], col : col + NB*VW (the last vector: n_last lanes)] += h[t, r0:r1] @ B[r0:r1, col...]
template <int NT, int NB, typename TW, typename TY>
static inline void expand_block(const float* h, int64_t R, const TW* B, int64_t ldb, int64_t r0, int64_t r1,
                                TY* const* yrow, int64_t col, int n_last) {
  vf acc[NT][NB];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < NB; ++j) acc[t][j] = vzero();
  for (int64_t r = r0; r < r1; ++r) {
    const TW* br = B + r * ldb + col;
    vf w[NB];
    for (int j = 0; j < NB; ++j) w[j] = vload(br + j * VW, j == NB - 1 ? n_last : VW);
    for (int t = 0; t < NT; ++t) {
      const vf hb = vset1(h[t * R + r]);
      for (int j = 0; j < NB; ++j) acc[t][j] = vfma(hb, w[j], acc[t][j]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    TY* yp = yrow[t] + col;
    for (int j = 0; j < NB; ++j) {
      const int n = j == NB - 1 ? n_last : VW;
      vstore(yp + j * VW, vadd(vload(yp + j * VW, n), acc[t][j]), n);
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
    for (; k + VW <= K; k += VW) vstore(d + k, vload(xr + k, VW), VW);
    for (; k < K; ++k) d[k] = to_f(xr[k]);
  }
  // shrink: h[t, :] = x[t, :] @ A   (A [K, R] row-major)
  const TW* A = g.a + slot * K * R;
  for (int64_t c = 0; c < R; c += VW) {
    const int n = (int)std::min<int64_t>(VW, R - c);
    vf acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = vzero();
    for (int64_t k = 0; k < K; ++k) {
      const vf w = vload(A + k * R + c, n);
      for (int t = 0; t < NT; ++t) acc[t] = vfma(vset1(xf[t * K + k]), w, acc[t]);
    }
    alignas(64) float tmp[VW];
    for (int t = 0; t < NT; ++t) {
      vstore(tmp, acc[t], VW);
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
    for (; col + NC * VW <= c1; col += NC * VW) expand_block<NT, NC>(h, R, B, N, r0, r1, yrow, col, VW);
    for (; col < c1; col += VW)
      expand_block<NT, 1>(h, R, B, N, r0, r1, yrow, col, (int)std::min<int64_t>(VW, c1 - col));
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
