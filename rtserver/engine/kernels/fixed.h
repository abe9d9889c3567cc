// Activations in fixed point for the integer dots (VNNI), 16 or 8 bits of each block, and the dot itself.
//
// Every integer path (fixed_pass, the K-quant decode passes, the panels) takes its activations from
// here, so all of them round as `fixed_point_reference` in quant.py does.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "int_panel.h"
#include "pool.h"

#define RTSERVER_INT_DOTS 1

namespace {

// Integer dot products (VNNI): each activation block of 32 becomes 16-bit fixed point,
// x_j ~= s_b * (256 hi_j + lo_j) with s_b = max|x_b| / 32512, and its two 8-bit limbs meet the 4/8-bit
// quants in vpdpbusd (64 multiply-adds an instruction, exact in int32) instead of unpacking every quant
// to float. The only new rounding is the activations' to 16 bits of their block's largest value
// (relative 1.5e-5; float16 storage would be 4.9e-4); `fixed_point_reference` in quant.py is the same
// arithmetic in torch. Q4_1 and Q5_1S quants (0..15, 0..31) are the unsigned operand and the limbs
// signed (hi, lo in [-128, 127]); Q8_0 quants are signed, so there the limbs carry +32768 as unsigned
// bytes and 32768 * sum(q_b) (one more vpdpbusd against ones) is taken off.
constexpr float kFixed = 32512.f;  // 127 * 256: the high limb of the largest value still fits int8
constexpr int64_t kFixedBlock = 32;  // activations one fixed-point scale covers

struct FixedRows {
  int_panel::Buffer<uint8_t> hi, lo;  // [M, K] the limbs (int8 bits, or uint8 with the offset)
  int_panel::Buffer<float> scale8;    // [M, nb, 8] s_b over the 8 int32 lanes a block's products land in
  int_panel::Buffer<float> xsum2;     // [M, nb, 2] (0, sum x_b): Q4_1's min term, against the block's (d, m)
  int_panel::Buffer<float> xsum16;    // [M, K / 16] the sums of 16: raw blocks' offsets M, one per 16 weights
  int_panel::Buffer<float> xsum32;    // [M, K / 32] the sums of 32: Q4_K's mins, one per 32 weights
};

// One block of 32 activations in fixed point: v_j = round(x_j / s) in [-32512, 32512] with
// s = max|x| / 32512 (cvtps rounds to nearest even, as nearbyint), and its two halves' sums.
// With 8-bit activations (engine.activation_bits) v_j = 256 round(x_j * 127 / max|x|): the same scale,
// so every path, small steps and panels alike, meets the same rounded values.
// The sums are exact at 16 bits and of the rounded values at 8: a block's min or offset then meets what
// its quants meet, and the rounding's error cancels as in a float matmul of the rounded activations.
// Every integer path's activations come from here, so all round as fixed_point_reference.
struct FixedBlock {
  __m512i v[2];
  float scale, sum[2];
};

inline FixedBlock fixed_block(const float* xb) {
  const bool bytes = int_panel::g_activation_bits == 8;
  const float top = bytes ? 127.f : kFixed;
  const __m512i limit = _mm512_set1_epi32(static_cast<int>(top));
  const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? top / amax : 0.f);
  FixedBlock f;
  f.scale = amax / kFixed;
  for (int h = 0; h < 2; ++h) {
    const __m512 xh = h == 0 ? a : b;
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(xh, inv));
    f.v[h] = _mm512_max_epi32(_mm512_min_epi32(v, limit), _mm512_sub_epi32(_mm512_setzero_si512(), limit));
    if (bytes) f.v[h] = _mm512_slli_epi32(f.v[h], 8);
    f.sum[h] = bytes ? f.scale * static_cast<float>(_mm512_reduce_add_epi32(f.v[h])) : _mm512_reduce_add_ps(xh);
  }
  return f;
}

// Activation rows to fixed point as two 8-bit limbs a value, for vpdpbusd against 4/8-bit quants.
void to_fixed(const float* x, int64_t M, int64_t K, bool offset, FixedRows& f) {
  const int64_t nb = K / kFixedBlock;
  f.hi.resize(M * K), f.lo.resize(M * K), f.scale8.resize(M * nb * 8), f.xsum2.resize(M * nb * 2);
  f.xsum16.resize(M * K / 16), f.xsum32.resize(M * nb);
  const __m512i bias = _mm512_set1_epi32(offset ? 32768 : 128);
  for (int64_t i = 0; i < M * nb; ++i) {
    const FixedBlock fb = fixed_block(x + i * kFixedBlock);
    f.xsum16[i * 2] = fb.sum[0], f.xsum16[i * 2 + 1] = fb.sum[1];
    for (int h = 0; h < 2; ++h) {
      // offset: v + 32768 = 256 hi + lo, both unsigned; else hi = floor((v + 128) / 256), lo = v - 256 hi
      const __m512i v = fb.v[h];
      const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(v, bias), 8);
      const __m512i lo = offset ? _mm512_and_si512(_mm512_add_epi32(v, bias), _mm512_set1_epi32(255))
                                : _mm512_sub_epi32(v, _mm512_slli_epi32(hi, 8));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(f.hi.data() + i * kFixedBlock + 16 * h), _mm512_cvtepi32_epi8(hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(f.lo.data() + i * kFixedBlock + 16 * h), _mm512_cvtepi32_epi8(lo));
    }
    std::fill_n(f.scale8.data() + i * 8, 8, fb.scale);
    f.xsum2[i * 2] = 0.f, f.xsum2[i * 2 + 1] = f.xsum32[i] = fb.sum[0] + fb.sum[1];
  }
}

// Activation rows to fixed point as int16, for the integer panels.
void to_int16(const float* x, int64_t M, int64_t K, int_panel::Rows& f) {
  const int64_t nb = K / kFixedBlock;
  f.v.resize(M * K), f.scale.resize(M * nb), f.xsum16.resize(M * nb * 2), f.xsum32.resize(M * nb);
  pool::parallel_for(0, M * nb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const FixedBlock fb = fixed_block(x + i * kFixedBlock);
      for (int h = 0; h < 2; ++h)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(f.v.data() + i * kFixedBlock + 16 * h), _mm512_cvtepi32_epi16(fb.v[h]));
      f.scale[i] = fb.scale, f.xsum16[i * 2] = fb.sum[0], f.xsum16[i * 2 + 1] = fb.sum[1];
      f.xsum32[i] = fb.sum[0] + fb.sum[1];
    }
  });
}

// Activation rows as 8-bit integers for the panels' 8-bit path: fixed_block's values over 256, their
// scale times 256 (exact: 32512 = 127 * 256).
void to_int8(const float* x, int64_t M, int64_t K, int_panel::Rows8& f) {
  const int64_t nb = K / kFixedBlock;
  f.v.resize(M * K), f.scale.resize(M * nb), f.qsum16.resize(M * nb * 2), f.xsum16.resize(M * nb * 2);
  f.xsum32.resize(M * nb);
  pool::parallel_for(0, M * nb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const FixedBlock fb = fixed_block(x + i * kFixedBlock);
      for (int h = 0; h < 2; ++h) {
        const __m512i q = _mm512_srai_epi32(fb.v[h], 8);  // |q| <= 127
        _mm_storeu_si128(reinterpret_cast<__m128i*>(f.v.data() + i * kFixedBlock + 16 * h), _mm512_cvtepi32_epi8(q));
        f.qsum16[i * 2 + h] = _mm512_reduce_add_epi32(q);
      }
      f.scale[i] = fb.scale * 256.f;
      f.xsum16[i * 2] = fb.sum[0], f.xsum16[i * 2 + 1] = fb.sum[1];
      f.xsum32[i] = fb.sum[0] + fb.sum[1];
    }
  });
}

// 256 hi.q + lo.q per int32 lane (4 products each) for 64 quants w (the unsigned or the signed operand).
inline __m512i fixed_dot(__m512i w, const uint8_t* hi, const uint8_t* lo, bool w_unsigned) {
  const __m512i h = _mm512_loadu_si512(hi), l = _mm512_loadu_si512(lo);
  __m512i t = w_unsigned ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, h)
                         : _mm512_dpbusd_epi32(_mm512_setzero_si512(), h, w);
  t = _mm512_slli_epi32(t, 8);
  return w_unsigned ? _mm512_dpbusd_epi32(t, w, l) : _mm512_dpbusd_epi32(t, l, w);
}
inline __m256i fixed_dot(__m256i w, const uint8_t* hi, const uint8_t* lo, bool w_unsigned) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi));
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
  __m256i t = w_unsigned ? _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, h)
                         : _mm256_dpbusd_epi32(_mm256_setzero_si256(), h, w);
  t = _mm256_slli_epi32(t, 8);
  return w_unsigned ? _mm256_dpbusd_epi32(t, w, l) : _mm256_dpbusd_epi32(t, l, w);
}

}  // namespace
