// GGUF block types read as shipped: each tensor row is the file's raw bytes, whole blocks side by side.
//
// Every type decodes one block into a common form: int8 quants q, and per 16 weights a scale D and an
// offset M, so that weight = D * q + M (a float32 product, then a float32 sum; kOffset false: M is 0
// and not added; kSigned false: no quant is negative, which the integer dots use; kGroup: the weights
// one scale covers, 16 or 32, which the integer panels use; kMaxQ: the largest |q|, which bounds the
// AVX2 byte dots' 16-bit sums). D and M are computed
// with the same float32 operations as gguf-py's `dequantize`, so a decoded weight equals its value
// bit for bit. Per type: `scales` (D and M of a block), `chunk` (AVX2: the 32 quants of chunk c in
// one register, never through memory) and `decode` (portable: all quants to memory, for CPUs without
// AVX2). The kernel's shared loop turns q into float vectors and applies D and M in registers; only
// these decoders know a type's bit layout.
//
// Layouts (llama.cpp's ggml-common.h; d, dmin and m are float16 unless said otherwise):
//   Q4_0   32 weights, 18 bytes: d, 16 bytes of nibbles (byte j: weight j low, j + 16 high); q - 8.
//   Q5_0   32 weights, 22 bytes: d, 32-bit qh (bit j: weight j's fifth bit), nibbles as Q4_0; q - 16.
//   Q5_1   32 weights, 24 bytes: d, m, qh, nibbles; d * q + m.
//   IQ4_NL 32 weights, 18 bytes: d, nibbles as Q4_0 indexing a fixed table of 16 int8 values.
//   Q2_K   256 weights, 84 bytes: 16 scale bytes (low nibble scale, high nibble min, per 16 weights),
//          64 bytes of 2-bit quants, d, dmin; d * sc * q - dmin * mn.
//   Q3_K   256 weights, 110 bytes: 32 bytes high-bit mask, 64 bytes of 2-bit quants, 12 bytes of
//          6-bit scales (minus 32), d; quant = low 2 bits - 4 where the mask bit is clear.
//   Q4_K   256 weights, 144 bytes: d, dmin, 12 bytes of 6-bit scales and mins per 32, 128 bytes of
//          nibbles (32 bytes per two sub-blocks: low nibbles first); d * sc * q - dmin * mn.
//   Q5_K   256 weights, 176 bytes: d, dmin, scales as Q4_K, 32 bytes of fifth bits, nibbles as Q4_K.
//   Q6_K   256 weights, 210 bytes: 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales per
//          16, d; d * sc * (q - 32).
//   IQ4_XS 256 weights, 136 bytes: d, 16-bit high scale bits, 4 bytes low scale nibbles, 128 bytes of
//          table indices (16 bytes per 32 weights, as IQ4_NL); d * (sc - 32) * table[i].
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

namespace blocks {

#if defined(__F16C__)
inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
#else
inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}
#endif

constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Sets D and M of `n` consecutive 16-weight groups to one scale and offset.
inline void fill(float* D, float* M, int n, float d, float m) {
  for (int i = 0; i < n; ++i) D[i] = d, M[i] = m;
}

#if defined(__AVX2__)
#define BLOCKS_AVX2 1
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
// bits `shift`.. of every byte of v, masked: 16-bit shifts leak only into bits the mask drops
inline __m256i field(__m256i v, int shift, int mask) { return _mm256_and_si256(_mm256_srli_epi16(v, shift), bytes(mask)); }
// 16 bytes of nibbles -> 32 bytes: low nibbles (weights 0..15), then high (16..31)
inline __m256i nibbles(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), bytes(15));
}
// a 32-bit mask -> 32 bytes, byte j 0x10 where bit j is set (Q5's fifth bits)
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t m;
  std::memcpy(&m, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(m)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), bytes(16));
}
inline __m256i iq4_lookup(__m256i idx) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values));
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), idx);
}
#endif

// The 4-bit nibbles of a 32-weight block: byte j gives weight j (low) and j + 16 (high), minus `bias`.
inline void nibbles32(const uint8_t* qs, int8_t* q, int bias) {
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>((qs[j] & 15) - bias);
    q[j + 16] = static_cast<int8_t>((qs[j] >> 4) - bias);
  }
}

struct Q4_0 {
  static constexpr int kWeights = 32, kBytes = 18;
  static constexpr int kGroup = 32;
  static constexpr bool kOffset = false;
  static constexpr bool kSigned = true;
  static constexpr int kMaxQ = 8;
  static void scales(const uint8_t* b, float* D, float* M) { fill(D, M, 2, f16(b), 0.f); }
  static void decode(const uint8_t* b, int8_t* q) { nibbles32(b + 2, q, 8); }
#ifdef BLOCKS_AVX2
  static __m256i chunk(const uint8_t* b, int) { return _mm256_sub_epi8(nibbles(b + 2), bytes(8)); }
#endif
};

template <bool HasMin>
struct Q5 {
  static constexpr int kWeights = 32, kBytes = HasMin ? 24 : 22;
  static constexpr int kGroup = 32;
  static constexpr bool kOffset = HasMin;
  static constexpr bool kSigned = !HasMin;
  static constexpr int kMaxQ = HasMin ? 31 : 16;
  static void scales(const uint8_t* b, float* D, float* M) { fill(D, M, 2, f16(b), HasMin ? f16(b + 2) : 0.f); }
#ifdef BLOCKS_AVX2
  static __m256i chunk(const uint8_t* b, int) {
    const uint8_t* p = b + (HasMin ? 4 : 2);
    const __m256i q = _mm256_or_si256(nibbles(p + 4), fifth_bits(p));
    return HasMin ? q : _mm256_sub_epi8(q, bytes(16));
  }
#endif
  static void decode(const uint8_t* b, int8_t* q) {
    const uint8_t* p = b + (HasMin ? 4 : 2);
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    const uint8_t* qs = p + 4;
    const int bias = HasMin ? 0 : 16;
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<int8_t>(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - bias);
      q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
    }
  }
};

struct IQ4_NL {
  static constexpr int kWeights = 32, kBytes = 18;
  static constexpr int kGroup = 32;
  static constexpr bool kOffset = false;
  static constexpr bool kSigned = true;
  static constexpr int kMaxQ = 127;
  static void scales(const uint8_t* b, float* D, float* M) { fill(D, M, 2, f16(b), 0.f); }
  static void decode(const uint8_t* b, int8_t* q) {
    for (int j = 0; j < 16; ++j) q[j] = kIq4Values[b[2 + j] & 15], q[j + 16] = kIq4Values[b[2 + j] >> 4];
  }
#ifdef BLOCKS_AVX2
  static __m256i chunk(const uint8_t* b, int) { return iq4_lookup(nibbles(b + 2)); }
#endif
};

// The 2-bit fields of Q2_K / Q3_K: weight i = 128 h + 32 g + l is bits 2g.. of byte 32 h + l.
inline void crumbs256(const uint8_t* qs, int8_t* q) {
  for (int h = 0; h < 2; ++h)
    for (int g = 0; g < 4; ++g)
      for (int l = 0; l < 32; ++l) q[128 * h + 32 * g + l] = static_cast<int8_t>((qs[32 * h + l] >> (2 * g)) & 3);
}

struct Q2_K {
  static constexpr int kWeights = 256, kBytes = 84;
  static constexpr int kGroup = 16;
  static constexpr bool kOffset = true;
  static constexpr bool kSigned = false;
  static constexpr int kMaxQ = 3;
  static void scales(const uint8_t* b, float* D, float* M) {
    const float d = f16(b + 80), dmin = f16(b + 82);
    for (int s = 0; s < 16; ++s) D[s] = d * static_cast<float>(b[s] & 15), M[s] = -(dmin * static_cast<float>(b[s] >> 4));
  }
  static void decode(const uint8_t* b, int8_t* q) { crumbs256(b + 16, q); }
#ifdef BLOCKS_AVX2
  // chunk c = 4 h + g: bits 2g of the 32 bytes of half h
  static __m256i chunk(const uint8_t* b, int c) { return field(load32(b + 16 + 32 * (c / 4)), 2 * (c % 4), 3); }
#endif
};

struct Q3_K {
  static constexpr int kWeights = 256, kBytes = 110;
  static constexpr int kGroup = 16;
  static constexpr bool kOffset = false;
  static constexpr bool kSigned = true;
  static constexpr int kMaxQ = 4;
  static void scales(const uint8_t* b, float* D, float* M) {
    const uint8_t* sc = b + 96;
    const float d = f16(b + 108);
    for (int s = 0; s < 16; ++s) {
      const int lo = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4;
      const int hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
      D[s] = d * static_cast<float>((lo | (hi << 4)) - 32), M[s] = 0.f;
    }
  }
#ifdef BLOCKS_AVX2
  // chunk c: the 2-bit fields as Q2_K, minus 4 where bit c of the mask bytes is clear
  static __m256i chunk(const uint8_t* b, int c) {
    const __m256i low = field(load32(b + 32 + 32 * (c / 4)), 2 * (c % 4), 3);
    const __m256i clear = _mm256_andnot_si256(field(load32(b), c, 1), bytes(1));
    return _mm256_sub_epi8(low, _mm256_slli_epi16(clear, 2));
  }
#endif
  static void decode(const uint8_t* b, int8_t* q) {
    const uint8_t* hmask = b;
    crumbs256(b + 32, q);
    for (int i = 0; i < 256; ++i) q[i] = static_cast<int8_t>(q[i] - (((hmask[i % 32] >> (i / 32)) & 1) ? 0 : 4));
  }
};

// Q4_K / Q5_K's 6-bit scale and min of sub-block j (of 8), from their 12 packed bytes.
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63, mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30);
    mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

// The same fields in general-purpose registers: sc (8 bytes, sub-block 0 lowest) and mn. A decode pass
// is short of vector ports, not of integer ones; 32-bit shifts leak bits only into masked ones.
inline void q4k_scale_words(const uint8_t* s, uint64_t& sc, uint64_t& mn) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
  sc = (u[0] & low6) | static_cast<uint64_t>((u[2] & low4) | (((u[0] >> 6) & top2) << 4)) << 32;
  mn = (u[1] & low6) | static_cast<uint64_t>(((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4)) << 32;
}

#ifdef BLOCKS_AVX2
// Q4_K's 12 bytes of 6-bit scales and mins as 8 scale bytes, then 8 min bytes (scale_min_k4's fields).
inline __m128i q4k_scale_bytes(const uint8_t* s) {
  // reads 16 bytes: the block's quants follow its 12 scale bytes
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i nib = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
  const __m128i high_nib = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
  // 16-bit shifts leak a neighbour's bits only into bits the masks drop
  const __m128i bits = _mm_or_si128(_mm_and_si128(low, nib), _mm_and_si128(_mm_srli_epi16(low, 4), high_nib));
  return _mm_or_si128(bits, _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
}
#endif

template <bool FifthBit>
struct QK45 {
  static constexpr int kWeights = 256, kBytes = FifthBit ? 176 : 144;
  static constexpr int kGroup = 32;
  static constexpr bool kOffset = true;
  static constexpr bool kSigned = false;
  static constexpr int kMaxQ = FifthBit ? 31 : 15;
  static void scales(const uint8_t* b, float* D, float* M) {
    const float d = f16(b), dmin = f16(b + 2);
    for (int c = 0; c < 8; ++c) {
      int sc, mn;
      scale_min_k4(b + 4, c, sc, mn);
      fill(D + 2 * c, M + 2 * c, 2, d * static_cast<float>(sc), -(dmin * static_cast<float>(mn)));
    }
  }
#ifdef BLOCKS_AVX2
  // D and M of the block's 8 groups, in vectors: the same float32 products as scales'.
  static void group_scales(const uint8_t* b, float* D, float* M) {
    const __m128i sb = q4k_scale_bytes(b + 4);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sb));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sb, 8)));
    _mm256_storeu_ps(D, _mm256_mul_ps(_mm256_set1_ps(f16(b)), sc));
    _mm256_storeu_ps(M, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(f16(b + 2)), mn), _mm256_set1_ps(-0.f)));
  }
  static __m256i chunk(const uint8_t* b, int c) {
    const __m256i q = field(load32(b + (FifthBit ? 48 : 16) + 32 * (c / 2)), 4 * (c % 2), 15);
    if (!FifthBit) return q;
    return _mm256_or_si256(q, _mm256_slli_epi16(field(load32(b + 16), c, 1), 4));
  }
#endif
  static void decode(const uint8_t* b, int8_t* q) {
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (FifthBit ? 48 : 16);
    for (int c = 0; c < 8; ++c) {
      const uint8_t* src = qs + 32 * (c / 2);
      const int shift = 4 * (c % 2);
      for (int l = 0; l < 32; ++l) {
        int v = (src[l] >> shift) & 15;
        if (FifthBit) v |= ((qh[l] >> c) & 1) << 4;
        q[32 * c + l] = static_cast<int8_t>(v);
      }
    }
  }
};

struct Q6_K {
  static constexpr int kWeights = 256, kBytes = 210;
  static constexpr int kGroup = 16;
  static constexpr bool kOffset = false;
  static constexpr bool kSigned = true;
  static constexpr int kMaxQ = 32;
  static void scales(const uint8_t* b, float* D, float* M) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    for (int s = 0; s < 16; ++s) D[s] = d * static_cast<float>(sc[s]), M[s] = 0.f;
  }
#ifdef BLOCKS_AVX2
  static void group_scales(const uint8_t* b, float* D, float* M) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256 d = _mm256_set1_ps(f16(b + 208));
    _mm256_storeu_ps(D, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_storeu_ps(D + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    _mm256_storeu_ps(M, _mm256_setzero_ps()), _mm256_storeu_ps(M + 8, _mm256_setzero_ps());
  }
  // Chunk c's quants as stored, 0..63: the high bits 2g and 2g + 1 reach bits 4 and 5 in one 16-bit
  // shift, which leaks only into bits the mask drops.
  static __m256i unsigned_chunk(const uint8_t* b, int c) {
    const int h = c / 4, g = c % 4;
    const __m256i lo = field(load32(b + 64 * h + 32 * (g % 2)), 4 * (g / 2), 15);
    const __m256i hi = load32(b + 128 + 32 * h);
    const __m256i at45 = g < 2 ? _mm256_slli_epi16(hi, 4 - 2 * g) : _mm256_srli_epi16(hi, 2 * g - 4);
    return _mm256_or_si256(lo, _mm256_and_si256(at45, bytes(0x30)));
  }
  static __m256i chunk(const uint8_t* b, int c) { return _mm256_sub_epi8(unsigned_chunk(b, c), bytes(32)); }
#endif
  static void decode(const uint8_t* b, int8_t* q) {
    const uint8_t *ql = b, *qh = b + 128;
    // weight 128 h + 32 g + l: low nibble (shift 4 (g / 2)) of ql[64 h + 32 (g % 2) + l], high bits
    // (shift 2 g) of qh[32 h + l]
    for (int h = 0; h < 2; ++h)
      for (int g = 0; g < 4; ++g)
        for (int l = 0; l < 32; ++l) {
          const int lo = (ql[64 * h + 32 * (g % 2) + l] >> (4 * (g / 2))) & 15;
          const int hi = (qh[32 * h + l] >> (2 * g)) & 3;
          q[128 * h + 32 * g + l] = static_cast<int8_t>((lo | (hi << 4)) - 32);
        }
  }
};

struct IQ4_XS {
  static constexpr int kWeights = 256, kBytes = 136;
  static constexpr int kGroup = 32;
  static constexpr bool kOffset = false;
  static constexpr bool kSigned = true;
  static constexpr int kMaxQ = 127;
  static void scales(const uint8_t* b, float* D, float* M) {
    const float d = f16(b);
    uint16_t sh;
    std::memcpy(&sh, b + 2, 2);
    const uint8_t* sl = b + 4;
    for (int c = 0; c < 8; ++c) {
      const int ls = ((sl[c / 2] >> (4 * (c % 2))) & 15) | (((sh >> (2 * c)) & 3) << 4);
      fill(D + 2 * c, M + 2 * c, 2, d * static_cast<float>(ls - 32), 0.f);
    }
  }
#ifdef BLOCKS_AVX2
  static __m256i chunk(const uint8_t* b, int c) { return iq4_lookup(nibbles(b + 8 + 16 * c)); }
#endif
  static void decode(const uint8_t* b, int8_t* q) {
    const uint8_t* qs = b + 8;
    for (int c = 0; c < 8; ++c) {
      for (int l = 0; l < 16; ++l) {
        q[32 * c + l] = kIq4Values[qs[16 * c + l] & 15];
        q[32 * c + l + 16] = kIq4Values[qs[16 * c + l] >> 4];
      }
    }
  }
};

// D and M of a block's kWeights / kGroup scale groups: a type's own vector decoder where it has one.
template <typename T, typename = void>
struct has_group_scales : std::false_type {};
template <typename T>
struct has_group_scales<T, std::void_t<decltype(&T::group_scales)>> : std::true_type {};

template <typename T>
inline void group_scales(const uint8_t* b, float* D, float* M) {
  if constexpr (has_group_scales<T>::value) {
    T::group_scales(b, D, M);
  } else {
    float d[16], m[16];
    T::scales(b, d, m);
    for (int j = 0; j < T::kWeights / T::kGroup; ++j) D[j] = d[j * T::kGroup / 16], M[j] = m[j * T::kGroup / 16];
  }
}

// Calls f(T{}) with the decoder of `format`; false where the format is not a raw block type.
template <typename F>
bool with_type(const std::string& format, const F& f) {
  if (format == "Q4_0") return f(Q4_0{}), true;
  if (format == "Q5_0") return f(Q5<false>{}), true;
  if (format == "Q5_1") return f(Q5<true>{}), true;
  if (format == "IQ4_NL") return f(IQ4_NL{}), true;
  if (format == "Q2_K") return f(Q2_K{}), true;
  if (format == "Q3_K") return f(Q3_K{}), true;
  if (format == "Q4_K") return f(QK45<false>{}), true;
  if (format == "Q5_K") return f(QK45<true>{}), true;
  if (format == "Q6_K") return f(Q6_K{}), true;
  if (format == "IQ4_XS") return f(IQ4_XS{}), true;
  return false;
}

}  // namespace blocks
