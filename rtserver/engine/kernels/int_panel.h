// Big steps on integer dots (VNNI): y = x @ W.T, 32 weight rows at a time, against the activations
// in 16-bit fixed point or rounded to 8 bits (g_activation_bits, engine.activation_bits).
//
// Each task unpacks a panel of 32 rows of W with each scale group's D and M as floats. For 16 bits the
// quants go to int16, pairs of k interleaved (16 columns of two quants in one vector), into vpdpwssd:
// 32 products an instruction. For 8 bits they go to bytes + 128, four k of a column to a lane, into
// vpdpbusd: 64 products an instruction, the +128 taken off as 128 times the activations' sum. A weight
// whose panels were kept unpacked at load (`keep`) skips the unpacking: 16-bit pairs are kept as int8
// and widened as the register block loads them. Both are exact in int32 within a scale group. A
// group's sums take d * s_b in float, and its min the activations' sum (fixed_block's), as fixed_pass
// does. The activations round as every integer path's (fixed_block), so a row's result does not depend
// on the step's size beyond float32 summation order.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "panel.h"
#include "pool.h"

namespace int_panel {

constexpr int64_t kCols = 32;  // weight rows per panel: two vectors of 16 int32 lanes
constexpr int64_t kRows = 6;   // activation rows per register block
constexpr int64_t kDepth = 256;  // k per pass over the rows: the panel's 16 KB of it stay in L1
constexpr int64_t kRowBlockBytes = 256 << 10;  // a block of rows' int16 activations, held in L2

using panel::Buffer;
using panel::g_activation_bits;

// The activations as the integer paths round them: x_j ~= scale_b * v_j, v_j in [-32512, 32512].
struct Rows {
  Buffer<int16_t> v;      // [M, K]
  Buffer<float> scale;    // [M, K / 32] s_b
  Buffer<float> xsum16;   // [M, K / 16] sums of 16 activations (fixed_block's): the offsets' term
  Buffer<float> xsum32;   // [M, K / 32] sums of 32
};

// Activations as 8-bit integers, one scale per 32 (as llama.cpp's Q8_0 rows): x_j ~= scale_b * v_j,
// v_j in [-127, 127].
struct Rows8 {
  Buffer<int8_t> v;        // [M, K]
  Buffer<float> scale;     // [M, K / 32] s_b
  Buffer<int32_t> qsum16;  // [M, K / 16] sums of v per 16: the weights' +128 bias comes off with them
  Buffer<float> xsum16;    // [M, K / 16] sums of 16 activations (fixed_block's): the offsets' term
  Buffer<float> xsum32;    // [M, K / 32] sums of 32
};

// A panel: its quants, pairs of k interleaved ([2][K / 2][16] int32: half h holds columns 16h..),
// and per scale group of G weights the 32 columns' D and M (d, m: its own, or a kept panel's).
struct Panel {
  std::vector<int16_t> rows;  // [32, K] the quants as unpacked, before interleaving
  std::vector<int32_t> pairs;
  std::vector<uint8_t> bytes;  // 8-bit activations: [32, K] the quants + 128, before interleaving
  std::vector<uint8_t> quads;  // 8-bit activations: [2][K / 4][16][4] the quants + 128, four k a lane
  std::vector<float> D, M;    // [K / G, 32]
  const float *d, *m;
  const int8_t* kept = nullptr;  // a kept panel's pairs, read in place of `pairs`

  // `unpacks`: whether this panel's weights are unpacked here (else kept panels are read, no buffers).
  Panel(int64_t K, int64_t G, bool unpacks = true)
      : rows(unpacks ? kCols * K : 0), pairs(unpacks && g_activation_bits == 16 ? kCols * K / 2 : 0),
        bytes(unpacks && g_activation_bits == 8 ? kCols * K : 0), quads(bytes.size()), D(unpacks ? K / G * kCols : 0),
        M(unpacks ? K / G * kCols : 0), d(D.data()), m(M.data()) {}

  // Before unpacking a panel of fewer than 32 columns: the missing ones are zero.
  void clear() {
    std::fill(rows.begin(), rows.end(), int16_t{0});
    std::fill(bytes.begin(), bytes.end(), uint8_t{0x80});
    std::fill(D.begin(), D.end(), 0.f), std::fill(M.begin(), M.end(), 0.f);
  }
  // Pairs of int16 (or quads of biased bytes) are moved as 32-bit floats: transposes move bits, they
  // never round them.
  void interleave(int64_t K) {
    if (g_activation_bits == 8) return to_quads(K);
    for (int64_t h = 0; h < 2; ++h)
      panel::transpose_panel(reinterpret_cast<const float*>(rows.data() + 16 * h * K), K / 2,
                             reinterpret_cast<float*>(pairs.data() + h * (K / 2) * 16));
  }
  // The quants as bytes + 128 (every quant fits int8), then four k of a column to a 32-bit lane.
  void to_quads(int64_t K) {
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int64_t i = 0; i < kCols * K; i += 32)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bytes.data() + i),
                          _mm256_xor_si256(_mm512_cvtepi16_epi8(_mm512_loadu_si512(rows.data() + i)), bias));
    bytes_to_quads(K);
  }
  // `bytes` (written whole) to quads.
  void bytes_to_quads(int64_t K) {
    for (int64_t h = 0; h < 2; ++h)
      panel::transpose_panel(reinterpret_cast<const float*>(bytes.data() + 16 * h * K), K / 4,
                             reinterpret_cast<float*>(quads.data() + h * K * 16));
  }
  // A panel kept unpacked (`keep`): the pairs as int8 (32 K bytes; every quant fits a byte), then D,
  // then M where the type has offsets, all read in place.
  static int64_t kept_bytes(int64_t K, int64_t G, bool offset) { return 32 * K + (offset ? 2 : 1) * K / G * kCols * 4; }
  void use_kept(const int8_t* from, int64_t K, int64_t G) {
    kept = from;
    d = reinterpret_cast<const float*>(kept + 32 * K), m = d + K / G * kCols;
  }
  // This panel as `use_kept` reads it, written to `to` (kept_bytes): the pairs as int8, or the quads.
  void narrow(int8_t* to, int64_t K, bool offset) const {
    if (g_activation_bits == 8)
      std::memcpy(to, quads.data(), quads.size());
    else
      for (int64_t i = 0; i < K; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 32 * i), _mm512_cvtepi16_epi8(_mm512_loadu_si512(pairs.data() + 16 * i)));
    std::memcpy(to + 32 * K, D.data(), D.size() * 4);
    if (offset) std::memcpy(to + 32 * K + D.size() * 4, M.data(), M.size() * 4);
  }
};

// A register block's sums: zero for its first scale groups, else y's rows so far.
template <int R>
inline void load_rows(__m512 (&acc)[R][2], const float* y, int64_t ldy, __mmask16 first, __mmask16 second, bool zero) {
  for (int r = 0; r < R; ++r)
    acc[r][0] = zero ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(first, y + r * ldy),
    acc[r][1] = zero ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(second, y + r * ldy + 16);
}

template <int R>
inline void store_rows(const __m512 (&acc)[R][2], float* y, int64_t ldy, __mmask16 first, __mmask16 second) {
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, first, acc[r][0]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, second, acc[r][1]);
  }
}

// Scale group g's offsets: each column's M times the sum of the row's activations in the group.
template <int R, int G, typename RowsT>
inline void add_mins(const RowsT& x, int64_t r0, int64_t groups, const Panel& p, int64_t g, __m512 (&acc)[R][2]) {
  const __m512 m0 = _mm512_loadu_ps(p.m + g * kCols), m1 = _mm512_loadu_ps(p.m + g * kCols + 16);
  const float* sums = G == 16 ? x.xsum16.data() : x.xsum32.data();
  for (int r = 0; r < R; ++r) {
    const __m512 xs = _mm512_set1_ps(sums[(r0 + r) * groups + g]);
    acc[r][0] = _mm512_fmadd_ps(m0, xs, acc[r][0]);
    acc[r][1] = _mm512_fmadd_ps(m1, xs, acc[r][1]);
  }
}

// y[r, 0:cols] (rows ldy apart) for R rows of activations against a panel's scale groups g0 .. g1 of
// G weights: set from the first groups, added to after.
template <int R, int G, bool Offset, bool Kept>
inline void tile(const Rows& x, int64_t r0, int64_t K, const Panel& p, int64_t g0, int64_t g1, float* y,
                 int64_t ldy, int64_t cols) {
  const int64_t nb = K / 32, groups = K / G;
  const __mmask16 first = cols >= 16 ? 0xFFFF : (1u << cols) - 1;
  const __mmask16 second = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  const int16_t* v[R];
  for (int r = 0; r < R; ++r) v[r] = x.v.data() + (r0 + r) * K + g0 * G;
  const int32_t* w0 = p.pairs.data() + g0 * (G / 2) * 16;
  const int32_t* w1 = w0 + K / 2 * 16;
  const int8_t* k0 = Kept ? p.kept + g0 * (G / 2) * 32 : nullptr;
  const int8_t* k1 = Kept ? k0 + K / 2 * 32 : nullptr;
  __m512 acc[R][2];
  load_rows<R>(acc, y, ldy, first, second, g0 == 0);
  for (int64_t g = g0; g < g1; ++g) {
    __m512i t[R][2];
    for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int k = 0; k < G / 2; ++k) {
      const __m512i a0 = Kept ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0 + k * 32)))
                              : _mm512_loadu_si512(w0 + k * 16);
      const __m512i a1 = Kept ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k1 + k * 32)))
                              : _mm512_loadu_si512(w1 + k * 16);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, v[r] + 2 * k, 4);
        const __m512i b = _mm512_set1_epi32(pair);
        t[r][0] = _mm512_dpwssd_epi32(t[r][0], b, a0);
        t[r][1] = _mm512_dpwssd_epi32(t[r][1], b, a1);
      }
    }
    w0 += G / 2 * 16, w1 += G / 2 * 16;
    if (Kept) k0 += G / 2 * 32, k1 += G / 2 * 32;
    for (int r = 0; r < R; ++r) v[r] += G;
    const __m512 d0 = _mm512_loadu_ps(p.d + g * kCols), d1 = _mm512_loadu_ps(p.d + g * kCols + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(x.scale[(r0 + r) * nb + g * G / 32]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r][0]), _mm512_mul_ps(d0, s), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r][1]), _mm512_mul_ps(d1, s), acc[r][1]);
    }
    if (Offset) add_mins<R, G>(x, r0, groups, p, g, acc);
  }
  store_rows<R>(acc, y, ldy, first, second);
}

// The register block for rows r .. r + 6 (or the rows left).
template <int G, bool Offset, bool Kept>
inline void rows_tile(const Rows& x, int64_t r, int64_t M, int64_t K, const Panel& p, int64_t g0, int64_t g1,
                      float* o, int64_t ldy, int64_t cols) {
  switch (std::min(kRows, M - r)) {
    case 1: return tile<1, G, Offset, Kept>(x, r, K, p, g0, g1, o, ldy, cols);
    case 2: return tile<2, G, Offset, Kept>(x, r, K, p, g0, g1, o, ldy, cols);
    case 3: return tile<3, G, Offset, Kept>(x, r, K, p, g0, g1, o, ldy, cols);
    case 4: return tile<4, G, Offset, Kept>(x, r, K, p, g0, g1, o, ldy, cols);
    case 5: return tile<5, G, Offset, Kept>(x, r, K, p, g0, g1, o, ldy, cols);
    default: return tile<6, G, Offset, Kept>(x, r, K, p, g0, g1, o, ldy, cols);
  }
}

// tile's 8-bit twin: four k a vpdpbusd, the panel's quads (kept, or unpacked here) against the rows'
// bytes. The quads carry +128, taken off as 128 times the group's activation sum.
template <int R, int G, bool Offset>
inline void tile8(const Rows8& x, int64_t r0, int64_t K, const uint8_t* quads, const Panel& p, int64_t g0,
                  int64_t g1, float* y, int64_t ldy, int64_t cols) {
  const int64_t nb = K / 32, groups = K / G, n16 = K / 16;
  const __mmask16 first = cols >= 16 ? 0xFFFF : (1u << cols) - 1;
  const __mmask16 second = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  const int8_t* v[R];
  for (int r = 0; r < R; ++r) v[r] = x.v.data() + (r0 + r) * K + g0 * G;
  const uint8_t* w0 = quads + g0 * G * 16;
  const uint8_t* w1 = w0 + K * 16;
  __m512 acc[R][2];
  load_rows<R>(acc, y, ldy, first, second, g0 == 0);
  for (int64_t g = g0; g < g1; ++g) {
    __m512i t[R][2];
    for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int k = 0; k < G / 4; ++k) {
      const __m512i a0 = _mm512_loadu_si512(w0 + k * 64), a1 = _mm512_loadu_si512(w1 + k * 64);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, v[r] + 4 * k, 4);
        const __m512i b = _mm512_set1_epi32(quad);
        t[r][0] = _mm512_dpbusd_epi32(t[r][0], a0, b);
        t[r][1] = _mm512_dpbusd_epi32(t[r][1], a1, b);
      }
    }
    w0 += G * 16, w1 += G * 16;
    for (int r = 0; r < R; ++r) v[r] += G;
    const __m512 d0 = _mm512_loadu_ps(p.d + g * kCols), d1 = _mm512_loadu_ps(p.d + g * kCols + 16);
    for (int r = 0; r < R; ++r) {
      const int32_t* qs = x.qsum16.data() + (r0 + r) * n16 + g * G / 16;
      const __m512i bias = _mm512_set1_epi32(128 * (G == 16 ? qs[0] : qs[0] + qs[1]));
      const __m512 s = _mm512_set1_ps(x.scale[(r0 + r) * nb + g * G / 32]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(t[r][0], bias)), _mm512_mul_ps(d0, s), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(t[r][1], bias)), _mm512_mul_ps(d1, s), acc[r][1]);
    }
    if (Offset) add_mins<R, G>(x, r0, groups, p, g, acc);
  }
  store_rows<R>(acc, y, ldy, first, second);
}

template <int G, bool Offset>
inline void rows_tile8(const Rows8& x, int64_t r, int64_t M, int64_t K, const Panel& p, int64_t g0, int64_t g1,
                       float* o, int64_t ldy, int64_t cols) {
  const uint8_t* q = p.kept ? reinterpret_cast<const uint8_t*>(p.kept) : p.quads.data();
  switch (std::min(kRows, M - r)) {
    case 1: return tile8<1, G, Offset>(x, r, K, q, p, g0, g1, o, ldy, cols);
    case 2: return tile8<2, G, Offset>(x, r, K, q, p, g0, g1, o, ldy, cols);
    case 3: return tile8<3, G, Offset>(x, r, K, q, p, g0, g1, o, ldy, cols);
    case 4: return tile8<4, G, Offset>(x, r, K, q, p, g0, g1, o, ldy, cols);
    case 5: return tile8<5, G, Offset>(x, r, K, q, p, g0, g1, o, ldy, cols);
    default: return tile8<6, G, Offset>(x, r, K, q, p, g0, g1, o, ldy, cols);
  }
}

// y [M, N] (rows ldy apart) = x @ W.T, reading the weight's kept panels (`keep`), or where `kept` is
// nullptr unpacking them: unpack(n0, cols, panel) writes W's rows n0 .. n0 + cols into panel.pairs
// and their scale groups' D and M (panel.rows and the three are zero past cols).
template <int G, bool Offset, typename RowsT, typename Unpack>
void matmul(const RowsT& x, int64_t M, int64_t K, int64_t N, float* y, int64_t ldy, const int8_t* kept,
            const Unpack& unpack) {
  constexpr bool kBytes8 = std::is_same_v<RowsT, Rows8>;
  const int64_t panels = (N + kCols - 1) / kCols, kept_bytes = Panel::kept_bytes(K, G, Offset);
  // Kept panels are cheap to read again, so the rows go in blocks whose activations stay in L2 while
  // every panel passes; an unpacked panel meets all rows before the next is unpacked.
  const int64_t row_bytes = kBytes8 ? K : 2 * K;
  const int64_t block = kept == nullptr ? M : std::max(kRows, kRowBlockBytes / row_bytes / kRows * kRows);
  pool::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    Panel p(K, G, kept == nullptr);
    for (int64_t b0 = 0; b0 < M; b0 += block) {
      const int64_t b1 = std::min(M, b0 + block);
      for (int64_t i = p0; i < p1; ++i) {
        const int64_t n0 = i * kCols, cols = std::min(kCols, N - n0);
        if (kept != nullptr) {
          p.use_kept(kept + i * kept_bytes, K, G);
        } else {
          if (cols < kCols) p.clear();
          unpack(n0, cols, p);
        }
        float* out = y + n0;
        for (int64_t g0 = 0; g0 < K / G; g0 += kDepth / G) {
          const int64_t g1 = std::min(K / G, g0 + kDepth / G);
          // Few rows read a kept panel once, at memory speed: the next panel's share of these groups
          // is fetched while this one's are read.
          if (kept != nullptr && b1 - b0 <= kRows && i + 1 < p1) {
            const int8_t* next = kept + (i + 1) * kept_bytes;
            for (int64_t at = kept_bytes * g0 / (K / G); at < kept_bytes * g1 / (K / G); at += 64)
              _mm_prefetch(reinterpret_cast<const char*>(next + at), _MM_HINT_T1);
          }
          for (int64_t r = b0; r < b1; r += kRows) {
            float* o = out + r * ldy;
            if constexpr (kBytes8) rows_tile8<G, Offset>(x, r, b1, K, p, g0, g1, o, ldy, cols);
            else if (kept != nullptr) rows_tile<G, Offset, true>(x, r, b1, K, p, g0, g1, o, ldy, cols);
            else rows_tile<G, Offset, false>(x, r, b1, K, p, g0, g1, o, ldy, cols);
          }
        }
      }
    }
  });
}

// Every panel of a weight unpacked once (Panel::narrow's layout), panel after panel.
template <int G, bool Offset, typename Unpack>
void keep(int64_t K, int64_t N, int8_t* kept, const Unpack& unpack) {
  const int64_t panels = (N + kCols - 1) / kCols, bytes = Panel::kept_bytes(K, G, Offset);
  pool::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    Panel p(K, G);
    for (int64_t i = p0; i < p1; ++i) {
      const int64_t n0 = i * kCols, cols = std::min(kCols, N - n0);
      if (cols < kCols) p.clear();
      unpack(n0, cols, p);
      p.narrow(kept + i * bytes, K, Offset);
    }
  });
}

}  // namespace int_panel
