// Q4_K, Q5_K and Q6_K read at the file's width on AVX2 integer dots (no VNNI), for every step below the
// panels.
//
// A Q4_K_M or Q5_K_M file is these types almost entirely, and a decode step reads each weight once.
// Unpacking every quant to float and scaling it made AVX2 decoding compute-bound, far from the memory
// floor. Here each 32 activations become 16-bit fixed point exactly as fixed.h rounds them on VNNI
// (s_b = max|x_b| / 32512), each chunk's 32 quants are widened to int16 in registers, and the two meet
// in vpmaddwd. The activations are stored in the order the widening gives (unpacklo/unpackhi stay
// within 128-bit lanes), so no quant crosses lanes. A chunk's int32 sums take the weight's scale times
// the activations' in float; the K-quants' mins meet the exact activation sums of 32. At 8-bit
// activations the same passes read activation bytes (byte_dots.h) into vpmaddubsw, the mins against
// the rounded sums.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "blocks.h"
#include "byte_dots.h"

namespace kquant {

constexpr float kFixed16 = 32512.f;  // as fixed.h's kFixed: 127 * 256

// Activation rows for the passes: per 32, v in the widening's order (weights 0-7 and 16-23, then
// 8-15 and 24-31), the scale s_b, and the exact sum of the 32 floats; per 16, the rounded values' sum
// times 32 s_b (Q6_K's offset, taken off aside).
struct Int16Rows {
  std::vector<int16_t> v;    // [M, K]
  std::vector<float> scale;  // [M, K / 32]
  std::vector<float> sum;    // [M, K / 32]
  std::vector<float> offset16;  // [M, K / 16] 32 s_b sum(v) over the 16
};

using byte_dots::hmax8;
using byte_dots::hsum8;

// fixed.h's fixed_block on AVX2: the same float operations, so the same values.
inline void to_int16_rows(const float* x, int64_t M, int64_t K, Int16Rows& f) {
  const int64_t blocks = M * K / 32;
  f.v.resize(M * K), f.scale.resize(blocks), f.sum.resize(blocks), f.offset16.resize(2 * blocks);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i limit = _mm256_set1_epi32(static_cast<int>(kFixed16));
  const __m256i floor = _mm256_sub_epi32(_mm256_setzero_si256(), limit);
  for (int64_t i = 0; i < blocks; ++i) {
    __m256 a[4], top = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) a[j] = _mm256_loadu_ps(x + 32 * i + 8 * j), top = _mm256_max_ps(top, _mm256_andnot_ps(sign, a[j]));
    const float amax = hmax8(top);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? kFixed16 / amax : 0.f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j)
      q[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(a[j], inv)), limit), floor);
    // packs works within lanes: (0-3, 16-19 | 4-7, 20-23), put in order by the 64-bit permute
    __m256i* out = reinterpret_cast<__m256i*>(f.v.data() + 32 * i);
    _mm256_storeu_si256(out, _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[2]), 0xD8));
    _mm256_storeu_si256(out + 1, _mm256_permute4x64_epi64(_mm256_packs_epi32(q[1], q[3]), 0xD8));
    f.scale[i] = amax / kFixed16;
    f.sum[i] = hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
    for (int h = 0; h < 2; ++h) {  // exact in int32 and in float (|sum| < 2^20)
      const __m256i s = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
      f.offset16[2 * i + h] = 32.f * f.scale[i] * hsum8(_mm256_cvtepi32_ps(s));
    }
  }
}

// The block 8 blocks on (the rows are read in order): a pass computes little per byte, so it asks early.
inline void prefetch_ahead(const uint8_t* block, int bytes) {
  for (int at = 0; at < bytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(block + 8 * bytes + at), _MM_HINT_T0);
}

// The passes read either width of activations: 16 bits (Int16Rows, the mins against the exact sums) or
// bytes (byte_dots::Rows at 8 bits, the mins against the rounded sums). Per width: a chunk's int32 sums,
// four weights a lane (lanes 0-3 the first 16), of 32 unsigned quant bytes q against row activations at
// `at`; each 32's sums for the mins; each 16's offset term, 32 s_b sum(v).
inline __m256i chunk_dot(__m256i q, const Int16Rows& x, int64_t at) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i lo = _mm256_unpacklo_epi8(q, zero), hi = _mm256_unpackhi_epi8(q, zero);
  const __m256i* a = reinterpret_cast<const __m256i*>(x.v.data() + at);
  return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(a)), _mm256_madd_epi16(hi, _mm256_loadu_si256(a + 1)));
}
inline __m256i chunk_dot(__m256i q, const byte_dots::Rows& x, int64_t at) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.v.data() + at));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, v), _mm256_set1_epi16(1));
}
inline const float* sums32(const Int16Rows& x) { return x.sum.data(); }
inline const float* sums32(const byte_dots::Rows& x) { return x.xsum32.data(); }
inline __m256 offsets16(const Int16Rows& x, int64_t at) { return _mm256_loadu_ps(x.offset16.data() + at); }
inline __m256 offsets16(const byte_dots::Rows& x, int64_t at) {
  return _mm256_mul_ps(_mm256_set1_ps(32.f), _mm256_loadu_ps(x.xsum16.data() + at));
}

// Q4_K and Q5_K (blocks::QK45): weight = d sc q - dmin mn per 32, q in 0..31. Each row keeps two
// accumulators, even and odd chunks, so one row's FMAs do not wait on each other; each chunk's factor
// is broadcast from memory, a load where a lane permute would take a shuffle port. The scales unpack in
// integer registers (blocks.h's q4k_scale_words).
template <int R, typename T, typename Rows>
void qk45_pass(const Rows& x, int64_t r0, int64_t K, int64_t ldy, int64_t n0, int64_t n1, const uint8_t* W,
               int64_t row_bytes, float* y) {
  const int64_t nb = K / 256, nb32 = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R][2], mins[R];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = mins[r] = _mm256_setzero_ps();
    const uint8_t* row = W + n * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * T::kBytes;
      prefetch_ahead(blk, T::kBytes);
      uint64_t sc8, mn8;
      blocks::q4k_scale_words(blk + 4, sc8, mn8);
      int32_t dm_bits;  // d and dmin, converted together
      std::memcpy(&dm_bits, blk, 4);
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));
      const __m256 sc = _mm256_mul_ps(_mm256_broadcastss_ps(dm), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc8))));
      const __m256 mn = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mn8))));
      alignas(32) float ws[R][8];
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * nb32 + b * 8;
        _mm256_store_ps(ws[r], _mm256_mul_ps(sc, _mm256_loadu_ps(x.scale.data() + at)));
        mins[r] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(sums32(x) + at), mins[r]);
      }
      for (int c = 0; c < 8; ++c) {
        const __m256i q = T::chunk(blk, c);
        for (int r = 0; r < R; ++r) {
          const __m256i t = chunk_dot(q, x, (r0 + r) * K + b * 256 + 32 * c);
          acc[r][c % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_broadcast_ss(&ws[r][c]), acc[r][c % 2]);
        }
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) - hsum8(mins[r]);
  }
}

// Q6_K: weight = d sc (q - 32) per 16. The quants stay 0..63 (no sign to extend); the 32 comes off as
// 32 times the rounded activations' sum, per 16. A chunk's int32 lanes 0-3 are its first 16's sums
// (the widening's low lanes), 4-7 its second's, so one float vector scales both. Two accumulators a
// row, as above.
template <int R, typename Rows>
void q6k_pass(const Rows& x, int64_t r0, int64_t K, int64_t ldy, int64_t n0, int64_t n1, const uint8_t* W,
              int64_t row_bytes, float* y) {
  using T = blocks::Q6_K;
  const int64_t nb = K / 256, nb32 = K / 32, n16 = K / 16;
  // lanes 0-3 take group 2c's factor, 4-7 group 2c + 1's, of the chunk's half of the block
  __m256i pick[4];
  for (int c = 0; c < 4; ++c) pick[c] = _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R][2], off[R];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = off[r] = _mm256_setzero_ps();
    const uint8_t* row = W + n * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * T::kBytes;
      prefetch_ahead(blk, T::kBytes);
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
      const __m256 d = _mm256_set1_ps(blocks::f16(blk + 208));
      const __m256 dsc[2] = {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))),
                             _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))))};
      __m256 ws[R][2];
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) {
          // the four chunks' s_b, each over its two 16s
          const __m128 s4 = _mm_loadu_ps(x.scale.data() + (r0 + r) * nb32 + b * 8 + 4 * h);
          const __m256 s8 = _mm256_set_m128(_mm_unpackhi_ps(s4, s4), _mm_unpacklo_ps(s4, s4));
          ws[r][h] = _mm256_mul_ps(dsc[h], s8);
          off[r] = _mm256_fmadd_ps(dsc[h], offsets16(x, (r0 + r) * n16 + b * 16 + 8 * h), off[r]);
        }
      for (int c = 0; c < 8; ++c) {
        const int h = c / 4, g = c % 4;
        const __m256i q = T::unsigned_chunk(blk, c);
        for (int r = 0; r < R; ++r) {
          const __m256i t = chunk_dot(q, x, (r0 + r) * K + b * 256 + 32 * c);
          acc[r][c % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_permutevar8x32_ps(ws[r][h], pick[g]), acc[r][c % 2]);
        }
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) - hsum8(off[r]);
  }
}

template <typename T>
constexpr bool has_pass = std::is_same_v<T, blocks::QK45<false>> || std::is_same_v<T, blocks::QK45<true>> ||
                          std::is_same_v<T, blocks::Q6_K>;

// The block types with a pass here, by GGUF name.
inline std::vector<std::string> pass_types() { return {"Q4_K", "Q5_K", "Q6_K"}; }

template <int R, typename T, typename Rows>
void pass(const Rows& x, int64_t r0, int64_t K, int64_t ldy, int64_t n0, int64_t n1, const uint8_t* W,
          int64_t row_bytes, float* y) {
  if constexpr (std::is_same_v<T, blocks::Q6_K>) q6k_pass<R>(x, r0, K, ldy, n0, n1, W, row_bytes, y);
  else qk45_pass<R, T>(x, r0, K, ldy, n0, n1, W, row_bytes, y);
}

}  // namespace kquant
