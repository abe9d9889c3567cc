// Big steps on quantized weights without a float copy of them: y = x @ W.T, 16 weight rows at a time.
//
// The activations are first packed 6 rows to a block, k-major. Each task then dequantizes a panel of
// 16 rows of W into a small float32 scratch, transposes it (16 values per k) and runs every row block
// against it: 6 x 16 accumulators, two vector loads and six broadcasts per k. A weight is dequantized
// once per step, so many-row steps cost about what a float32 GEMM costs. Every output is one FMA chain
// over k from zero, whatever the path, so the result does not depend on the row count.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "pool.h"

namespace panel {

constexpr int64_t kCols = 16;  // weight rows per panel: two 8-float vectors
constexpr int64_t kRows = 6;   // activation rows per register block

// The activations' width every integer path rounds to (engine.activation_bits): 16 or 8. On VNNI
// (int_panel.h) 16 is Rows, k pairs, and 8 Rows8, k quads; panels made once keep the layout of the
// width they were made under. On AVX2 alone 8 takes big steps to byte dots (byte_panel.h), 16 to floats.
inline int g_activation_bits = 16;

// An allocator whose resize leaves new elements uninitialised, for buffers written whole before they
// are read: zeroing a prompt's activations first cost a big step a visible share.
template <typename T>
struct Uninit : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = Uninit<U>;
  };
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
template <typename T>
using Buffer = std::vector<T, Uninit<T>>;

// xp [ceil(M / 6)][K][6]: row block b holds rows 6b .. 6b + 5, zero past M.
inline std::vector<float> pack_rows(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = (M + kRows - 1) / kRows;
  std::vector<float> xp(blocks * K * kRows);
  pool::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* out = xp.data() + b * K * kRows;
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t row = b * kRows + r;
        if (row >= M) {
          for (int64_t k = 0; k < K; ++k) out[k * kRows + r] = 0.f;
          continue;
        }
        const float* src = x + row * K;
        for (int64_t k = 0; k < K; ++k) out[k * kRows + r] = src[k];
      }
    }
  });
  return xp;
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight rows of 8 floats (rows `ld` apart) written transposed: out[k * kCols + c] = in[c * ld + k].
inline void transpose8(const float* in, int64_t ld, float* out) {
  __m256 r0 = _mm256_loadu_ps(in), r1 = _mm256_loadu_ps(in + ld), r2 = _mm256_loadu_ps(in + 2 * ld),
         r3 = _mm256_loadu_ps(in + 3 * ld), r4 = _mm256_loadu_ps(in + 4 * ld), r5 = _mm256_loadu_ps(in + 5 * ld),
         r6 = _mm256_loadu_ps(in + 6 * ld), r7 = _mm256_loadu_ps(in + 7 * ld);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
               t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
               t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE),
               s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE),
               s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE),
               s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(out + 0 * kCols, _mm256_permute2f128_ps(s0, s4, 0x20));
  _mm256_storeu_ps(out + 1 * kCols, _mm256_permute2f128_ps(s1, s5, 0x20));
  _mm256_storeu_ps(out + 2 * kCols, _mm256_permute2f128_ps(s2, s6, 0x20));
  _mm256_storeu_ps(out + 3 * kCols, _mm256_permute2f128_ps(s3, s7, 0x20));
  _mm256_storeu_ps(out + 4 * kCols, _mm256_permute2f128_ps(s0, s4, 0x31));
  _mm256_storeu_ps(out + 5 * kCols, _mm256_permute2f128_ps(s1, s5, 0x31));
  _mm256_storeu_ps(out + 6 * kCols, _mm256_permute2f128_ps(s2, s6, 0x31));
  _mm256_storeu_ps(out + 7 * kCols, _mm256_permute2f128_ps(s3, s7, 0x31));
}

// Pt [K][16] from rows [16][K] (K a multiple of 8).
inline void transpose_panel(const float* rows, int64_t K, float* Pt) {
  for (int64_t k = 0; k < K; k += 8) {
    transpose8(rows + k, K, Pt + k * kCols);
    transpose8(rows + 8 * K + k, K, Pt + k * kCols + 8);
  }
}

// y[r, 0:cols] (rows ldy apart) = xp-block . Pt for r < rows. Named accumulators: an array of them
// would be kept on the stack by the compiler and stored on every k.
inline void block(const float* xp, int64_t K, const float* Pt, float* y, int64_t ldy, int64_t cols, int64_t rows) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
         c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 a = _mm256_loadu_ps(Pt + k * kCols), b = _mm256_loadu_ps(Pt + k * kCols + 8);
    const float* xk = xp + k * kRows;
    __m256 v = _mm256_broadcast_ss(xk);
    c00 = _mm256_fmadd_ps(v, a, c00), c01 = _mm256_fmadd_ps(v, b, c01);
    v = _mm256_broadcast_ss(xk + 1);
    c10 = _mm256_fmadd_ps(v, a, c10), c11 = _mm256_fmadd_ps(v, b, c11);
    v = _mm256_broadcast_ss(xk + 2);
    c20 = _mm256_fmadd_ps(v, a, c20), c21 = _mm256_fmadd_ps(v, b, c21);
    v = _mm256_broadcast_ss(xk + 3);
    c30 = _mm256_fmadd_ps(v, a, c30), c31 = _mm256_fmadd_ps(v, b, c31);
    v = _mm256_broadcast_ss(xk + 4);
    c40 = _mm256_fmadd_ps(v, a, c40), c41 = _mm256_fmadd_ps(v, b, c41);
    v = _mm256_broadcast_ss(xk + 5);
    c50 = _mm256_fmadd_ps(v, a, c50), c51 = _mm256_fmadd_ps(v, b, c51);
  }
  alignas(32) float out[kRows][kCols];
  _mm256_store_ps(out[0], c00), _mm256_store_ps(out[0] + 8, c01);
  _mm256_store_ps(out[1], c10), _mm256_store_ps(out[1] + 8, c11);
  _mm256_store_ps(out[2], c20), _mm256_store_ps(out[2] + 8, c21);
  _mm256_store_ps(out[3], c30), _mm256_store_ps(out[3] + 8, c31);
  _mm256_store_ps(out[4], c40), _mm256_store_ps(out[4] + 8, c41);
  _mm256_store_ps(out[5], c50), _mm256_store_ps(out[5] + 8, c51);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(y + r * ldy, out[r], cols * sizeof(float));
}
#else
inline void transpose_panel(const float* rows, int64_t K, float* Pt) {
  for (int64_t c = 0; c < kCols; ++c)
    for (int64_t k = 0; k < K; ++k) Pt[k * kCols + c] = rows[c * K + k];
}

inline void block(const float* xp, int64_t K, const float* Pt, float* y, int64_t ldy, int64_t cols, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kCols] = {};
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < kCols; ++c) acc[c] += xp[k * kRows + r] * Pt[k * kCols + c];
    std::memcpy(y + r * ldy, acc, cols * sizeof(float));
  }
}
#endif

// y [M, N] (rows ldy apart) = x [M, K] @ W.T, where dequantize(n0, rows, out) writes W's float32 rows
// n0 .. n0 + rows into out [rows, K]. K is a multiple of 8.
template <typename Dequantize>
void matmul(const float* x, int64_t M, int64_t K, int64_t N, float* y, int64_t ldy, const Dequantize& dequantize) {
  const std::vector<float> xp = pack_rows(x, M, K);
  const int64_t panels = (N + kCols - 1) / kCols;
  pool::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> rows(kCols * K), Pt(kCols * K);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kCols, cols = std::min(kCols, N - n0);
      dequantize(n0, cols, rows.data());
      std::fill(rows.begin() + cols * K, rows.end(), 0.f);
      transpose_panel(rows.data(), K, Pt.data());
      for (int64_t r = 0; r < M; r += kRows)
        block(xp.data() + r * K, K, Pt.data(), y + r * ldy + n0, ldy, cols, std::min(kRows, M - r));
    }
  });
}

}  // namespace panel
