// Big steps on quantized weights without a float copy of them: y = x @ W.T, 16 weight rows at a time.
//
// Each task dequantizes a panel of 16 rows of W into a small float32 scratch (transposed: 16 values
// per k), then runs a register-blocked GEMM of every activation row against it: 6 rows x 16 columns of
// accumulators, two vector loads and six broadcasts per k. A weight is dequantized once per step, not
// once per 4 rows as on the small-step path, so many-row steps cost about what a float32 GEMM costs.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace panel {

constexpr int64_t kCols = 16;  // weight rows per panel: two 8-float vectors
constexpr int64_t kRows = 6;   // activation rows per register block

// y[r, 0:cols] (rows ldy apart) = x[r, :] . Pt[:, c] for r < R: Pt is [K][16], zero past `cols`.
template <int R>
inline void block(const float* x, int64_t K, const float* Pt, float* y, int64_t ldy, int64_t cols) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 a = _mm256_loadu_ps(Pt + k * kCols), b = _mm256_loadu_ps(Pt + k * kCols + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 v = _mm256_broadcast_ss(x + r * K + k);
      lo[r] = _mm256_fmadd_ps(v, a, lo[r]);
      hi[r] = _mm256_fmadd_ps(v, b, hi[r]);
    }
  }
  alignas(32) float out[kCols];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(out, lo[r]);
    _mm256_store_ps(out + 8, hi[r]);
    std::memcpy(y + r * ldy, out, cols * sizeof(float));
  }
#else
  for (int r = 0; r < R; ++r) {
    float acc[kCols] = {};
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < kCols; ++c) acc[c] += x[r * K + k] * Pt[k * kCols + c];
    std::memcpy(y + r * ldy, acc, cols * sizeof(float));
  }
#endif
}

// y [M, N] (rows ldy apart) = x [M, K] @ W.T, where dequantize(n0, rows, out) writes W's float32 rows
// n0 .. n0 + rows into out [rows, K].
template <typename Dequantize>
void matmul(const float* x, int64_t M, int64_t K, int64_t N, float* y, int64_t ldy, const Dequantize& dequantize) {
  const int64_t panels = (N + kCols - 1) / kCols;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> rows(kCols * K), Pt(kCols * K);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kCols, cols = std::min(kCols, N - n0);
      dequantize(n0, cols, rows.data());
      for (int64_t c = 0; c < kCols; ++c)
        for (int64_t k = 0; k < K; ++k) Pt[k * kCols + c] = c < cols ? rows[c * K + k] : 0.f;
      int64_t r = 0;
      for (; r + kRows <= M; r += kRows) block<kRows>(x + r * K, K, Pt.data(), y + r * ldy + n0, ldy, cols);
      switch (M - r) {
        case 1: block<1>(x + r * K, K, Pt.data(), y + r * ldy + n0, ldy, cols); break;
        case 2: block<2>(x + r * K, K, Pt.data(), y + r * ldy + n0, ldy, cols); break;
        case 3: block<3>(x + r * K, K, Pt.data(), y + r * ldy + n0, ldy, cols); break;
        case 4: block<4>(x + r * K, K, Pt.data(), y + r * ldy + n0, ldy, cols); break;
        case 5: block<5>(x + r * K, K, Pt.data(), y + r * ldy + n0, ldy, cols); break;
        default: break;
      }
    }
  });
}

}  // namespace panel
