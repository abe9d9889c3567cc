// Big steps on integer dots (VNNI): y = x @ W.T with the weight's quants as int16 beside the
// activations' 16-bit fixed point, 32 weight rows at a time.
//
// Each task unpacks a panel of 32 rows of W to int16 quants, pairs of k interleaved (16 columns of
// two quants in one vector), with each scale group's D and M as floats. Every row block then meets it
// in vpdpwssd: 32 products an instruction where a float32 FMA gives 16, exact in int32 within a scale
// group. A group's sums take d * s_b in float, and its min the exact activation sum, as fixed_pass
// does. The activations round as every integer path's (fixed_block), so a row's result does not
// depend on the step's size beyond float32 summation order.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panel.h"

namespace int_panel {

constexpr int64_t kCols = 32;  // weight rows per panel: two vectors of 16 int32 lanes
constexpr int64_t kRows = 6;   // activation rows per register block
constexpr int64_t kDepth = 256;  // k per pass over the rows: the panel's 16 KB of it stay in L1

// The activations as the integer paths round them: x_j ~= scale_b * v_j, v_j in [-32512, 32512].
struct Rows {
  std::vector<int16_t> v;      // [M, K]
  std::vector<float> scale;    // [M, K / 32] s_b
  std::vector<float> xsum16;   // [M, K / 16] exact sums of 16 activations: the offsets' term
  std::vector<float> xsum32;   // [M, K / 32] exact sums of 32
};

// A panel: its quants, pairs of k interleaved ([2][K / 2][16] int32: half h holds columns 16h..),
// and per scale group of G weights the 32 columns' D and M.
struct Panel {
  std::vector<int16_t> rows;  // [32, K] the quants as unpacked, before interleaving
  std::vector<int32_t> pairs;
  std::vector<float> D, M;    // [K / G, 32]

  explicit Panel(int64_t K, int64_t G) : rows(kCols * K), pairs(kCols * K / 2), D(K / G * kCols), M(K / G * kCols) {}

  // Pairs of int16 are moved as 32-bit floats: transposes move bits, they never round them.
  void interleave(int64_t K) {
    for (int64_t h = 0; h < 2; ++h)
      panel::transpose_panel(reinterpret_cast<const float*>(rows.data() + 16 * h * K), K / 2,
                             reinterpret_cast<float*>(pairs.data() + h * (K / 2) * 16));
  }
};

// y[r, 0:cols] (rows ldy apart) for R rows of activations against a panel's scale groups g0 .. g1 of
// G weights: set from the first groups, added to after.
template <int R, int G, bool Offset>
inline void tile(const Rows& x, int64_t r0, int64_t K, const Panel& p, int64_t g0, int64_t g1, float* y,
                 int64_t ldy, int64_t cols) {
  const int64_t nb = K / 32, groups = K / G;
  const __mmask16 first = cols >= 16 ? 0xFFFF : (1u << cols) - 1;
  const __mmask16 second = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  const int16_t* v[R];
  for (int r = 0; r < R; ++r) v[r] = x.v.data() + (r0 + r) * K + g0 * G;
  const int32_t* w0 = p.pairs.data() + g0 * (G / 2) * 16;
  const int32_t* w1 = w0 + K / 2 * 16;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r)
    acc[r][0] = g0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(first, y + r * ldy),
    acc[r][1] = g0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(second, y + r * ldy + 16);
  for (int64_t g = g0; g < g1; ++g) {
    __m512i t[R][2];
    for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int k = 0; k < G / 2; ++k) {
      const __m512i a0 = _mm512_loadu_si512(w0 + k * 16), a1 = _mm512_loadu_si512(w1 + k * 16);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, v[r] + 2 * k, 4);
        const __m512i b = _mm512_set1_epi32(pair);
        t[r][0] = _mm512_dpwssd_epi32(t[r][0], b, a0);
        t[r][1] = _mm512_dpwssd_epi32(t[r][1], b, a1);
      }
    }
    w0 += G / 2 * 16, w1 += G / 2 * 16;
    for (int r = 0; r < R; ++r) v[r] += G;
    const __m512 d0 = _mm512_loadu_ps(p.D.data() + g * kCols), d1 = _mm512_loadu_ps(p.D.data() + g * kCols + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(x.scale[(r0 + r) * nb + g * G / 32]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r][0]), _mm512_mul_ps(d0, s), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r][1]), _mm512_mul_ps(d1, s), acc[r][1]);
    }
    if (Offset) {
      const __m512 m0 = _mm512_loadu_ps(p.M.data() + g * kCols), m1 = _mm512_loadu_ps(p.M.data() + g * kCols + 16);
      const float* sums = G == 16 ? x.xsum16.data() : x.xsum32.data();
      for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_set1_ps(sums[(r0 + r) * groups + g]);
        acc[r][0] = _mm512_fmadd_ps(m0, xs, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(m1, xs, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, first, acc[r][0]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, second, acc[r][1]);
  }
}

// y [M, N] (rows ldy apart) = x @ W.T, where unpack(n0, cols, panel) writes W's rows n0 .. n0 + cols
// into panel.rows (int16 quants) and their scale groups' D and M (zero past cols is the caller's).
template <int G, bool Offset, typename Unpack>
void matmul(const Rows& x, int64_t M, int64_t K, int64_t N, float* y, int64_t ldy, const Unpack& unpack) {
  const int64_t panels = (N + kCols - 1) / kCols;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    Panel p(K, G);
    for (int64_t i = p0; i < p1; ++i) {
      const int64_t n0 = i * kCols, cols = std::min(kCols, N - n0);
      if (cols < kCols) {
        std::fill(p.rows.begin(), p.rows.end(), int16_t{0});
        std::fill(p.D.begin(), p.D.end(), 0.f), std::fill(p.M.begin(), p.M.end(), 0.f);
      }
      unpack(n0, cols, p);
      p.interleave(K);
      float* out = y + n0;
      for (int64_t g0 = 0; g0 < K / G; g0 += kDepth / G) {
        const int64_t g1 = std::min(K / G, g0 + kDepth / G);
        for (int64_t r = 0; r < M; r += kRows) {
          float* o = out + r * ldy;
          switch (std::min(kRows, M - r)) {
            case 1: tile<1, G, Offset>(x, r, K, p, g0, g1, o, ldy, cols); break;
            case 2: tile<2, G, Offset>(x, r, K, p, g0, g1, o, ldy, cols); break;
            case 3: tile<3, G, Offset>(x, r, K, p, g0, g1, o, ldy, cols); break;
            case 4: tile<4, G, Offset>(x, r, K, p, g0, g1, o, ldy, cols); break;
            case 5: tile<5, G, Offset>(x, r, K, p, g0, g1, o, ldy, cols); break;
            default: tile<6, G, Offset>(x, r, K, p, g0, g1, o, ldy, cols); break;
          }
        }
      }
    }
  });
}

}  // namespace int_panel
