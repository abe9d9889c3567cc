// Q4_K, Q6_K, IQ4_XS and IQ4_NL read at the file's width on integer dots (VNNI), for steps of one or two
// rows.
//
// A Q4_K_M file is Q4_K and Q6_K almost entirely, an IQ4_XS file IQ4_XS and IQ4_NL, and a decode step
// reads each weight once, so these are decoded straight from the file's blocks: no copy in a wider
// layout. A 256-weight block gives four vectors of 64 quants in the activations' order and its scales
// once as 16 floats; two 32-weight IQ4_NL blocks give one. Each vector meets the fixed-point
// activations (fixed.h) in vpdpbusd; its int32 lanes then take the weight's scale times the
// activations' in float. The scales are blocks.h's products, exactly.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "blocks.h"
#include "fixed.h"

namespace kquant {

// The cache lines of the block `kAhead` blocks on (the rows are read in order, the next row's blocks
// follow): a decode pass computes little per byte, so it asks for its bytes before it needs them.
constexpr int64_t kAhead = 8;
inline void prefetch_ahead(const uint8_t* block, int64_t bytes) {
  const uint8_t* p = block + kAhead * bytes;
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(p + at), _MM_HINT_T0);
}

// A float vector whose lanes 4i .. 4i+3 hold v[first + i] (Q6_K: four groups of 16 weights), or, with
// `lanes` 8, lanes 8i .. 8i+7 hold v[first + i] (Q4_K: two sub-blocks of 32).
inline __m512i spread(int first, int lanes) {
  alignas(64) int32_t idx[16];
  for (int i = 0; i < 16; ++i) idx[i] = first + i / lanes;
  return _mm512_load_si512(idx);
}

// One decoder per block type, for the shared pass below. A decoder made once per pass holds its
// constants; decode(block) gives the block's kVectors vectors of 64 quants in the activations' order
// (w), each lane's weight scale (ws), and the weights of its offset term (off), which meet the
// activations' sums (sums) and are taken off kOffset times. A decoder's block is kWeights weights.
struct DecodedBlock {
  __m512i w[4];
  __m512 ws[4], off;
};

// Q4_K: weight = d sc q - dmin mn per 32. Vector p holds sub-blocks 2p and 2p+1 (one 32-byte run of
// nibbles, low then high), so its lanes 0-7 take scale 2p and 8-15 scale 2p+1; the mins (lanes 8-15 of
// off) meet the activations' sums of 32. The high nibbles stay in place (16 q) and their scale takes
// d / 16 instead: a mask, not a shift.
struct Q4KDecoder {
  static constexpr int64_t kBytes = blocks::QK45<false>::kBytes, kWeights = 256, kVectors = 4;
  static constexpr float kOffset = 1.f;
  // the first 32 bytes' low nibbles, the second 32 bytes' high ones
  const __m512i nib = _mm512_inserti64x4(_mm512_set1_epi8(0x0F), _mm256_set1_epi8(static_cast<char>(0xF0)), 1);
  const __m512 sixteenth = _mm512_set_ps(1, 1, 1, 1, 1, 1, 1, 1, 0.0625f, 1, 0.0625f, 1, 0.0625f, 1, 0.0625f, 1);
  const __m512i pick[4] = {spread(0, 8), spread(2, 8), spread(4, 8), spread(6, 8)};

  DecodedBlock decode(const uint8_t* blk) const {
    DecodedBlock o;
    const __m512 dd = _mm512_mul_ps(
        sixteenth, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(blocks::f16(blk)), _mm512_set1_ps(blocks::f16(blk + 2))));
    // (d sc_0, d / 16 sc_1, .. d / 16 sc_7, dmin mn_0 .. dmin mn_7): a power of two keeps them exact
    const __m512 sm = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(blocks::q4k_scale_bytes(blk + 4))));
    o.off = _mm512_maskz_mov_ps(0xFF00, sm);
    for (int p = 0; p < 4; ++p) {
      const __m512i z = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * p)));
      o.w[p] = _mm512_and_si512(z, nib);
      o.ws[p] = _mm512_permutexvar_ps(pick[p], sm);
    }
    return o;
  }
  // block b's sums of 32 in lanes 8-15, beside the mins
  static __m512 sums(const FixedRows& f, int64_t row, int64_t K, int64_t b) {
    return _mm512_insertf32x8(_mm512_setzero_ps(), _mm256_loadu_ps(f.xsum32.data() + row * (K / 32) + b * 8), 1);
  }
};

#if defined(__AVX512VBMI__)
#define KQUANT_Q6_K 1
// vpmultishiftqb's control: byte j of each 64-bit lane starts at bit 8j + shift (mod 64), `first` in
// the vector's first 256 bits and `second` in the rest.
inline __m512i multishift_ctrl(int first, int second) {
  alignas(64) uint8_t c[64];
  for (int i = 0; i < 64; ++i) c[i] = static_cast<uint8_t>((8 * (i % 8) + (i < 32 ? first : second)) & 63);
  return _mm512_load_si512(c);
}

// Q6_K: weight = d sc (q - 32) per 16. Half h of a block is 64 bytes of low nibbles and 32 of high bit
// pairs: its first 64 weights are the low nibbles with pairs 0 and 1, its last 64 the high nibbles with
// pairs 2 and 3, in the activations' order. The quants stay 0..63 (the unsigned operand) and 32 d sc
// is taken off against the sums of 16.
struct Q6KDecoder {
  static constexpr int64_t kBytes = blocks::Q6_K::kBytes, kWeights = 256, kVectors = 4;
  static constexpr float kOffset = 32.f;
  const __m512i low4 = _mm512_set1_epi8(15), pair = _mm512_set1_epi8(0x30);
  // vpmultishiftqb picks byte j's bits from bit ctrl_j of its 64-bit lane: high nibbles (ctrl 8j + 4),
  // and bit pair g of qh moved to bits 4-5 (ctrl 8j + 2g - 4), pairs 0 and 1 or 2 and 3 by half
  const __m512i high_nibbles = multishift_ctrl(4, 4), pairs01 = multishift_ctrl(-4, -2), pairs23 = multishift_ctrl(0, 2);
  const __m512i pick[4] = {spread(0, 4), spread(4, 4), spread(8, 4), spread(12, 4)};

  DecodedBlock decode(const uint8_t* blk) const {
    DecodedBlock o;
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    o.off = _mm512_mul_ps(_mm512_set1_ps(blocks::f16(blk + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)));
    for (int h = 0; h < 2; ++h) {
      const __m512i z = _mm512_loadu_si512(blk + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
      // a | (b & c): the nibbles, and the pairs at bits 4-5
      o.w[2 * h] = _mm512_ternarylogic_epi32(_mm512_and_si512(z, low4), _mm512_multishift_epi64_epi8(pairs01, qh), pair, 0xF8);
      o.w[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_multishift_epi64_epi8(high_nibbles, z), low4),
                                                 _mm512_multishift_epi64_epi8(pairs23, qh), pair, 0xF8);
    }
    for (int k = 0; k < 4; ++k) o.ws[k] = _mm512_permutexvar_ps(pick[k], o.off);
    return o;
  }
  // block b's sums of 16, one a group
  static __m512 sums(const FixedRows& f, int64_t row, int64_t K, int64_t b) {
    return _mm512_loadu_ps(f.xsum16.data() + row * (K / 16) + b * 16);
  }
};
#endif

// The 64 table indices of two 16-byte runs of nibbles a and b (IQ4_NL's and IQ4_XS's 32 weights each:
// byte j holds weight j low and j + 16 high), in the activations' order: a's low nibbles, a's high,
// b's low, b's high, one 128-bit lane each.
inline __m512i nibble_pairs(const uint8_t* a, const uint8_t* b) {
  const __m512i z = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                                0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  return _mm512_and_si512(_mm512_mask_srli_epi64(z, 0xCC, z, 4), _mm512_set1_epi8(15));
}

// IQ4_NL, two 32-weight blocks (d, then 16 bytes of table indices) at a time: one vector of 64 quants,
// lanes 0-7 scaled by the first block's d and 8-15 by the second's. The table's values go + 128 (the
// unsigned operand), and 128 d comes off against each block's sum (lanes 0 and 1 of off).
struct IQ4NLDecoder {
  using T = blocks::IQ4_NL;
  static constexpr int64_t kBytes = 2 * T::kBytes, kWeights = 64, kVectors = 1;
  static constexpr float kOffset = 128.f;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks::kIq4Values)));
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);

  DecodedBlock decode(const uint8_t* blk) const {
    DecodedBlock o;
    const uint8_t* second = blk + T::kBytes;
    o.w[0] = _mm512_xor_si512(_mm512_shuffle_epi8(table, nibble_pairs(blk + 2, second + 2)), bias);
    uint16_t da, db;  // both float16 scales in one conversion, lanes 0 and 1 (2 and 3 zero)
    std::memcpy(&da, blk, 2), std::memcpy(&db, second, 2);
    const __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(da | (static_cast<uint32_t>(db) << 16))));
    o.ws[0] = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(d2));
    o.off = _mm512_zextps128_ps512(d2);  // lanes 0 and 1, against the two blocks' sums
    return o;
  }
  static __m512 sums(const FixedRows& f, int64_t row, int64_t K, int64_t b) {
    const float* sums = f.xsum32.data() + row * (K / 32) + 2 * b;
    return _mm512_zextps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sums))));
  }
};

// IQ4_XS: weight = d (ls - 32) table[i] per 32, the 6-bit ls split in low and high bits. Vector p holds
// sub-blocks 2p and 2p+1 (16 bytes of indices each, as IQ4_NL's); the table's values go + 128, and 128
// times each sub-block's scale comes off against its sums of 32 (lanes 8-15 of off).
struct IQ4XSDecoder {
  static constexpr int64_t kBytes = blocks::IQ4_XS::kBytes, kWeights = 256, kVectors = 4;
  static constexpr float kOffset = 128.f;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks::kIq4Values)));
  const __m512i pick[4] = {spread(0, 8), spread(2, 8), spread(4, 8), spread(6, 8)};

  DecodedBlock decode(const uint8_t* blk) const {
    DecodedBlock o;
    const float d = blocks::f16(blk);
    uint16_t sh;
    std::memcpy(&sh, blk + 2, 2);
    alignas(32) float sc[8];
    for (int c = 0; c < 8; ++c)
      sc[c] = d * static_cast<float>((((blk[4 + c / 2] >> (4 * (c % 2))) & 15) | (((sh >> (2 * c)) & 3) << 4)) - 32);
    const __m256 s8 = _mm256_load_ps(sc);
    const __m512 sm = _mm512_insertf32x8(_mm512_castps256_ps512(s8), s8, 1);
    o.off = _mm512_maskz_mov_ps(0xFF00, sm);
    for (int p = 0; p < 4; ++p) {
      const uint8_t* qs = blk + 8 + 32 * p;
      o.w[p] = _mm512_xor_si512(_mm512_shuffle_epi8(table, nibble_pairs(qs, qs + 16)), bias);
      o.ws[p] = _mm512_permutexvar_ps(pick[p], sm);
    }
    return o;
  }
  static __m512 sums(const FixedRows& f, int64_t row, int64_t K, int64_t b) { return Q4KDecoder::sums(f, row, K, b); }
};

// Rows r0 .. r0+R of y for output columns [n0, n1) of the blocks that Decoder decodes: each
// vector's dot in int32 lanes, times its weight scale and the activations' scale, summed in float.
template <int R, typename Decoder>
void decode_pass(const FixedRows& f, int64_t r0, int64_t K, int64_t ldy, int64_t n0, int64_t n1, const uint8_t* W,
                 int64_t row_bytes, float* y) {
  const Decoder decoder;
  const int64_t nb = K / Decoder::kWeights, nb32 = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[R][2], macc[R];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = macc[r] = _mm512_setzero_ps();
    const uint8_t* row = W + n * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * Decoder::kBytes;
      prefetch_ahead(blk, Decoder::kBytes);
      const DecodedBlock d = decoder.decode(blk);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * K + b * Decoder::kWeights, g = (r0 + r) * nb32 + b * (Decoder::kWeights / 32);
        for (int p = 0; p < Decoder::kVectors; ++p) {
          const __m512i t = fixed_dot(d.w[p], f.hi.data() + at + 64 * p, f.lo.data() + at + 64 * p, true);
          const __m512 sc = _mm512_mul_ps(d.ws[p], _mm512_loadu_ps(f.scale8.data() + (g + 2 * p) * 8));
          acc[r][p & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sc, acc[r][p & 1]);
        }
        macc[r] = _mm512_fmadd_ps(d.off, Decoder::sums(f, r0 + r, K, b), macc[r]);
      }
    }
    for (int r = 0; r < R; ++r)
      y[r * ldy + n] =
          _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) - Decoder::kOffset * _mm512_reduce_add_ps(macc[r]);
  }
}

// Whether block type T has a file-width decode pass here (Q6_K's needs VBMI's byte shifts).
template <typename T>
constexpr bool has_pass = std::is_same_v<T, blocks::QK45<false>> || std::is_same_v<T, blocks::IQ4_XS> ||
                          std::is_same_v<T, blocks::IQ4_NL>
#ifdef KQUANT_Q6_K
                          || std::is_same_v<T, blocks::Q6_K>
#endif
    ;

// The weights a pass of type T takes at a time: K must be a multiple (else the generic raw pass runs).
template <typename T>
constexpr int64_t pass_weights = std::is_same_v<T, blocks::IQ4_NL> ? 64 : 256;

// The block types with a pass here, by GGUF name.
inline std::vector<std::string> pass_types() {
  std::vector<std::string> types{"Q4_K", "IQ4_XS", "IQ4_NL"};
#ifdef KQUANT_Q6_K
  types.push_back("Q6_K");
#endif
  return types;
}

template <int R, typename T>
void pass(const FixedRows& f, int64_t r0, int64_t K, int64_t ldy, int64_t n0, int64_t n1, const uint8_t* W,
          int64_t row_bytes, float* y) {
#ifdef KQUANT_Q6_K
  if constexpr (std::is_same_v<T, blocks::Q6_K>) return decode_pass<R, Q6KDecoder>(f, r0, K, ldy, n0, n1, W, row_bytes, y);
#endif
  if constexpr (std::is_same_v<T, blocks::IQ4_NL>) return decode_pass<R, IQ4NLDecoder>(f, r0, K, ldy, n0, n1, W, row_bytes, y);
  if constexpr (std::is_same_v<T, blocks::IQ4_XS>) return decode_pass<R, IQ4XSDecoder>(f, r0, K, ldy, n0, n1, W, row_bytes, y);
  decode_pass<R, Q4KDecoder>(f, r0, K, ldy, n0, n1, W, row_bytes, y);
}

}  // namespace kquant
