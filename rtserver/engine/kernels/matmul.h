// Weight-only quantized matmuls over llama.cpp's block formats, float32 activations and results.
//
// A weight keeps the blocks it ships in (a third to a half of float16's bytes) and is multiplied block
// by block: batch-1 decoding streams every weight once per step, so fewer bytes and fewer instructions
// per weight are what make a step faster. The block's scale and min are applied to the block's partial
// sums (y = sum_b d_b (q_b . x_b) + m_b sum(x_b)). With VNNI the partial sums are integer dot products
// of the quants with 16-bit fixed-point activations (RTSERVER_INT_DOTS below); without, each block is
// unpacked to float in registers. Both equal a float32 matmul of the dequantized weights up to rounding.
//
// Two layouts. The split one (Q4_1, Q8_0, Q5_1S: the tuned path above, integer dots on VNNI):
// Q4_1: per block of 32 weights: `qs` 16 bytes, byte j holds weight j (low nibble) and j + 16 (high);
//       `dm` two float16: weight = d * q + m.
// Q8_0: per block of 32 weights: `qs` 32 int8, `d` one float16: weight = d * q.
// Q5_1S: Q4_1's nibbles, then (after the row's last block) each block's 32-bit mask of fifth bits
//        (bit j: weight j's 16), `dm` two float16: weight = d * q + m with q in 0..31 (Q5_1, Q5_0).
// Raw rows (every other type: Q4_0, Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS): the file's bytes, one
// row of blocks per output column; blocks.h decodes them, and raw_pass dequantizes 32 weights at a
// time in registers with gguf-py's float32 arithmetic. On VNNI, steps of one or two rows take the
// decoded quants to integer dots instead: Q4_K and Q6_K in passes of their own (kquant_dots.h), the
// others through raw_fixed_pass. On AVX2 alone, Q4_K, Q5_K and Q6_K take every small step on int16
// dots (kquant_avx2.h).
// A linear is a list of parts (format, a, b) over the same input, outputs side by side: a stacked
// q/k/v or gate/up whose tensors ship in different types runs part by part. Steps of many rows run
// on panels of weight rows, every format alike: int_panel.h on VNNI (panels kept unpacked at load
// where `unpack_panels` ran), byte_panel.h on AVX2 alone at 8-bit activations, else panel.h in float32.
//
// Built at first start with -march=native for the CPU at hand (the cache key names the CPU). Loops run
// on the kernel's own threads (pool.h), not on torch's.
#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "blocks.h"
#include "panel.h"
#include "pool.h"
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "fixed.h"
#include "kquant_dots.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "byte_dots.h"
#include "byte_panel.h"
#include "kquant_avx2.h"
#define RTSERVER_AVX2_DOTS 1
#define RTSERVER_BYTE_DOTS 1
#endif

namespace {

constexpr int64_t kBlock = 32;

// The split layout's formats: how a block stores its quants, and whether it has a min.
enum class Split { Q4_1, Q8_0, Q5_1S };
constexpr bool has_min(Split f) { return f != Split::Q8_0; }
// The largest |q| (blocks.h's kMaxQ): Q8_0's quants are signed, and a file may hold -128.
constexpr int max_quant(Split f) { return f == Split::Q8_0 ? 128 : f == Split::Q5_1S ? 31 : 15; }
constexpr bool has_nibbles(Split f) { return f != Split::Q8_0; }
constexpr int64_t quant_bytes(Split f) { return f == Split::Q8_0 ? 32 : 16; }
constexpr int64_t mask_bytes(Split f) { return f == Split::Q5_1S ? 4 : 0; }

#if defined(__F16C__)
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
#endif

// Field i of a split weight's float16 scales as a float.
template <Split F>
inline float scale_field(const void* S, int64_t i) {
  return half_to_float(static_cast<const uint16_t*>(S)[i]);
}

// Per instruction set: `Vec`, a block's quants unpacked to float vectors (q4_unpack: the nibbles,
// q8_unpack: the int8s), and their dot product with 32 activations left unreduced (lanes summed at the
// end of a row). The block's scale multiplies that vector once, and Q4_1's min multiplies the block's
// activation sum (precomputed): y = sum_b d_b (q_b . x_b) + m_b sum(x_b).
#if defined(__AVX512F__)
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vfma(Vec a, float s, Vec c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(s), c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
constexpr int kParts = 2;  // vectors per block
inline void q4_unpack(const uint8_t* qs, Vec* w) {
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  w[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  w[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
inline void q8_unpack(const uint8_t* qs, Vec* w) {
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * i))));
}
// Q5_1S: the nibbles as q4_unpack's, plus 16 where the mask has the weight's bit.
inline void q5_unpack(const uint8_t* qs, const uint8_t* qh, Vec* w) {
  uint32_t m;
  std::memcpy(&m, qh, 4);
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m512i sixteen = _mm512_set1_epi32(16);
  const __m512i lo = _mm512_and_si512(b, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(b, 4);
  w[0] = _mm512_cvtepi32_ps(_mm512_mask_add_epi32(lo, static_cast<__mmask16>(m), lo, sixteen));
  w[1] = _mm512_cvtepi32_ps(_mm512_mask_add_epi32(hi, static_cast<__mmask16>(m >> 16), hi, sixteen));
}
// o = w * d (+ m): a product then a sum, as QuantizedWeight.dequantize computes it.
template <bool Offset>
inline void scale_store(Vec w, float d, float m, float* o) {
  const Vec v = _mm512_mul_ps(w, _mm512_set1_ps(d));
  _mm512_storeu_ps(o, Offset ? _mm512_add_ps(v, _mm512_set1_ps(m)) : v);
}
inline Vec block_dot(const Vec* w, const float* x) {
  return _mm512_fmadd_ps(w[1], _mm512_loadu_ps(x + 16), _mm512_mul_ps(w[0], _mm512_loadu_ps(x)));
}
template <bool Offset>
inline void q8_dequant(const int8_t* q, const float* D, const float* M, Vec* w) {
  for (int i = 0; i < 2; ++i) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i))));
    w[i] = _mm512_mul_ps(f, _mm512_set1_ps(D[i]));
    if (Offset) w[i] = _mm512_add_ps(w[i], _mm512_set1_ps(M[i]));
  }
}
inline Vec dot_acc(const Vec* w, const float* x, Vec acc) {
  return _mm512_fmadd_ps(w[1], _mm512_loadu_ps(x + 16), _mm512_fmadd_ps(w[0], _mm512_loadu_ps(x), acc));
}
template <bool Offset>
inline void q8_dequant(__m256i q, const float* D, const float* M, Vec* w) {
  const __m128i half[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  for (int i = 0; i < 2; ++i) {
    w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(half[i])), _mm512_set1_ps(D[i]));
    if (Offset) w[i] = _mm512_add_ps(w[i], _mm512_set1_ps(M[i]));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vfma(Vec a, float s, Vec c) { return _mm256_fmadd_ps(a, _mm256_set1_ps(s), c); }
inline float vsum(Vec v) { return kquant::hsum8(v); }
constexpr int kParts = 4;  // vectors per block
inline void q4_unpack(const uint8_t* qs, Vec* w) {
  const __m256i mask = _mm256_set1_epi32(15);
  for (int i = 0; i < 2; ++i) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i)));
    w[i] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
    w[i + 2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
}
inline void q8_unpack(const uint8_t* qs, Vec* w) {
  for (int i = 0; i < 4; ++i)
    w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i))));
}
// Q5_1S: the nibbles (weights 0-15, then 16-31) with blocks.h's fifth bits, 8 weights a vector.
inline void q5_unpack(const uint8_t* qs, const uint8_t* qh, Vec* w) {
  const __m256i q = _mm256_or_si256(blocks::nibbles(qs), blocks::fifth_bits(qh));
  const __m128i half[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  for (int i = 0; i < 4; ++i)
    w[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(i % 2 ? _mm_srli_si128(half[i / 2], 8) : half[i / 2]));
}
template <bool Offset>
inline void scale_store(Vec w, float d, float m, float* o) {
  const Vec v = _mm256_mul_ps(w, _mm256_set1_ps(d));
  _mm256_storeu_ps(o, Offset ? _mm256_add_ps(v, _mm256_set1_ps(m)) : v);
}
inline Vec block_dot(const Vec* w, const float* x) {
  Vec t = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
  for (int i = 1; i < 4; ++i) t = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(x + 8 * i), t);
  return t;
}
template <bool Offset>
inline void q8_dequant(const int8_t* q, const float* D, const float* M, Vec* w) {
  for (int i = 0; i < 4; ++i) {
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))));
    w[i] = _mm256_mul_ps(f, _mm256_set1_ps(D[i / 2]));
    if (Offset) w[i] = _mm256_add_ps(w[i], _mm256_set1_ps(M[i / 2]));
  }
}
inline Vec dot_acc(const Vec* w, const float* x, Vec acc) {
  for (int i = 0; i < 4; ++i) acc = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(x + 8 * i), acc);
  return acc;
}
template <bool Offset>
inline void q8_dequant(__m256i q, const float* D, const float* M, Vec* w) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i eight[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int i = 0; i < 4; ++i) {
    w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight[i])), _mm256_set1_ps(D[i / 2]));
    if (Offset) w[i] = _mm256_add_ps(w[i], _mm256_set1_ps(M[i / 2]));
  }
}
#else
#define RTSERVER_SCALAR 1
struct Vec { float v; };
inline Vec vzero() { return {0.f}; }
inline Vec vfma(Vec a, float s, Vec c) { return {a.v * s + c.v}; }
inline float vsum(Vec v) { return v.v; }
constexpr int kParts = 32;  // one "vector" per weight
inline void q4_unpack(const uint8_t* qs, Vec* w) {
  for (int j = 0; j < 16; ++j) w[j].v = qs[j] & 15, w[j + 16].v = qs[j] >> 4;
}
inline void q8_unpack(const uint8_t* qs, Vec* w) {
  for (int j = 0; j < 32; ++j) w[j].v = static_cast<int8_t>(qs[j]);
}
inline void q5_unpack(const uint8_t* qs, const uint8_t* qh, Vec* w) {
  uint32_t m;
  std::memcpy(&m, qh, 4);
  for (int j = 0; j < 16; ++j) {
    w[j].v = (qs[j] & 15) | (((m >> j) & 1) << 4);
    w[j + 16].v = (qs[j] >> 4) | (((m >> (j + 16)) & 1) << 4);
  }
}
template <bool Offset>
inline void scale_store(Vec w, float d, float m, float* o) {
  *o = Offset ? w.v * d + m : w.v * d;
}
inline Vec block_dot(const Vec* w, const float* x) {
  float t = 0.f;
  for (int j = 0; j < 32; ++j) t += w[j].v * x[j];
  return {t};
}
template <bool Offset>
inline void q8_dequant(const int8_t* q, const float* D, const float* M, Vec* w) {
  for (int j = 0; j < 32; ++j) w[j].v = Offset ? static_cast<float>(q[j]) * D[j / 16] + M[j / 16] : static_cast<float>(q[j]) * D[j / 16];
}
inline Vec dot_acc(const Vec* w, const float* x, Vec acc) {
  for (int j = 0; j < 32; ++j) acc.v += w[j].v * x[j];
  return acc;
}
#endif

// A split block's quants as float vectors, in the order of its weights (qh: Q5_1S's mask).
template <Split F>
inline void split_unpack(const uint8_t* qs, const uint8_t* qh, Vec* w) {
  if (!has_nibbles(F))
    q8_unpack(qs, w);
  else if (mask_bytes(F))
    q5_unpack(qs, qh, w);
  else
    q4_unpack(qs, w);
}

// Where row n of a split weight starts, and its fifth-bit masks (Q5_1S) after its blocks' quants.
template <Split F>
inline const uint8_t* split_row(const uint8_t* Q, int64_t n, int64_t nb) {
  return Q + n * nb * (quant_bytes(F) + mask_bytes(F));
}

// Activation rows sharing one pass over the weights: each weight block is read once per R rows, and
// R is a template argument so the accumulators stay in registers.
template <int R, Split F>
void rows_pass(const float* x, const float* xsum, int64_t K, int64_t N, int64_t n0, int64_t n1,
               const uint8_t* Q, const void* S, float* y) {
  const int64_t nb = K / kBlock;
  constexpr bool HasMin = has_min(F);
  constexpr int64_t qbytes = quant_bytes(F);
  constexpr int fields = HasMin ? 2 : 1;
  for (int64_t n = n0; n < n1; ++n) {
    Vec acc[R];
    float msum[R];
    for (int r = 0; r < R; ++r) acc[r] = vzero(), msum[r] = 0.f;
    const uint8_t* q = split_row<F>(Q, n, nb);
    const uint8_t* qh = q + nb * qbytes;
    const int64_t s = n * nb * fields;
    for (int64_t b = 0; b < nb; ++b) {
      const float d = scale_field<F>(S, s + b * fields);
      Vec w[kParts];  // the block's quants as floats, unpacked once for all R rows
      split_unpack<F>(q + b * qbytes, qh + b * 4, w);
      for (int r = 0; r < R; ++r) acc[r] = vfma(block_dot(w, x + r * K + b * kBlock), d, acc[r]);
      if (HasMin) {
        const float m = scale_field<F>(S, s + b * fields + 1);
        for (int r = 0; r < R; ++r) msum[r] += m * xsum[r * nb + b];
      }
    }
    for (int r = 0; r < R; ++r) y[r * N + n] = vsum(acc[r]) + msum[r];
  }
}

// Chunk c (32 weights) of a raw block of type T as float vectors, scaled and offset (q8_dequant:
// gguf-py's float32 arithmetic). With AVX2 the quants stay in a register; without, `q` holds the
// block's quants, decoded once.
template <typename T>
inline void raw_chunk(const uint8_t* block, const int8_t* q, int c, const float* D, const float* M, Vec* w) {
#if defined(BLOCKS_AVX2)
  (void)q;
  q8_dequant<T::kOffset>(T::chunk(block, c), D + 2 * c, M + 2 * c, w);
#else
  (void)block;
  q8_dequant<T::kOffset>(q + 32 * c, D + 2 * c, M + 2 * c, w);
#endif
}

template <typename T>
inline void raw_decode(const uint8_t* block, int8_t* q) {
#if defined(BLOCKS_AVX2)
  (void)block, (void)q;
#else
  T::decode(block, q);
#endif
}

// Rows of raw blocks of type T (blocks.h): a block's scales decoded once per R rows, then 32 weights
// at a time dequantized to float vectors in registers and multiplied with the R rows' activations.
template <int R, typename T>
void raw_pass(const float* x, int64_t K, int64_t ldy, int64_t n0, int64_t n1, const uint8_t* W, int64_t row_bytes,
              float* y) {
  const int64_t nb = K / T::kWeights;
  for (int64_t n = n0; n < n1; ++n) {
    Vec acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vzero();
    const uint8_t* row = W + n * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* block = row + b * T::kBytes;
      alignas(64) int8_t q[T::kWeights];
      float D[T::kWeights / 16], M[T::kWeights / 16];
      T::scales(block, D, M);
      raw_decode<T>(block, q);
      for (int c = 0; c < T::kWeights / 32; ++c) {
        Vec w[kParts];
        raw_chunk<T>(block, q, c, D, M, w);
        for (int r = 0; r < R; ++r) acc[r] = dot_acc(w, x + r * K + b * T::kWeights + 32 * c, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = vsum(acc[r]);
  }
}

// The float32 rows of raw blocks, through the same decode and dequantization as raw_pass.
template <typename T>
void raw_dequantize(const uint8_t* W, int64_t rows, int64_t K, int64_t row_bytes, float* out) {
  const int64_t nb = K / T::kWeights;
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* block = W + n * row_bytes + b * T::kBytes;
      alignas(64) int8_t q[T::kWeights];
      float D[T::kWeights / 16], M[T::kWeights / 16];
      T::scales(block, D, M);
      raw_decode<T>(block, q);
      for (int c = 0; c < T::kWeights / 32; ++c) {
        Vec w[kParts];
        raw_chunk<T>(block, q, c, D, M, w);
        std::memcpy(out + n * K + b * T::kWeights + 32 * c, w, 32 * sizeof(float));
      }
    }
}

#ifdef RTSERVER_INT_DOTS
// The scale fields i.. i+3 (two blocks' d and m) or i, i+1 (two blocks' d) as floats, lanes 0-3.
template <Split F>
inline __m128 two_blocks_fields(const void* S, int64_t i) {
  const uint16_t* h = static_cast<const uint16_t*>(S) + i;
  if (has_min(F)) return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h)));
  uint32_t two;
  std::memcpy(&two, h, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(two)));
}

// Rows r0.. r0+R of y for output columns [n0, n1): two blocks (64 quants) a step, the last odd block
// on 256-bit vectors. A block's int32 lanes get d_b * s_b in float; a min's m_b * sum(x_b) runs beside.
template <int R, Split F>
void fixed_pass(const FixedRows& f, int64_t r0, int64_t K, int64_t N, int64_t n0, int64_t n1,
                const uint8_t* Q, const void* S, float* y) {
  const int64_t nb = K / kBlock;
  constexpr bool HasMin = has_min(F);
  constexpr int64_t qbytes = quant_bytes(F);
  constexpr int fields = HasMin ? 2 : 1;
  const __m512i nib = _mm512_set1_epi8(15);
  const __m512i ones = _mm512_set1_epi8(1);
  // (d0, m0, d1, m1) or (d0, d1) -> d0 over lanes 0-7, d1 over lanes 8-15
  const __m512i spread = HasMin ? _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0)
                                : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[R];
    __m256 tail[R];
    __m128 macc[R];
    float mtail[R];
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_setzero_ps(), tail[r] = _mm256_setzero_ps(), macc[r] = _mm_setzero_ps(), mtail[r] = 0.f;
    const uint8_t* q = split_row<F>(Q, n, nb);
    const uint8_t* qh = q + nb * qbytes;
    const int64_t s = n * nb * fields;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      __m512i w;
      __m128 dm;
      if (has_nibbles(F)) {  // 32 bytes = two blocks' nibbles -> lanes (b0 low, b0 high, b1 low, b1 high)
        __m512i z = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * qbytes)));
        z = _mm512_shuffle_i64x2(z, z, 0x50);
        w = _mm512_and_si512(_mm512_mask_srli_epi64(z, 0xCC, z, 4), nib);
        if (mask_bytes(F)) {  // byte i is weight i of the two blocks, as is bit i of their two masks
          uint64_t m;
          std::memcpy(&m, qh + b * 4, 8);
          w = _mm512_or_si512(w, _mm512_maskz_mov_epi8(m, _mm512_set1_epi8(16)));
        }
      } else {
        w = _mm512_loadu_si512(q + b * qbytes);
      }
      dm = two_blocks_fields<F>(S, s + b * fields);
      const __m512 d = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(dm));
      __m512i offset;
      if (!HasMin) offset = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w), 15);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * K + b * kBlock, blk = (r0 + r) * nb + b;
        __m512i t = fixed_dot(w, f.hi.data() + at, f.lo.data() + at, HasMin);
        if (!HasMin) t = _mm512_sub_epi32(t, offset);
        const __m512 sc = _mm512_mul_ps(d, _mm512_loadu_ps(f.scale8.data() + blk * 8));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sc, acc[r]);
        if (HasMin) macc[r] = _mm_fmadd_ps(dm, _mm_loadu_ps(f.xsum2.data() + blk * 2), macc[r]);
      }
    }
    if (b < nb) {
      __m256i w;
      if (has_nibbles(F)) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * qbytes));
        w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
        if (mask_bytes(F)) {
          uint32_t m;
          std::memcpy(&m, qh + b * 4, 4);
          w = _mm256_or_si256(w, _mm256_maskz_mov_epi8(m, _mm256_set1_epi8(16)));
        }
      } else {
        w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * qbytes));
      }
      const float d = scale_field<F>(S, s + b * fields);
      __m256i offset;
      if (!HasMin)
        offset = _mm256_slli_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), w), 15);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * K + b * kBlock, blk = (r0 + r) * nb + b;
        __m256i t = fixed_dot(w, f.hi.data() + at, f.lo.data() + at, HasMin);
        if (!HasMin) t = _mm256_sub_epi32(t, offset);
        tail[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(d * f.scale8[blk * 8]), tail[r]);
        if (HasMin) mtail[r] += scale_field<F>(S, s + b * fields + 1) * f.xsum2[blk * 2 + 1];
      }
    }
    for (int r = 0; r < R; ++r) {
      alignas(16) float m4[4];
      _mm_store_ps(m4, macc[r]);
      const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1));
      y[r * N + n] = _mm512_reduce_add_ps(_mm512_castps256_ps512(_mm256_add_ps(t, tail[r]))) + (m4[1] + m4[3]) + mtail[r];
    }
  }
}

// Raw blocks of type T (blocks.h) on integer dots: each chunk's 32 quants (T::chunk, in a register)
// meet the fixed-point activations as Q8_0's do (signed quants: offset limbs; none negative: signed
// limbs, as Q4_1). Two chunks make a 64-quant step; its 16 int32 lanes hold 4 weights each, so each
// per-16 scale D covers four lanes, and the offsets M meet the exact sums of 16. A 32-weight type
// with an odd block count ends on a 256-bit step.
template <int R, typename T>
void raw_fixed_pass(const FixedRows& f, int64_t r0, int64_t K, int64_t ldy, int64_t n0, int64_t n1,
                    const uint8_t* W, int64_t row_bytes, float* y) {
  constexpr int kChunks = T::kWeights / 32;
  const int64_t nb32 = K / kBlock, nb = K / T::kWeights, n16 = K / 16;
  const __m512i quad = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);  // lane -> its 16
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[R];
    __m256 tail[R];
    __m128 macc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), tail[r] = _mm256_setzero_ps(), macc[r] = _mm_setzero_ps();
    const uint8_t* row = W + n * row_bytes;
    // 64 quants at chunk g (of the row's 32-weight chunks), with their four groups' D and M
    const auto step = [&](__m256i w0, __m256i w1, __m128 d4, __m128 m4, int64_t g) {
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
      const __m512 d = _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(d4));
      __m512i offset = _mm512_setzero_si512();
      if (T::kSigned) offset = _mm512_slli_epi32(_mm512_dpbusd_epi32(offset, _mm512_set1_epi8(1), w), 15);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * K + g * kBlock, blk = (r0 + r) * nb32 + g;
        __m512i t = fixed_dot(w, f.hi.data() + at, f.lo.data() + at, !T::kSigned);
        if (T::kSigned) t = _mm512_sub_epi32(t, offset);
        const __m512 sc = _mm512_mul_ps(d, _mm512_loadu_ps(f.scale8.data() + blk * 8));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sc, acc[r]);
        if (T::kOffset)
          macc[r] = _mm_fmadd_ps(m4, _mm_loadu_ps(f.xsum16.data() + (r0 + r) * n16 + g * 2), macc[r]);
      }
    };
    int64_t b = 0;
    if (kChunks > 1) {
      for (; b < nb; ++b) {
        const uint8_t* block = row + b * T::kBytes;
        float D[T::kWeights / 16], M[T::kWeights / 16];
        T::scales(block, D, M);
        for (int c = 0; c + 1 < kChunks; c += 2)
          step(T::chunk(block, c), T::chunk(block, c + 1), _mm_loadu_ps(D + 2 * c), _mm_loadu_ps(M + 2 * c),
               b * kChunks + c);
      }
    } else {
      for (; b + 2 <= nb; b += 2) {
        const uint8_t *b0 = row + b * T::kBytes, *b1 = b0 + T::kBytes;
        float D0[2], M0[2], D1[2], M1[2];
        T::scales(b0, D0, M0);
        T::scales(b1, D1, M1);
        step(T::chunk(b0, 0), T::chunk(b1, 0), _mm_set_ps(D1[1], D1[0], D0[1], D0[0]),
             _mm_set_ps(M1[1], M1[0], M0[1], M0[0]), b);
      }
    }
    if (b < nb) {  // the last of an odd count of 32-weight blocks
      const uint8_t* block = row + b * T::kBytes;
      float D[2], M[2];
      T::scales(block, D, M);
      const __m256i w = T::chunk(block, 0);
      const __m256 d = _mm256_set_ps(D[1], D[1], D[1], D[1], D[0], D[0], D[0], D[0]);
      __m256i offset = _mm256_setzero_si256();
      if (T::kSigned) offset = _mm256_slli_epi32(_mm256_dpbusd_epi32(offset, _mm256_set1_epi8(1), w), 15);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * K + b * kBlock, blk = (r0 + r) * nb32 + b;
        __m256i t = fixed_dot(w, f.hi.data() + at, f.lo.data() + at, !T::kSigned);
        if (T::kSigned) t = _mm256_sub_epi32(t, offset);
        const __m256 sc = _mm256_mul_ps(d, _mm256_loadu_ps(f.scale8.data() + blk * 8));
        tail[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), sc, tail[r]);
        if (T::kOffset) {
          const float* xs = f.xsum16.data() + (r0 + r) * n16 + b * 2;
          macc[r] = _mm_add_ps(macc[r], _mm_set_ps(0.f, 0.f, M[1] * xs[1], M[0] * xs[0]));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      alignas(16) float m4[4];
      _mm_store_ps(m4, macc[r]);
      const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1));
      y[r * ldy + n] = _mm512_reduce_add_ps(_mm512_castps256_ps512(_mm256_add_ps(t, tail[r]))) +
                       ((m4[0] + m4[1]) + (m4[2] + m4[3]));
    }
  }
}

#endif

// The output columns split over the threads; in each, the rows in passes of up to 4 (a pass keeps its
// rows' accumulators in registers): pass(std::integral_constant<int, R>, first row, n0, n1). With more
// than 4 rows the passes take a few columns at a time, so each pass after the first finds that tile's
// weight rows in L1 instead of reading the thread's whole share again.
template <typename Pass>
void row_passes(int64_t M, int64_t N, const Pass& pass) {
  // Output columns per task: enough to amortise scheduling, few enough that every thread gets work.
  const int64_t grain = std::max<int64_t>(16, N / (4 * pool::num_threads()));
  const int64_t tile = M > 4 ? 16 : grain;
  pool::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t c0 = n0; c0 < n1; c0 += tile) {
      const int64_t c1 = std::min(n1, c0 + tile);
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        switch (std::min<int64_t>(4, M - r0)) {
          case 1: pass(std::integral_constant<int, 1>{}, r0, c0, c1); break;
          case 2: pass(std::integral_constant<int, 2>{}, r0, c0, c1); break;
          case 3: pass(std::integral_constant<int, 3>{}, r0, c0, c1); break;
          default: pass(std::integral_constant<int, 4>{}, r0, c0, c1); break;
        }
      }
    }
  });
}

#if defined(BLOCKS_AVX2)
// Row n of a split-layout weight, block by block: visit(b, quants, d, m), the 32 quants as bytes in the
// weights' order (m 0 without a min).
template <Split F, typename Visit>
inline void split_blocks(const uint8_t* Q, const void* S, int64_t n, int64_t K, const Visit& visit) {
  constexpr int64_t qbytes = quant_bytes(F), fields = has_min(F) ? 2 : 1;
  const int64_t nb = K / kBlock;
  const uint8_t* row = split_row<F>(Q, n, nb);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i w = has_nibbles(F) ? blocks::nibbles(row + b * qbytes) : blocks::load32(row + b * qbytes);
    if (mask_bytes(F)) w = _mm256_or_si256(w, blocks::fifth_bits(row + nb * qbytes + b * 4));
    const int64_t i = (n * nb + b) * fields;
    visit(b, w, scale_field<F>(S, i), has_min(F) ? scale_field<F>(S, i + 1) : 0.f);
  }
}

// Row n of raw blocks of type T, block by block: visit(index, block, D, M), D and M per 16 weights.
template <typename T, typename Visit>
inline void raw_blocks(const uint8_t* W, int64_t row_bytes, int64_t n, int64_t K, const Visit& visit) {
  const uint8_t* row = W + n * row_bytes;
  for (int64_t blk = 0; blk < K / T::kWeights; ++blk) {
    const uint8_t* b = row + blk * T::kBytes;
    float d[16], m[16];
    T::scales(b, d, m);
    visit(blk, b, d, m);
  }
}
#endif

#ifdef RTSERVER_BYTE_DOTS
// y[r0 + r, n] (rows ldy apart) for R rows and columns [n0, n1) of a split-layout weight on byte dots.
// Eight blocks' float16 scales convert in one vector and meet the rows' activation scales there; each
// block's factor is then broadcast from memory, and the mins meet the rounded sums of 32 eight at a
// time. Scalar conversions and a float shuffle per block cost the small models' decode a third.
template <int R, Split F>
void split_byte_pass(const byte_dots::Rows& x, int64_t r0, int64_t K, int64_t ldy, int64_t n0, int64_t n1,
                     const uint8_t* Q, const void* S, float* y) {
  constexpr bool Signed = !has_min(F), HasMin = has_min(F);
  constexpr int64_t qbytes = quant_bytes(F), fields = HasMin ? 2 : 1;
  const int64_t nb = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = split_row<F>(Q, n, nb);
    const uint16_t* halves = static_cast<const uint16_t*>(S) + n * nb * fields;
    __m256 acc[R], off[R];
    float tail_off[R];
    for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps(), tail_off[r] = 0.f;
    alignas(32) float ws[R][8];
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
      const int64_t count = std::min<int64_t>(8, nb - b0);
      if (count == 8) {
        // d (and m) of blocks b0 .. b0 + 7; with mins the halves alternate d, m
        __m256 d8, m8 = _mm256_setzero_ps();
        if constexpr (HasMin) {
          const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + 2 * b0)));
          const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + 2 * b0 + 8)));
          const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
          const __m256 pa = _mm256_permutevar8x32_ps(a, even), pb = _mm256_permutevar8x32_ps(b, even);
          d8 = _mm256_permute2f128_ps(pa, pb, 0x20), m8 = _mm256_permute2f128_ps(pa, pb, 0x31);
        } else {
          d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + b0)));
        }
        for (int r = 0; r < R; ++r) {
          const int64_t at = (r0 + r) * nb + b0;
          _mm256_store_ps(ws[r], _mm256_mul_ps(d8, _mm256_loadu_ps(x.scale.data() + at)));
          if (HasMin) off[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(x.xsum32.data() + at), off[r]);
        }
      } else {
        for (int64_t b = b0; b < nb; ++b) {
          const float d = scale_field<F>(S, (n * nb + b) * fields);
          for (int r = 0; r < R; ++r) {
            const int64_t at = (r0 + r) * nb + b;
            ws[r][b - b0] = d * x.scale[at];
            if (HasMin) tail_off[r] += scale_field<F>(S, (n * nb + b) * fields + 1) * x.xsum32[at];
          }
        }
      }
      for (int64_t i = 0; i < count; ++i) {
        const int64_t b = b0 + i;
        __m256i w = has_nibbles(F) ? blocks::nibbles(row + b * qbytes) : blocks::load32(row + b * qbytes);
        if (mask_bytes(F)) w = _mm256_or_si256(w, blocks::fifth_bits(row + nb * qbytes + b * 4));
        const __m256i a = Signed ? _mm256_abs_epi8(w) : w;
        for (int r = 0; r < R; ++r) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.v.data() + (r0 + r) * K + b * kBlock));
          const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(a, Signed ? _mm256_sign_epi8(v, w) : v), ones);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_broadcast_ss(&ws[r][i]), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = byte_dots::hsum8(acc[r]) + (byte_dots::hsum8(off[r]) + tail_off[r]);
  }
}

// A split-layout weight's small step on byte dots (byte_dots.h).
template <Split F>
void byte_matmul(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* Q, const void* S, float* y,
                 int64_t ldy) {
  byte_dots::Rows rows;
  byte_dots::to_bytes(x, M, K, rows);
  row_passes(M, N, [&](auto R, int64_t r0, int64_t n0, int64_t n1) {
    split_byte_pass<decltype(R)::value, F>(rows, r0, K, ldy, n0, n1, Q, S, y + r0 * ldy);
  });
}

// Raw blocks of type T on byte dots: the K-quants' own passes (kquant_avx2.h), else each block's chunks
// of 32 in order.
template <typename T>
void byte_raw_matmul(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* W, int64_t row_bytes, float* y,
                     int64_t ldy) {
  constexpr int kChunks = T::kWeights / 32;
  byte_dots::Rows rows;
  byte_dots::to_bytes(x, M, K, rows);
  if constexpr (kquant::has_pass<T>) {
    row_passes(M, N, [&](auto R, int64_t r0, int64_t n0, int64_t n1) {
      kquant::pass<decltype(R)::value, T>(rows, r0, K, ldy, n0, n1, W, row_bytes, y + r0 * ldy);
    });
    return;
  }
  const auto column = [&](int64_t n, const auto& visit) {
    raw_blocks<T>(W, row_bytes, n, K, [&](int64_t blk, const uint8_t* b, const float* d, const float* m) {
      for (int ch = 0; ch < kChunks; ++ch)
        visit(blk * kChunks + ch, byte_dots::Chunk{T::chunk(b, ch), d[2 * ch], d[2 * ch + 1], m[2 * ch], m[2 * ch + 1]});
    });
  };
  row_passes(M, N, [&](auto R, int64_t r0, int64_t n0, int64_t n1) {
    byte_dots::pass<decltype(R)::value, T::kSigned, T::kOffset>(rows, r0, K, ldy, n0, n1, column, y + r0 * ldy);
  });
}
#endif

// y [M, N] (rows ldy apart) = x [M, K] @ W.T for a weight in the split layout.
template <Split F>
void matmul(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* Q, const void* S, float* y,
            int64_t ldy) {
  constexpr bool HasMin = has_min(F);
#ifdef RTSERVER_INT_DOTS
  FixedRows f;
  to_fixed(x, M, K, !HasMin, f);
  row_passes(M, N, [&](auto R, int64_t r0, int64_t n0, int64_t n1) {
    fixed_pass<decltype(R)::value, F>(f, r0, K, ldy, n0, n1, Q, S, y + r0 * ldy);
  });
#else
#ifdef RTSERVER_BYTE_DOTS
  if (panel::g_activation_bits == 8) return byte_matmul<F>(x, M, K, N, Q, S, y, ldy);
#endif
  const int64_t nb = K / kBlock;
  std::vector<float> xsum(HasMin ? M * nb : 0);  // the min term: each block's activation sum
  for (int64_t i = 0; i < (HasMin ? M * nb : 0); ++i) {
    float t = 0.f;
    for (int j = 0; j < kBlock; ++j) t += x[i * kBlock + j];
    xsum[i] = t;
  }
  row_passes(M, N, [&](auto R, int64_t r0, int64_t n0, int64_t n1) {
    rows_pass<decltype(R)::value, F>(x + r0 * K, xsum.data() + (HasMin ? r0 * nb : 0), K, ldy, n0, n1, Q, S,
                                     y + r0 * ldy);
  });
#endif
}

// y [M, N] (rows ldy apart) = x [M, K] @ W.T for raw blocks of type T, W uint8 [N, row_bytes].
template <typename T>
void raw_matmul(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* W, int64_t row_bytes, float* y,
                int64_t ldy) {
#ifdef RTSERVER_INT_DOTS
  // Integer dots save the unpacking to float, which one or two rows cannot share; from three rows on,
  // float quants unpacked once for all rows cost less per row than the limbs' loads and scaling. At 8
  // bits every step takes them, so a row rounds as it does in a step of any size.
  if (M <= 2 || panel::g_activation_bits == 8) {
    const bool own_pass = kquant::has_pass<T> && K % kquant::pass_weights<T> == 0;
    FixedRows f;
    to_fixed(x, M, K, T::kSigned && !own_pass, f);  // the passes' quants are unsigned
    row_passes(M, N, [&](auto R, int64_t r0, int64_t n0, int64_t n1) {
      if (own_pass)
        kquant::pass<decltype(R)::value, T>(f, r0, K, ldy, n0, n1, W, row_bytes, y + r0 * ldy);
      else
        raw_fixed_pass<decltype(R)::value, T>(f, r0, K, ldy, n0, n1, W, row_bytes, y + r0 * ldy);
    });
    return;
  }
#elif defined(RTSERVER_AVX2_DOTS)
  if (panel::g_activation_bits == 8) return byte_raw_matmul<T>(x, M, K, N, W, row_bytes, y, ldy);
  if (kquant::has_pass<T>) {  // at every small step: no float unpacking, whatever the rows
    kquant::Int16Rows rows;
    kquant::to_int16_rows(x, M, K, rows);
    row_passes(M, N, [&](auto R, int64_t r0, int64_t n0, int64_t n1) {
      kquant::pass<decltype(R)::value, T>(rows, r0, K, ldy, n0, n1, W, row_bytes, y + r0 * ldy);
    });
    return;
  }
#endif
  row_passes(M, N, [&](auto R, int64_t r0, int64_t n0, int64_t n1) {
    raw_pass<decltype(R)::value, T>(x + r0 * K, K, ldy, n0, n1, W, row_bytes, y + r0 * ldy);
  });
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32");
}

// Calls f(std::integral_constant<Split, ...>) for a split format's name; false where it is none.
template <typename Fn>
bool with_split(const std::string& format, const Fn& f) {
  if (format == "Q4_1") return f(std::integral_constant<Split, Split::Q4_1>{}), true;
  if (format == "Q8_0") return f(std::integral_constant<Split, Split::Q8_0>{}), true;
  if (format == "Q5_1S") return f(std::integral_constant<Split, Split::Q5_1S>{}), true;
  return false;
}

bool is_split(const std::string& format) { return with_split(format, [](auto) {}); }

#ifdef RTSERVER_INT_DOTS
// Panels made once (kept, or a panel format's) carry their layout in their dtype: int8 for 16-bit
// activations' pairs, uint8 for 8-bit activations' quads. Reading them under the other width fails.
torch::ScalarType panel_dtype() { return int_panel::g_activation_bits == 8 ? torch::kUInt8 : torch::kInt8; }
void check_panel_dtype(const torch::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == panel_dtype(), "panels made for ", t.scalar_type() == torch::kUInt8 ? 8 : 16,
              "-bit activations, but the kernel rounds big steps to ", int_panel::g_activation_bits,
              " bits now: set_activation_bits comes before any panel is made");
}
#endif

// Formats kept only as int8 panels (int_panel::Panel::narrow's layout), read at every step size: Q8_0,
// whose panels take about the bytes of its blocks. A panel format's layout; G 0: none.
struct PanelLayout {
  int G = 0;
  const char* from = "";  // the layout it is made from
#ifdef RTSERVER_INT_DOTS
  int64_t bytes(int64_t K) const { return int_panel::Panel::kept_bytes(K, G, false); }
#endif
};

PanelLayout panel_layout(const std::string& format) {
  if (format == "Q8_0P") return {32, "Q8_0"};
  return {};
}

// The weight rows of a weight's quants tensor: a panel format holds 32 a row of it.
int64_t weight_rows(const std::string& format, const torch::Tensor& qs) {
  return panel_layout(format).G ? qs.size(0) * 32 : qs.size(0);
}

const char* kBlockTypes = "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS";

// Raw blocks (blocks.h) for inputs of width K: uint8 [N, K / weights per block * bytes per block].
template <typename T>
void check_raw(const std::string& format, const torch::Tensor& qs, int64_t K) {
  TORCH_CHECK(K % T::kWeights == 0, format, " blocks need K a multiple of ", T::kWeights);
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() &&
                  qs.size(1) == K / T::kWeights * T::kBytes,
              format, " blocks do not match x's width");
}

// A weight's blocks for inputs of width K. The split layout: Q4_1 = 16 bytes of quants and float16
// (d, m) per block, Q8_0 = 32 bytes and float16 d, Q5_1S = Q4_1's and a 4-byte mask; every other
// type its raw rows (`scales` unused).
void check_weight(const std::string& format, const torch::Tensor& qs, const torch::Tensor& scales, int64_t K) {
  if (const PanelLayout panels = panel_layout(format); panels.G) {
#ifdef RTSERVER_INT_DOTS
    TORCH_CHECK(K % panels.G == 0 && qs.dim() == 2 && qs.is_contiguous() && qs.size(1) == panels.bytes(K),
                format, " panels do not match x's width");
    check_panel_dtype(qs);
    return;
#else
    TORCH_CHECK(false, format, " panels need a CPU with VNNI");
#endif
  }
  if (!is_split(format)) {
    const bool known = blocks::with_type(format, [&](auto t) { check_raw<decltype(t)>(format, qs, K); });
    TORCH_CHECK(known, "unsupported block type ", format, " (supported: ", kBlockTypes, ")");
    return;
  }
  bool with_min = true;
  int64_t block_bytes = 0;
  with_split(format, [&](auto f) { with_min = has_min(f), block_bytes = quant_bytes(f) + mask_bytes(f); });
  const int64_t N = qs.size(0), nb = K / kBlock;
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() &&
                  qs.size(1) == nb * block_bytes,
              "blocks do not match x's width");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && scales.is_contiguous() &&
                  scales.numel() == N * nb * (with_min ? 2 : 1),
              format, with_min ? ": dm must be float16 [N, K/32, 2]" : ": d must be float16 [N, K/32]");
}

// Steps of more rows than this multiply through panel::matmul (set by the runner's start-up probe).
int64_t g_panel_rows = INT64_MAX;

void set_panel_rows(int64_t rows) { g_panel_rows = rows; }

// Rows n0 .. n0 + rows of a split-layout weight as float32 [rows, K]: d * q (+ m), a product then a
// sum, as QuantizedWeight.dequantize computes it.
template <Split F>
void split_dequantize(const uint8_t* Q, const void* S, int64_t n0, int64_t rows, int64_t K, float* out) {
  constexpr bool HasMin = has_min(F);
  constexpr int64_t qbytes = quant_bytes(F);
  const int64_t nb = K / kBlock, fields = HasMin ? 2 : 1;
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i = (n0 + n) * nb + b;
      const uint8_t* row = split_row<F>(Q, n0 + n, nb);
      const uint8_t* q = row + b * qbytes;
      const float d = scale_field<F>(S, i * fields), m = HasMin ? scale_field<F>(S, i * fields + 1) : 0.f;
      float* o = out + n * K + b * kBlock;
      Vec w[kParts];  // the weights' order (Q4_1: low nibbles of bytes 0-15, then their high nibbles)
      split_unpack<F>(q, row + nb * qbytes + b * 4, w);
      for (int i = 0; i < kParts; ++i) scale_store<HasMin>(w[i], d, m, o + i * (kBlock / kParts));
    }
}

#if defined(BLOCKS_AVX2)
// Columns n0 .. n0 + cols of a split-layout weight, block by block: put(c, k, quants) takes column c's
// 32 quants from weight k on, as bytes in the weights' order; D and M [K / 32][32] each block's d, m.
template <Split F, typename Put>
void split_columns(const uint8_t* Q, const void* S, int64_t n0, int64_t cols, int64_t K, float* D, float* M,
                   const Put& put) {
  for (int64_t c = 0; c < cols; ++c)
    split_blocks<F>(Q, S, n0 + c, K, [&](int64_t b, __m256i w, float d, float m) {
      put(c, b * kBlock, w);
      D[b * 32 + c] = d, M[b * 32 + c] = m;
    });
}

// Columns n0 .. n0 + cols of raw blocks of type T, chunk by chunk: put(c, k, quants) as split_columns';
// D and M [K / G][32] each scale group's. A column's groups go out as vectors, then across.
template <typename T, typename Put>
void raw_columns(const uint8_t* W, int64_t row_bytes, int64_t n0, int64_t cols, int64_t K, float* D, float* M,
                 const Put& put) {
  constexpr int kChunks = T::kWeights / 32, kGroups = T::kWeights / T::kGroup;
  const int64_t groups = K / T::kGroup;
  thread_local std::vector<float> dc, mc;  // [cols][groups]
  dc.resize(cols * groups), mc.resize(cols * groups);
  for (int64_t c = 0; c < cols; ++c) {
    const uint8_t* row = W + (n0 + c) * row_bytes;
    for (int64_t blk = 0; blk < K / T::kWeights; ++blk) {
      const uint8_t* b = row + blk * T::kBytes;
      blocks::group_scales<T>(b, dc.data() + c * groups + blk * kGroups, mc.data() + c * groups + blk * kGroups);
      for (int ch = 0; ch < kChunks; ++ch) put(c, blk * T::kWeights + ch * 32, T::chunk(b, ch));
    }
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < cols; ++c) D[g * 32 + c] = dc[c * groups + g], M[g * 32 + c] = T::kOffset ? mc[c * groups + g] : 0.f;
}
#endif

#ifdef RTSERVER_INT_DOTS
// Columns n0 .. n0 + cols of a split-layout weight as a panel: int16 quants, pairs interleaved, and
// D and M per block.
template <Split F>
void split_unpack_int(const uint8_t* Q, const void* S, int64_t n0, int64_t cols, int64_t K, int_panel::Panel& p) {
  split_columns<F>(Q, S, n0, cols, K, p.D.data(), p.M.data(), [&](int64_t c, int64_t k, __m256i w) {
    _mm512_storeu_si512(p.rows.data() + c * K + k, _mm512_cvtepi8_epi16(w));
  });
  p.interleave(K);
}

// Columns n0 .. n0 + cols of raw blocks of type T as a panel: each chunk's quants (pairs interleaved),
// D and M per group.
template <typename T>
void raw_unpack_int(const uint8_t* W, int64_t row_bytes, int64_t n0, int64_t cols, int64_t K, int_panel::Panel& p) {
  raw_columns<T>(W, row_bytes, n0, cols, K, p.D.data(), p.M.data(), [&](int64_t c, int64_t k, __m256i w) {
    _mm512_storeu_si512(p.rows.data() + c * K + k, _mm512_cvtepi8_epi16(w));
  });
  p.interleave(K);
}

// raw_unpack_int's 8-bit twin: each chunk's quants + 128 straight to bytes, then quads.
template <typename T>
void raw_unpack_quads(const uint8_t* W, int64_t row_bytes, int64_t n0, int64_t cols, int64_t K, int_panel::Panel& p) {
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  raw_columns<T>(W, row_bytes, n0, cols, K, p.D.data(), p.M.data(), [&](int64_t c, int64_t k, __m256i w) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.bytes.data() + c * K + k), _mm256_xor_si256(w, bias));
  });
  p.bytes_to_quads(K);
}

// Calls f(G, offset, unpack) with a weight's scale group, whether it has offsets, and its panel
// unpacker: unpack(n0, cols, p) fills p.pairs, p.D and p.M.
template <typename Fn>
void with_unpacker(const std::string& format, const torch::Tensor& qs, const torch::Tensor& scales, int64_t K,
                   const Fn& f) {
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  if (!is_split(format)) {
    const int64_t row_bytes = qs.size(1);
    blocks::with_type(format, [&](auto t) {
      using T = decltype(t);
      f(std::integral_constant<int, T::kGroup>{}, std::bool_constant<T::kOffset>{},
        [&](int64_t n0, int64_t cols, int_panel::Panel& p) {
          if (int_panel::g_activation_bits == 8) raw_unpack_quads<T>(Q, row_bytes, n0, cols, K, p);
          else raw_unpack_int<T>(Q, row_bytes, n0, cols, K, p);
        });
    });
    return;
  }
  const void* S = scales.data_ptr();
  with_split(format, [&](auto s) {
    constexpr Split F = decltype(s)::value;
    f(std::integral_constant<int, 32>{}, std::bool_constant<has_min(F)>{},
      [&](int64_t n0, int64_t cols, int_panel::Panel& p) { split_unpack_int<F>(Q, S, n0, cols, K, p); });
  });
}

// Calls f(rows) with the activation rows as the panels take them at the kernel's width: 8 or 16 bits.
template <typename Fn>
void with_rows(const float* x, int64_t M, int64_t K, const Fn& f) {
  if (int_panel::g_activation_bits == 8) {
    int_panel::Rows8 rows;
    to_int8(x, M, K, rows);
    f(rows);
  } else {
    int_panel::Rows rows;
    to_int16(x, M, K, rows);
    f(rows);
  }
}

// A many-row step on integer dots (int_panel.h): the activations in fixed point once, then panels,
// read from `kept` where the weight's panels were unpacked at load (else nullptr).
void int_panel_matmul(const float* x, int64_t M, int64_t K, const std::string& format, const torch::Tensor& qs,
                      const torch::Tensor& scales, const int8_t* kept, float* y, int64_t ldy) {
  const int64_t N = qs.size(0);
  with_unpacker(format, qs, scales, K, [&](auto G, auto offset, const auto& unpack) {
    with_rows(x, M, K, [&](const auto& rows) {
      int_panel::matmul<decltype(G)::value, decltype(offset)::value>(rows, M, K, N, y, ldy, kept, unpack);
    });
  });
}

// Any step on a weight kept only as panels (panel_layout's formats): nothing to unpack.
void panels_only_matmul(const float* x, int64_t M, int64_t K, const PanelLayout& panels, const torch::Tensor& qs,
                        float* y, int64_t ldy) {
  const int8_t* kept = static_cast<const int8_t*>(qs.data_ptr());
  const auto none = [](int64_t, int64_t, int_panel::Panel&) {};
  const int64_t N = qs.size(0) * int_panel::kCols;
  with_rows(x, M, K, [&](const auto& rows) {
    if (panels.G == 32) int_panel::matmul<32, false>(rows, M, K, N, y, ldy, kept, none);
    else int_panel::matmul<16, false>(rows, M, K, N, y, ldy, kept, none);
  });
}
#endif

#ifdef RTSERVER_BYTE_DOTS
// A many-row step on AVX2 byte dots (byte_panel.h): the activations to bytes once, then panels of
// the quants as the blocks hold them.
void byte_panel_matmul(const float* x, int64_t M, int64_t K, const std::string& format, const torch::Tensor& qs,
                       const torch::Tensor& scales, float* y, int64_t ldy) {
  const int64_t N = qs.size(0);
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  byte_dots::Rows rows;
  byte_dots::to_bytes(x, M, K, rows);
  const auto store = [&](byte_panel::Panel& p) {
    return [&p, K](int64_t c, int64_t k, __m256i w) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.bytes.data() + c * K + k), w);
    };
  };
  if (!is_split(format)) {
    const int64_t row_bytes = qs.size(1);
    blocks::with_type(format, [&](auto t) {
      using T = decltype(t);
      byte_panel::matmul<T::kGroup, T::kMaxQ, T::kSigned, T::kOffset>(
          rows, M, K, N, y, ldy, [&](int64_t n0, int64_t cols, byte_panel::Panel& p) {
            raw_columns<T>(Q, row_bytes, n0, cols, K, p.D.data(), p.M.data(), store(p));
          });
    });
    return;
  }
  const void* S = scales.data_ptr();
  with_split(format, [&](auto s) {
    constexpr Split F = decltype(s)::value;
    byte_panel::matmul<32, max_quant(F), !has_min(F), has_min(F)>(
        rows, M, K, N, y, ldy, [&](int64_t n0, int64_t cols, byte_panel::Panel& p) {
          split_columns<F>(Q, S, n0, cols, K, p.D.data(), p.M.data(), store(p));
        });
  });
}
#endif

// The bytes of a weight's panels unpacked once (unpack_panels); 0 where the kernel keeps none.
int64_t kept_bytes(const std::string& format, int64_t N, int64_t K) {
  int64_t bytes = 0;
#ifdef RTSERVER_INT_DOTS
  const auto count = [&](int64_t G, bool offset) {
    bytes = (N + int_panel::kCols - 1) / int_panel::kCols * int_panel::Panel::kept_bytes(K, G, offset);
  };
  if (!blocks::with_type(format, [&](auto t) { count(decltype(t)::kGroup, decltype(t)::kOffset); }))
    with_split(format, [&](auto f) { count(32, has_min(decltype(f)::value)); });
#endif
  return bytes;
}

// A weight's panels for many-row steps unpacked once: [kept_bytes] in panel_dtype(); empty where the
// kernel has no integer panels (no VNNI).
torch::Tensor unpack_panels(std::string format, torch::Tensor qs, torch::Tensor scales, int64_t K) {
  check_weight(format, qs, scales, K);
#ifdef RTSERVER_INT_DOTS
  if (panel_layout(format).G) return torch::empty({0}, panel_dtype());  // already panels alone
  auto out = torch::empty({kept_bytes(format, qs.size(0), K)}, panel_dtype());
  int8_t* kept = static_cast<int8_t*>(out.data_ptr());
  with_unpacker(format, qs, scales, K, [&](auto G, auto offset, const auto& unpack) {
    int_panel::keep<decltype(G)::value, decltype(offset)::value>(K, qs.size(0), kept, unpack);
  });
  return out;
#else
  return torch::empty({0}, torch::kInt8);
#endif
}

// A weight as panel format `to` alone (panel_layout's): [N / 32, panel bytes] in panel_dtype(), for rows
// a multiple of 32 in the layout `to` is made from.
torch::Tensor panels_of(std::string to, std::string format, torch::Tensor qs, torch::Tensor scales, int64_t K) {
  const PanelLayout panels = panel_layout(to);
  TORCH_CHECK(panels.G && format == panels.from, to, " panels are made from ", panels.G ? panels.from : "nothing");
  TORCH_CHECK(qs.dim() == 2 && qs.size(0) % 32 == 0, to, " panels need rows a multiple of 32");
#ifdef RTSERVER_INT_DOTS
  // unpack_panels' bytes, a row per panel: Q8_0 has no offsets, as the panel format
  return unpack_panels(format, qs, scales, K).view({qs.size(0) / int_panel::kCols, panels.bytes(K)});
#else
  TORCH_CHECK(false, to, " panels need a CPU with VNNI");
  return {};
#endif
}

// A many-row step: on integer dots where the CPU has VNNI; with AVX2 alone on byte dots at 8-bit
// activations, else the weight dequantized 16 rows at a time beside a float32 GEMM (panel.h).
void panel_matmul(const float* x, int64_t M, int64_t K, const std::string& format, const torch::Tensor& qs,
                  const torch::Tensor& scales, const int8_t* kept, float* y, int64_t ldy) {
#ifdef RTSERVER_INT_DOTS
  int_panel_matmul(x, M, K, format, qs, scales, kept, y, ldy);
#else
  (void)kept;  // unpacked panels exist only for the VNNI path
#ifdef RTSERVER_BYTE_DOTS
  if (panel::g_activation_bits == 8) return byte_panel_matmul(x, M, K, format, qs, scales, y, ldy);
#endif
  const int64_t N = qs.size(0);
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  if (!is_split(format)) {
    const int64_t row_bytes = qs.size(1);
    blocks::with_type(format, [&](auto t) {
      panel::matmul(x, M, K, N, y, ldy, [&](int64_t n0, int64_t rows, float* out) {
        raw_dequantize<decltype(t)>(Q + n0 * row_bytes, rows, K, row_bytes, out);
      });
    });
    return;
  }
  const void* S = scales.data_ptr();
  with_split(format, [&](auto f) {
    panel::matmul(x, M, K, N, y, ldy, [&](int64_t n0, int64_t rows, float* out) {
      split_dequantize<decltype(f)::value>(Q, S, n0, rows, K, out);
    });
  });
#endif
}

// y = x @ W.T (rows ldy apart) for a weight given as (format, quants, scales), checked: the dispatch
// every caller shares. `kept` is the weight's panels unpacked once, or nullptr.
void block_matmul(const float* x, int64_t M, int64_t K, const std::string& format, const torch::Tensor& qs,
                  const torch::Tensor& scales, const int8_t* kept, float* y, int64_t ldy) {
  check_weight(format, qs, scales, K);
#ifdef RTSERVER_INT_DOTS
  if (const PanelLayout panels = panel_layout(format); panels.G) return panels_only_matmul(x, M, K, panels, qs, y, ldy);
#endif
  if (M > g_panel_rows) return panel_matmul(x, M, K, format, qs, scales, kept, y, ldy);
  const int64_t N = qs.size(0);
  if (!is_split(format)) {
    blocks::with_type(format, [&](auto t) {
      raw_matmul<decltype(t)>(x, M, K, N, qs.data_ptr<uint8_t>(), qs.size(1), y, ldy);
    });
    return;
  }
  const void* S = scales.data_ptr();
  with_split(format, [&](auto f) { matmul<decltype(f)::value>(x, M, K, N, qs.data_ptr<uint8_t>(), S, y, ldy); });
}

// A linear as the runner passes it: one or more parts over the same input (a stacked weight: q/k/v or
// gate/up of different block types), each (format, a, b, panels: unpack_panels' or empty); their
// outputs lie side by side.
// The parts are the caller's: no tensor is released here, where the GIL is not held.
const std::vector<torch::Tensor> kNoPanels;
struct Parts {
  const std::vector<std::string>& formats;
  const std::vector<torch::Tensor>&a, &b, &panels = kNoPanels;

  int64_t rows() const {
    int64_t n = 0;
    for (size_t i = 0; i < a.size(); ++i) n += weight_rows(formats[i], a[i]);
    return n;
  }
  void check(int64_t K) const {
    TORCH_CHECK(!formats.empty() && formats.size() == a.size() && formats.size() == b.size(),
                "a linear needs one (format, a, b) per part");
    TORCH_CHECK(panels.empty() || panels.size() == formats.size(), "a linear needs no panels or one per part");
    for (size_t i = 0; i < formats.size(); ++i) {
      check_weight(formats[i], a[i], b[i], K);
      const bool none = i >= panels.size() || panels[i].numel() == 0;
      TORCH_CHECK(none || (panels[i].is_contiguous() &&
                           panels[i].numel() == kept_bytes(formats[i], weight_rows(formats[i], a[i]), K)),
                  "a part's panels must be empty or unpack_panels' for the same weight");
#ifdef RTSERVER_INT_DOTS
      if (!none) check_panel_dtype(panels[i]);
#endif
    }
  }
  const int8_t* kept(size_t i) const {
    return i < panels.size() && panels[i].numel() > 0 ? static_cast<const int8_t*>(panels[i].data_ptr()) : nullptr;
  }
  // y [M, rows()] = x [M, K] @ W.T, part by part (checked first).
  void apply(const float* x, int64_t M, int64_t K, float* y) const {
    check(K);
    run(x, M, K, y);
  }
  // apply for parts already checked at width K.
  void run(const float* x, int64_t M, int64_t K, float* y) const {
    const int64_t N = rows();
    int64_t at = 0;
    for (size_t i = 0; i < formats.size(); ++i) {
      block_matmul(x, M, K, formats[i], a[i], b[i], kept(i), y + at, N);
      at += weight_rows(formats[i], a[i]);
    }
  }
};

torch::Tensor parts_mm(const torch::Tensor& x, const Parts& w) {
  check_x(x);
  auto y = torch::empty({x.size(0), w.rows()}, x.options());
  w.apply(x.data_ptr<float>(), x.size(0), x.size(1), y.data_ptr<float>());
  return y;
}

}  // namespace

torch::Tensor q4_1_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor dm) { return parts_mm(x, {{"Q4_1"}, {qs}, {dm}}); }

torch::Tensor q8_0_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor d) { return parts_mm(x, {{"Q8_0"}, {qs}, {d}}); }

torch::Tensor blocks_mm(const torch::Tensor& x, const std::vector<std::string>& formats,
                        const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                        const std::vector<torch::Tensor>& panels) {
  return parts_mm(x, {formats, a, b, panels});
}

// The float32 weight of raw blocks [N, row bytes] of width K, decoded as the kernel decodes it.
torch::Tensor dequantize_blocks(std::string format, torch::Tensor qs, int64_t K) {
  torch::Tensor out;
  const bool known = blocks::with_type(format, [&](auto t) {
    using T = decltype(t);
    check_raw<T>(format, qs, K);
    out = torch::empty({qs.size(0), K}, torch::kFloat32);
    raw_dequantize<T>(qs.data_ptr<uint8_t>(), qs.size(0), K, qs.size(1), out.data_ptr<float>());
  });
  TORCH_CHECK(known, "unsupported block type ", format, " (supported: ", kBlockTypes, ")");
  return out;
}
