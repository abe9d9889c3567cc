// AVX2 byte dots (no VNNI) at 8-bit activations (engine.activation_bits = 8): the activations' rounding,
// and the small steps' pass over each weight row's chunks of 32 (the K-quants' own passes, at either
// width, are kquant_avx2.h's). byte_panel.h runs the big steps.
//
// Each chunk's quants stay bytes as the blocks hold them (unsigned where none is negative; else signed,
// their signs moved onto the activations with vpsignb) and meet the activation bytes in vpmaddubsw;
// vpmaddwd against ones sums them to int32 lanes, four weights a lane, so lanes 0-3 hold the first 16
// weights and 4-7 the rest: each half takes its own D. A group's min meets the sum of the rounded
// activations, so every step, small or big, is a float32 matmul of the activations as
// fixed_point_reference rounds them at 8 bits, whatever its rows.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "panel.h"
#include "pool.h"

namespace byte_dots {

// Activations as 8-bit integers, one scale per 32 (as llama.cpp's Q8_0 rows): x_j ~= scale_b * v_j.
struct Rows {
  panel::Buffer<int8_t> v;      // [M, K]
  panel::Buffer<float> scale;   // [M, K / 32] max|x_b| / 127
  panel::Buffer<float> xsum16;  // [M, K / 16] sums of 16 rounded activations: the offsets' term
  panel::Buffer<float> xsum32;  // [M, K / 32] sums of 32
};

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline int hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// Each block of 32: v_j = round(x_j * (127 / max|x|)) (cvtps rounds to nearest even, as torch.round).
inline void to_bytes(const float* x, int64_t M, int64_t K, Rows& f) {
  const int64_t nb = K / 32;
  f.v.resize(M * K), f.scale.resize(M * nb), f.xsum16.resize(M * nb * 2), f.xsum32.resize(M * nb);
  pool::parallel_for(0, M * nb, 64, [&](int64_t i0, int64_t i1) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    for (int64_t i = i0; i < i1; ++i) {
      const float* xb = x + i * 32;
      __m256 a[4];
      for (int j = 0; j < 4; ++j) a[j] = _mm256_loadu_ps(xb + 8 * j);
      const __m256 m01 = _mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1]));
      const __m256 m23 = _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3]));
      const float amax = hmax8(_mm256_max_ps(m01, m23));
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i q[4];
      for (int j = 0; j < 4; ++j)
        q[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(a[j], inv)), top), bottom);
      // packs interleave 128-bit lanes: the permute puts the 32 bytes back in order
      const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(f.v.data() + i * 32),
                          _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      // the offsets meet the rounded activations too: with the exact sums, a block's error would be
      // sum_j D q_j (v_j s - x_j), which quants far from zero (Q4_1, Q5_0's) do not cancel
      const float scale = amax / 127.f;
      const int lo = hsum8i(_mm256_add_epi32(q[0], q[1])), hi = hsum8i(_mm256_add_epi32(q[2], q[3]));
      f.scale[i] = scale;
      f.xsum16[2 * i] = scale * static_cast<float>(lo), f.xsum16[2 * i + 1] = scale * static_cast<float>(hi);
      f.xsum32[i] = scale * static_cast<float>(lo + hi);
    }
  });
}

// One chunk of a weight row: 32 quants, and each half's D and M.
struct Chunk {
  __m256i q;
  float d0, d1, m0, m1;
};

// y[r0 + r, n] (rows ldy apart) for R rows and output columns [n0, n1). column(n, visit) calls
// visit(c, chunk) for each chunk c of weight row n, in order.
template <int R, bool Signed, bool Offset, typename Column>
void pass(const Rows& x, int64_t r0, int64_t K, int64_t ldy, int64_t n0, int64_t n1, const Column& column, float* y) {
  const int64_t nc = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R];
    float off[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), off[r] = 0.f;
    column(n, [&](int64_t c, const Chunk& k) {
      const __m256 d = _mm256_setr_ps(k.d0, k.d0, k.d0, k.d0, k.d1, k.d1, k.d1, k.d1);
      const __m256i a = Signed ? _mm256_abs_epi8(k.q) : k.q;
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.v.data() + row * K + c * 32));
        const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(a, Signed ? _mm256_sign_epi8(v, k.q) : v), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, _mm256_set1_ps(x.scale[row * nc + c])), acc[r]);
        if (Offset) off[r] += k.m0 * x.xsum16[row * 2 * nc + 2 * c] + k.m1 * x.xsum16[row * 2 * nc + 2 * c + 1];
      }
    });
    for (int r = 0; r < R; ++r) y[r * ldy + n] = hsum8(acc[r]) + off[r];
  }
}

}  // namespace byte_dots
