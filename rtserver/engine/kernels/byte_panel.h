// Big steps on AVX2 byte dots (no VNNI): y = x @ W.T, 32 weight rows at a time, against activations
// rounded to 8 bits (engine.activation_bits = 8).
//
// A float32 GEMM on Zen 3 does 16 multiply-adds a cycle on its two FMA pipes. vpmaddubsw does 32
// byte products an instruction, summed in pairs to int16. So the quants go to bytes as the file holds
// them (unsigned where none is negative; else signed, and their signs moved onto the activations with
// vpsignb), four k of a column to a 32-bit lane. Pair sums add up in int16 while no sum can overflow
// (kMaxQ bounds them), then vpmaddwd against ones widens them to int32. A scale group's int32 sums
// take d * s_b in float, and its min the sum of the rounded activations: the result is a float32
// matmul of the activations as fixed_point_reference rounds them at 8 bits (byte_dots.h), as a small
// step's is.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "byte_dots.h"
#include "panel.h"
#include "pool.h"

namespace byte_panel {

using byte_dots::Rows;

constexpr int64_t kCols = 32;   // weight rows per panel: two halves of 16 columns
constexpr int64_t kHalf = 16;   // columns a register block covers: two vectors of 8 int32 lanes
constexpr int64_t kRows = 4;    // activation rows per register block
constexpr int64_t kDepth = 256;  // k per pass over the rows: the panel's 8 KB of it stay in L1

// A panel: 32 weight rows' quants as bytes ([32, K], as unpacked), then four k of a column to a lane
// ([2][K / 4][16][4]: half h holds columns 16h..), and per scale group of G weights their D and M.
struct Panel {
  panel::Buffer<int8_t> bytes, quads;
  std::vector<float> D, M;  // [K / G, 32]

  Panel(int64_t K, int64_t G) : bytes(kCols * K), quads(kCols * K), D(K / G * kCols), M(K / G * kCols) {}

  // Before unpacking a panel of fewer than 32 columns: the missing ones are zero.
  void clear() {
    std::fill(bytes.begin(), bytes.end(), int8_t{0});
    std::fill(D.begin(), D.end(), 0.f), std::fill(M.begin(), M.end(), 0.f);
  }
  // Quads are moved as 32-bit floats: transposes move bits, they never round them.
  void to_quads(int64_t K) {
    for (int64_t h = 0; h < 2; ++h)
      panel::transpose_panel(reinterpret_cast<const float*>(bytes.data() + kHalf * h * K), K / 4,
                             reinterpret_cast<float*>(quads.data() + h * K * kHalf));
  }
};

// Quads of k per int16 sum: the most pair sums of |q| <= MaxQ and |v| <= 127 that int16 holds, within a
// scale group.
constexpr int sum_quads(int G, int MaxQ) {
  const int fit = 32767 / (2 * 127 * MaxQ);
  return std::max(1, std::min(G / 4, fit));
}

// One quad of k for four rows against one half of a panel: s[r][h] += the pair sums of row r's four
// activations (x, rows K apart) and the 16 columns' quads w. In assembly because GCC's allocation of
// the 8 sums, the weights and the epilogue's floats spilled sums to the stack inside this loop.
#define BYTE_PANEL_ROW(x, s0, s1)                                                                \
  "vpbroadcastd " x ", %[b]\n\t"                                                                \
  "vpsignb %[w0], %[b], %[p]\n\t vpmaddubsw %[p], %[a0], %[p]\n\t vpaddw %[p], " s0 ", " s0 "\n\t" \
  "vpsignb %[w1], %[b], %[b]\n\t vpmaddubsw %[b], %[a1], %[b]\n\t vpaddw %[b], " s1 ", " s1 "\n\t"
#define BYTE_PANEL_UROW(x, s0, s1)                                                                \
  "vpbroadcastd " x ", %[b]\n\t"                                                                \
  "vpmaddubsw %[b], %[a0], %[p]\n\t vpaddw %[p], " s0 ", " s0 "\n\t"                             \
  "vpmaddubsw %[b], %[a1], %[b]\n\t vpaddw %[b], " s1 ", " s1 "\n\t"
#define BYTE_PANEL_ROWS(ROW)                                                                      \
  ROW("%[x0]", "%[s00]", "%[s01]") ROW("%[x1]", "%[s10]", "%[s11]") ROW("%[x2]", "%[s20]", "%[s21]") \
      ROW("%[x3]", "%[s30]", "%[s31]")
#define BYTE_PANEL_SUMS                                                                           \
  [s00] "+x"(s[0][0]), [s01] "+x"(s[0][1]), [s10] "+x"(s[1][0]), [s11] "+x"(s[1][1]), [s20] "+x"(s[2][0]), \
      [s21] "+x"(s[2][1]), [s30] "+x"(s[3][0]), [s31] "+x"(s[3][1])
// Memory operands: the compiler then knows what each statement reads.
#define BYTE_PANEL_READS                                                                          \
  [q0] "m"(q[0]), [q1] "m"(q[1]), [x0] "m"(*reinterpret_cast<const int32_t*>(x)),                  \
      [x1] "m"(*reinterpret_cast<const int32_t*>(x + K)), [x2] "m"(*reinterpret_cast<const int32_t*>(x + 2 * K)), \
      [x3] "m"(*reinterpret_cast<const int32_t*>(x + 3 * K))

template <bool Signed>
inline void quad4(__m256i (&s)[4][2], const int8_t* w, const int8_t* x, int64_t K) {
  const __m256i* q = reinterpret_cast<const __m256i*>(w);
  __m256i a0, a1, b, p;
  if constexpr (Signed) {
    __m256i w0, w1;
    __asm__("vmovdqu %[q0], %[w0]\n\t vmovdqu %[q1], %[w1]\n\t vpabsb %[w0], %[a0]\n\t vpabsb %[w1], %[a1]\n\t"
            BYTE_PANEL_ROWS(BYTE_PANEL_ROW)
            : BYTE_PANEL_SUMS, [w0] "=&x"(w0), [w1] "=&x"(w1), [a0] "=&x"(a0), [a1] "=&x"(a1), [b] "=&x"(b),
              [p] "=&x"(p)
            : BYTE_PANEL_READS);
  } else {
    __asm__("vmovdqu %[q0], %[a0]\n\t vmovdqu %[q1], %[a1]\n\t" BYTE_PANEL_ROWS(BYTE_PANEL_UROW)
            : BYTE_PANEL_SUMS, [a0] "=&x"(a0), [a1] "=&x"(a1), [b] "=&x"(b), [p] "=&x"(p)
            : BYTE_PANEL_READS);
  }
}
#undef BYTE_PANEL_ROW
#undef BYTE_PANEL_UROW
#undef BYTE_PANEL_ROWS
#undef BYTE_PANEL_SUMS
#undef BYTE_PANEL_READS

// out[r, 0:16] (rows kCols apart) for R rows against one half of a panel (16 columns), scale groups
// g0 .. g1: set from the first groups, added to after.
template <int R, int G, int MaxQ, bool Signed, bool Offset>
inline void tile(const Rows& x, int64_t r0, int64_t K, const int8_t* quads, const float* d, const float* m,
                 int64_t g0, int64_t g1, float* out) {
  constexpr int L = sum_quads(G, MaxQ);
  const int64_t nb = K / 32, groups = K / G;
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float acc[R][kHalf];
  for (int r = 0; r < R; ++r) {
    const __m256 zero = _mm256_setzero_ps();
    _mm256_store_ps(acc[r], g0 > 0 ? _mm256_loadu_ps(out + r * kCols) : zero);
    _mm256_store_ps(acc[r] + 8, g0 > 0 ? _mm256_loadu_ps(out + r * kCols + 8) : zero);
  }
  for (int64_t g = g0; g < g1; ++g) {
    __m256i t[R][2];
    for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm256_setzero_si256();
    for (int c = 0; c < G / 4; c += L) {
      __m256i s[R][2];
      for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int k = c; k < c + L; ++k) {
        const int64_t kq = g * (G / 4) + k;
        if constexpr (R == 4) {
          quad4<Signed>(s, quads + kq * 64, x.v.data() + r0 * K + 4 * kq, K);
          continue;
        }
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quads + kq * 64));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quads + kq * 64 + 32));
        const __m256i a0 = Signed ? _mm256_abs_epi8(w0) : w0, a1 = Signed ? _mm256_abs_epi8(w1) : w1;
        for (int r = 0; r < R; ++r) {
          int32_t quad;
          std::memcpy(&quad, x.v.data() + (r0 + r) * K + 4 * kq, 4);
          const __m256i b = _mm256_set1_epi32(quad);
          const __m256i p0 = _mm256_maddubs_epi16(a0, Signed ? _mm256_sign_epi8(b, w0) : b);
          const __m256i p1 = _mm256_maddubs_epi16(a1, Signed ? _mm256_sign_epi8(b, w1) : b);
          s[r][0] = _mm256_add_epi16(s[r][0], p0);
          s[r][1] = _mm256_add_epi16(s[r][1], p1);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) t[r][h] = _mm256_add_epi32(t[r][h], _mm256_madd_epi16(s[r][h], ones));
    }
    const __m256 d0 = _mm256_loadu_ps(d + g * kCols), d1 = _mm256_loadu_ps(d + g * kCols + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 sc = _mm256_set1_ps(x.scale[(r0 + r) * nb + g * G / 32]);
      __m256 a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r][0]), _mm256_mul_ps(d0, sc), _mm256_load_ps(acc[r]));
      __m256 a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r][1]), _mm256_mul_ps(d1, sc), _mm256_load_ps(acc[r] + 8));
      if (Offset) {
        const float* sums = G == 16 ? x.xsum16.data() : x.xsum32.data();
        const __m256 xs = _mm256_set1_ps(sums[(r0 + r) * groups + g]);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(m + g * kCols), xs, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(m + g * kCols + 8), xs, a1);
      }
      _mm256_store_ps(acc[r], a0), _mm256_store_ps(acc[r] + 8, a1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kCols, _mm256_load_ps(acc[r]));
    _mm256_storeu_ps(out + r * kCols + 8, _mm256_load_ps(acc[r] + 8));
  }
}

// The register block for rows r .. r + kRows (or the rows left), half h of panel p.
template <int G, int MaxQ, bool Signed, bool Offset>
inline void rows_tile(const Rows& x, int64_t r, int64_t M, int64_t K, const Panel& p, int64_t h, int64_t g0,
                      int64_t g1, float* out) {
  const int8_t* q = p.quads.data() + h * K * kHalf;
  const float *d = p.D.data() + h * kHalf, *m = p.M.data() + h * kHalf;
  switch (std::min(kRows, M - r)) {
    case 1: return tile<1, G, MaxQ, Signed, Offset>(x, r, K, q, d, m, g0, g1, out);
    case 2: return tile<2, G, MaxQ, Signed, Offset>(x, r, K, q, d, m, g0, g1, out);
    case 3: return tile<3, G, MaxQ, Signed, Offset>(x, r, K, q, d, m, g0, g1, out);
    default: return tile<kRows, G, MaxQ, Signed, Offset>(x, r, K, q, d, m, g0, g1, out);
  }
}

// y [M, N] (rows ldy apart) = x @ W.T: unpack(n0, cols, panel) writes W's rows n0 .. n0 + cols as
// bytes into panel.bytes and their scale groups' D and M (all three zero past cols). A panel's sums
// build up in a scratch of [M, 32] and go to y once: y's rows, a whole row of N apart, share a few
// cache sets, and a many-row step evicted them between the passes over k.
template <int G, int MaxQ, bool Signed, bool Offset, typename Unpack>
void matmul(const Rows& x, int64_t M, int64_t K, int64_t N, float* y, int64_t ldy, const Unpack& unpack) {
  const int64_t panels = (N + kCols - 1) / kCols;
  pool::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    Panel p(K, G);
    panel::Buffer<float> out(M * kCols);
    for (int64_t i = p0; i < p1; ++i) {
      const int64_t n0 = i * kCols, cols = std::min(kCols, N - n0);
      if (cols < kCols) p.clear();
      unpack(n0, cols, p);
      p.to_quads(K);
      for (int64_t g0 = 0; g0 < K / G; g0 += kDepth / G) {
        const int64_t g1 = std::min(K / G, g0 + kDepth / G);
        for (int64_t r = 0; r < M; r += kRows)
          for (int64_t h = 0; h < 2; ++h)
            rows_tile<G, MaxQ, Signed, Offset>(x, r, M, K, p, h, g0, g1, out.data() + r * kCols + h * kHalf);
      }
      for (int64_t r = 0; r < M; ++r) std::memcpy(y + r * ldy + n0, out.data() + r * kCols, cols * sizeof(float));
    }
  });
}

}  // namespace byte_panel
