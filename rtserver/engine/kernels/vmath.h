// Vector arithmetic the layer's row-wise work shares: dot products of float rows, and Sleef's expf and
// tanhf behind the softmax and the activations.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// a . b over n floats as 16 running lane sums added up in a fixed tree at the end: the compiler
// vectorizes it without -ffast-math, while a single running sum is a chain it may not reorder.
inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {  // head sizes are: one register of lane sums, one reduction
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) acc[i % 16] += a[i] * b[i];
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// Sleef's vectorised expf and tanhf (u10: within 1 ulp), exported by libtorch_cpu: what torch's own
// softmax and tanh-approximated GELU use.
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);
extern "C" __m512 Sleef_tanhf16_u10(__m512);
constexpr int64_t kLanes = 16;
#elif defined(__AVX2__)
extern "C" __m256 Sleef_expf8_u10avx2(__m256);
extern "C" __m256 Sleef_tanhf8_u10avx2(__m256);
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 1;
#endif

// p[0, n) <- exp(p - max p), returning their sum; n is a whole number of kLanes (pad with -inf).
// A scalar expf per score was a third of a 32-row step's attention.
inline float exp_shifted(float* p, int64_t n) {
#if defined(__AVX512F__)
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(p + i));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(p + i), m));
    _mm512_storeu_ps(p + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
#elif defined(__AVX2__)
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(p + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, mx);
  const __m256 m = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 e = Sleef_expf8_u10avx2(_mm256_sub_ps(_mm256_loadu_ps(p + i), m));
    _mm256_storeu_ps(p + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  _mm256_storeu_ps(lanes, sum);
  float total = 0.f;
  for (float v : lanes) total += v;
  return total;
#else
  const float m = *std::max_element(p, p + n);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += (p[i] = std::exp(p[i] - m));
  return sum;
#endif
}

}  // namespace
