// Attention over the paged KV pool, read in place: single-token rows (decode) and causal prompt rows.
// A pool holds K or V as float32, bfloat16 or float16, or as q8_0 blocks (T, engine.kv_dtype): a 16-bit
// pool halves what attention reads and the memory a token takes, q8_0 about halves it again. Rows are
// converted to float32 as they are read; scores, softmax and sums are float32 either way.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "pool.h"
#include "vmath.h"

namespace {

// 32 values of a q8_0 pool row, llama.cpp's block_q8_0: a float16 scale d, then 32 int8 quants q; each
// value is q * d. A row of D values is D / 32 blocks (rtserver/engine/kv_rows.py writes the same bytes).
constexpr int64_t kQ8 = 32;
struct Q8Block {
  c10::Half d;
  int8_t qs[kQ8];
};
static_assert(sizeof(Q8Block) == 34, "a q8_0 block is 34 bytes, packed");

// The elements of T a pool row of D values takes: D, or D / 32 q8_0 blocks.
template <typename T>
constexpr int64_t kv_units(int64_t D) {
  if constexpr (std::is_same_v<T, Q8Block>) return D / kQ8;
  else return D;
}

inline float q8_scale(const Q8Block& b) {
#if defined(__F16C__)
  return _cvtsh_ss(b.d.x);
#else
  return static_cast<float>(b.d);
#endif
}

// n KV values as floats: the pool's own row for float32, else converted into tmp (q8_0: each quant
// times its block's scale).
inline const float* kv_row(const Q8Block* src, int64_t n, float* tmp) {
  for (int64_t b = 0; b < n / kQ8; ++b) {
    const float d = q8_scale(src[b]);
    for (int64_t j = 0; j < kQ8; ++j) tmp[b * kQ8 + j] = static_cast<float>(src[b].qs[j]) * d;
  }
  return tmp;
}

template <typename T>
inline const float* kv_row(const T* src, int64_t n, float* tmp) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      if constexpr (std::is_same_v<T, c10::Half>)
        _mm256_storeu_ps(tmp + i, _mm256_cvtph_ps(h));
      else
        _mm256_storeu_ps(tmp + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
#endif
    for (; i < n; ++i) tmp[i] = static_cast<float>(src[i]);
    return tmp;
  }
}

// n floats into KV elements, rounded to nearest even as torch's casts round.
template <typename T>
inline void kv_store(const float* src, int64_t n, T* dst) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (std::is_same_v<T, c10::Half>) {
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // the upper 16 bits, rounded to nearest even; a NaN stays a (quiet) NaN, as c10's conversion does
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF), qnan = _mm256_set1_epi32(0x7FC0);
    for (; i + 8 <= n; i += 8) {
      const __m256 x = _mm256_loadu_ps(src + i);
      const __m256i b = _mm256_castps_si256(x);
      __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(b, 16), one))), 16);
      r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
      const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), packed);
    }
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// n floats (whole blocks) into q8_0 blocks as llama.cpp's quantize_row_q8_0_ref: d = max|x| / 127, quants
// round(x / d) half away from zero, d stored as float16. A block whose 1 / d is not finite (all zero, or
// too small for a float16 scale) gets zero quants rather than an overflowing conversion.
inline void kv_store(const float* src, int64_t n, Q8Block* dst) {
  for (int64_t b = 0; b < n / kQ8; ++b) {
    const float* x = src + b * kQ8;
    float amax = 0.f;
    for (int64_t j = 0; j < kQ8; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.f;
    float id = 1.f / d;
    if (!std::isfinite(id)) id = 0.f;
    dst[b].d = c10::Half(d);
    for (int64_t j = 0; j < kQ8; ++j) dst[b].qs[j] = static_cast<int8_t>(std::round(x[j] * id));
  }
}

// One register of floats and what the decode attention does with it: AVX-512's 16 lanes, or AVX2's 8.
#if defined(__AVX512F__)
struct Wide {
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* x) { return _mm512_loadu_ps(x); }
  static void store(float* x, V v) { _mm512_storeu_ps(x, v); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  // The 16 KV values of a pool row from column c (a multiple of 16) as one float vector.
  static V kv(const float* row, int64_t c) { return _mm512_loadu_ps(row + c); }
  static V kv(const c10::BFloat16* row, int64_t c) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V kv(const c10::Half* row, int64_t c) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c)));
  }
  static V kv(const Q8Block* row, int64_t c) {
    const Q8Block& b = row[c / kQ8];
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + c % kQ8));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(q8_scale(b)));
  }
  // v[0..16) -> one vector of their lane sums, v[j]'s in lane j (v is overwritten).
  static V sums(V* v) {
    for (int i = 0; i < 8; ++i)
      v[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
      const __m512d a = _mm512_castps_pd(v[2 * i]), b = _mm512_castps_pd(v[2 * i + 1]);
      v[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; ++i)
      v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
  }
};
#define RTSERVER_WIDE_ATTENTION 1
#elif defined(__AVX2__) && defined(__F16C__)
struct Wide {
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* x) { return _mm256_loadu_ps(x); }
  static void store(float* x, V v) { _mm256_storeu_ps(x, v); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  // The 8 KV values of a pool row from column c (a multiple of 8) as one float vector.
  static V kv(const float* row, int64_t c) { return _mm256_loadu_ps(row + c); }
  static V kv(const c10::BFloat16* row, int64_t c) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V kv(const c10::Half* row, int64_t c) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
  }
  static V kv(const Q8Block* row, int64_t c) {
    const Q8Block& b = row[c / kQ8];
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs + c % kQ8));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(q8_scale(b)));
  }
  // v[0..8) -> one vector of their lane sums, v[j]'s in lane j (v is overwritten).
  static V sums(V* v) {
    for (int i = 0; i < 4; ++i) v[i] = _mm256_hadd_ps(v[2 * i], v[2 * i + 1]);
    const V lo = _mm256_hadd_ps(v[0], v[1]), hi = _mm256_hadd_ps(v[2], v[3]);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
  }
};
#define RTSERVER_WIDE_ATTENTION 1
#endif

#ifdef RTSERVER_WIDE_ATTENTION
// The `units` elements at each of positions [j0, j1) of a context, fetched ahead of their use (every
// cache line they touch: a q8_0 row need not start on one).
template <typename T>
inline void prefetch_rows(const T* base, const int64_t* sl, int64_t j0, int64_t j1, int64_t stride, int64_t units) {
  const int64_t bytes = units * static_cast<int64_t>(sizeof(T));
  for (int64_t j = j0; j < j1; ++j) {
    const char* row = reinterpret_cast<const char*>(base + sl[j] * stride);
    for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(row + c, _MM_HINT_T1);
    if (bytes % 64) _mm_prefetch(row + bytes - 1, _MM_HINT_T1);
  }
}

// o[i] = sum_j w[i][j] v_j over a context, for NI heads and CW registers of floats from column c0.
template <int NI, int CW, typename T>
void weigh_values(const T* V, const int64_t* sl, int64_t L, int64_t stride, int64_t c0, const float* w,
                  int64_t Lpad, float* o, int64_t D) {
  constexpr int64_t W = Wide::kWidth;
  Wide::V acc[NI][CW];
  for (int i = 0; i < NI; ++i)
    for (int c = 0; c < CW; ++c) acc[i][c] = Wide::zero();
  for (int64_t j = 0; j < L; ++j) {
    const T* v = V + sl[j] * stride;
    Wide::V vv[CW];
    for (int c = 0; c < CW; ++c) vv[c] = Wide::kv(v, c0 + W * c);
    for (int i = 0; i < NI; ++i) {
      const Wide::V wi = Wide::set1(w[i * Lpad + j]);
      for (int c = 0; c < CW; ++c) acc[i][c] = Wide::fmadd(wi, vv[c], acc[i][c]);
    }
  }
  for (int i = 0; i < NI; ++i)
    for (int c = 0; c < CW; ++c) Wide::store(o + i * D + c0 + W * c, acc[i][c]);
}

template <int NI, typename T>
void weigh_values(const T* V, const int64_t* sl, int64_t L, int64_t stride, const float* w, int64_t Lpad,
                  float* o, int64_t D) {
  constexpr int64_t W = Wide::kWidth;
  int64_t c0 = 0;
  for (; c0 + 4 * W <= D; c0 += 4 * W) weigh_values<NI, 4, T>(V, sl, L, stride, c0, w, Lpad, o, D);
  for (; c0 < D; c0 += W) weigh_values<NI, 1, T>(V, sl, L, stride, c0, w, Lpad, o, D);
}
#endif

// Query heads q [span * n, D] over a context of L slots sl, head i reading KV head i / n of the span
// (K at K + slot * stride + (i / n) * U, V likewise; U = kv_units<T>(D)): softmax(q k * sc) v into o
// [span * n, D]. p [span * n, Lpad] is scratch. The span's K/V of a slot are contiguous: prefetched
// whole, in slot order.
template <typename T>
void head_group(const float* q, int64_t n, int64_t span, const int64_t* sl, int64_t L, const T* K,
                const T* V, int64_t stride, int64_t D, float sc, float* p, int64_t Lpad, float* o) {
  const int64_t Ln = (L + kLanes - 1) / kLanes * kLanes, heads = span * n, U = kv_units<T>(D);
#ifdef RTSERVER_WIDE_ATTENTION
  constexpr int64_t W = Wide::kWidth;
  const bool vectors = D % W == 0;
#else
  const bool vectors = false;
#endif
  if (vectors) {
#ifdef RTSERVER_WIDE_ATTENTION
    // Scores W positions at a time: a register of lane sums each (W independent chains), summed
    // together by Wide::sums. Positions past L repeat the last key; their scores are dropped below.
    for (int64_t j0 = 0; j0 < L; j0 += W) {
      const T* k[W];
      for (int64_t jj = 0; jj < W; ++jj) k[jj] = K + sl[std::min(j0 + jj, L - 1)] * stride;
      const int64_t next = std::min(L, j0 + W), next_end = std::min(L, j0 + 2 * W), m = next - j0;
      for (int64_t i = 0; i < heads; ++i) {
        // A share of the slots a head: the next block's keys, and this block's values (read after the
        // softmax, from cache).
        prefetch_rows(K, sl, next + (next_end - next) * i / heads, next + (next_end - next) * (i + 1) / heads,
                      stride, span * U);
        prefetch_rows(V, sl, j0 + m * i / heads, j0 + m * (i + 1) / heads, stride, span * U);
        const float* qi = q + i * D;
        const int64_t at = i / n * U;
        Wide::V acc[W];
        for (int jj = 0; jj < W; ++jj) acc[jj] = Wide::zero();
        for (int64_t c = 0; c < D; c += W) {
          const Wide::V qc = Wide::load(qi + c);
          for (int jj = 0; jj < W; ++jj) acc[jj] = Wide::fmadd(qc, Wide::kv(k[jj] + at, c), acc[jj]);
        }
        Wide::store(p + i * Lpad + j0, Wide::mul(Wide::sums(acc), Wide::set1(sc)));
      }
    }
#endif
  } else {
    std::vector<float> row(std::is_same_v<T, float> ? 0 : D);
    for (int64_t j = 0; j < L; ++j)
      for (int64_t g = 0; g < span; ++g) {
        const float* k = kv_row(K + sl[j] * stride + g * U, D, row.data());
        for (int64_t i = g * n; i < (g + 1) * n; ++i) p[i * Lpad + j] = dot(q + i * D, k, D) * sc;
      }
  }
  for (int64_t i = 0; i < heads; ++i) {  // p <- softmax weights
    float* pi = p + i * Lpad;
    std::fill(pi + L, pi + Ln, -INFINITY);
    const float inv = 1.f / exp_shifted(pi, Ln);
    for (int64_t j = 0; j < L; ++j) pi[j] *= inv;
  }
  if (vectors) {
#ifdef RTSERVER_WIDE_ATTENTION
    for (int64_t g = 0; g < span; ++g) {
      const T* Vg = V + g * U;
      const float* w = p + g * n * Lpad;
      float* og = o + g * n * D;
      int64_t i0 = 0;
      for (; i0 + 4 <= n; i0 += 4) weigh_values<4>(Vg, sl, L, stride, w + i0 * Lpad, Lpad, og + i0 * D, D);
      switch (n - i0) {
        case 3: weigh_values<3>(Vg, sl, L, stride, w + i0 * Lpad, Lpad, og + i0 * D, D); break;
        case 2: weigh_values<2>(Vg, sl, L, stride, w + i0 * Lpad, Lpad, og + i0 * D, D); break;
        case 1: weigh_values<1>(Vg, sl, L, stride, w + i0 * Lpad, Lpad, og + i0 * D, D); break;
        default: break;
      }
    }
#endif
  } else {
    std::vector<float> row(std::is_same_v<T, float> ? 0 : D);
    std::fill(o, o + heads * D, 0.f);
    for (int64_t j = 0; j < L; ++j)
      for (int64_t g = 0; g < span; ++g) {
        const float* v = kv_row(V + sl[j] * stride + g * U, D, row.data());
        for (int64_t i = g * n; i < (g + 1) * n; ++i) {
          const float w = p[i * Lpad + j];
          float* oi = o + i * D;
          for (int64_t d = 0; d < D; ++d) oi[d] += w * v[d];
        }
      }
  }
}

// Attention of single-token queries over contexts read in place from a paged pool. q [R, H, D] rows,
// pools [slots, KV, D]; context(r) is row r's context as (its first slot's address, length), at most
// Lmax (checked by the caller). With rows enough for the threads, a task per row reads each of its
// K/V slots whole (every KV head, in order: the prefetches follow); else a task per (row, KV head)
// computes the H / KV query heads that share that K/V, split further while threads would be idle.
// Every head's arithmetic is the same either way.
template <typename T, typename Context>
void attention(const float* Q, const T* Kp, const T* Vp, int64_t R, int64_t H, int64_t KV, int64_t D,
               int64_t Lmax, float sc, float* O, const Context& context) {
  const int64_t G = H / KV, want = 2 * pool::num_threads(), U = kv_units<T>(D);
  const int64_t span = R >= want ? KV : 1, pairs = R * (KV / span);  // KV heads a task
  const int64_t split = span > 1 || pairs >= want ? 1 : std::min(G, (want + pairs - 1) / pairs);
  const int64_t per = (G + split - 1) / split;
  pool::parallel_for(0, pairs * split, 1, [&](int64_t t0, int64_t t1) {
    const int64_t Lpad = (Lmax + 15) / 16 * 16;  // whole vectors of scores
    std::vector<float> p(span * per * Lpad);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pair = t / split, r = pair / (KV / span), kv0 = pair % (KV / span) * span;
      const auto [sl, L] = context(r);
      const int64_t g0 = t % split * per, n = std::min(G, g0 + per) - g0, h0 = kv0 * G + g0;
      head_group(Q + (r * H + h0) * D, n, span, sl, L, Kp + kv0 * U, Vp + kv0 * U, KV * U, D, sc, p.data(), Lpad,
                 O + (r * H + h0) * D);
    }
  });
}

// Rows' contexts as the attention routines read them: row r is at position PS[r] of item IT[r], whose
// context slots are TB[IT[r] * Lmax ...] from position 0 (row_contexts checks them). A step's prompt
// rows, or a decode group's, one item a row.
struct RowContexts {
  const int64_t *TB, *IT, *PS;
  int64_t B, Lmax, window;
  int64_t first(int64_t r) const { return window > 0 ? std::max<int64_t>(0, PS[r] - window + 1) : 0; }
  // Row r's context: its first slot's address and length.
  std::pair<const int64_t*, int64_t> operator()(int64_t r) const {
    return {TB + IT[r] * Lmax + first(r), PS[r] - first(r) + 1};
  }
};

// One vector register of floats (GCC vector arithmetic). A chain wider than the registers would keep
// block_attention's sums on the stack.
#if defined(__AVX512F__)
typedef float Chain __attribute__((vector_size(64)));
#else
typedef float Chain __attribute__((vector_size(32)));
#endif
constexpr int64_t kChain = sizeof(Chain) / sizeof(float);  // floats a chain holds

inline Chain load_chain(const float* x) {
  Chain c;
  std::memcpy(&c, x, sizeof c);
  return c;
}

// A block of rows, NG query heads each of one KV head, over a copied context: qs [rows, NG, D] the queries
// times the scale, kt the keys transposed [D, npad], vrows[j] each value as floats. Row r reads keys [a[r],
// e[r]); o[r * NG + h] is its head h's output [D]. p [rows, NG, npad] is scratch. Loops go tile by tile
// (two chains of keys, then of values' columns) over every row, so a tile is read from L1 by all of
// them. The heads share every load, and their sums run side by side (NG * 2 chains), so no add waits on
// the one before.
template <int NG>
__attribute__((optimize("fp-contract=fast")))  // each a * b + c one fused multiply-add
void block_attention(const float* qs, int64_t rows, const int64_t* a, const int64_t* e, const float* kt,
                     int64_t npad, const std::vector<const float*>& vrows, int64_t D, float* p, float* const* o) {
  constexpr int64_t kTile = 2 * kChain;
  for (int64_t j0 = 0; j0 < npad; j0 += kTile) {  // a tile of keys' scores, two chains a head
    for (int64_t r = 0; r < rows; ++r) {
      const float* q = qs + r * NG * D;
      Chain acc[NG][2] = {};
      for (int64_t d = 0; d < D; ++d) {
        const Chain k0 = load_chain(kt + d * npad + j0), k1 = load_chain(kt + d * npad + j0 + kChain);
        for (int h = 0; h < NG; ++h) {
          acc[h][0] += q[h * D + d] * k0;
          acc[h][1] += q[h * D + d] * k1;
        }
      }
      for (int h = 0; h < NG; ++h) std::memcpy(p + (r * NG + h) * npad + j0, acc[h], sizeof acc[h]);
    }
  }
  for (int64_t r = 0; r < rows; ++r)  // softmax weights
    for (int h = 0; h < NG; ++h) {
      float* ph = p + (r * NG + h) * npad;
      std::fill(ph, ph + a[r], -INFINITY);
      std::fill(ph + e[r], ph + npad, -INFINITY);
      const float inv = 1.f / exp_shifted(ph, npad);
      for (int64_t j = a[r]; j < e[r]; ++j) ph[j] *= inv;
    }
  int64_t d0 = 0;
  for (; d0 + kTile <= D; d0 += kTile)  // a tile of outputs a head in two chains
    for (int64_t r = 0; r < rows; ++r) {
      const float* pr = p + r * NG * npad;
      Chain acc[NG][2] = {};
      for (int64_t j = a[r]; j < e[r]; ++j) {
        const Chain v0 = load_chain(vrows[j] + d0), v1 = load_chain(vrows[j] + d0 + kChain);
        for (int h = 0; h < NG; ++h) {
          acc[h][0] += pr[h * npad + j] * v0;
          acc[h][1] += pr[h * npad + j] * v1;
        }
      }
      for (int h = 0; h < NG; ++h) std::memcpy(o[r * NG + h] + d0, acc[h], sizeof acc[h]);
    }
  for (int64_t r = 0; r < rows && d0 < D; ++r)  // a head size that is no whole number of tiles
    for (int h = 0; h < NG; ++h) {
      float* out = o[r * NG + h];
      std::fill(out + d0, out + D, 0.f);
      for (int64_t j = a[r]; j < e[r]; ++j)
        for (int64_t d = d0; d < D; ++d) out[d] += p[(r * NG + h) * npad + j] * vrows[j][d];
    }
}

// Causal attention of prompt rows over a paged pool: row r attends to positions max(0, PS[r] - window
// + 1) (0 without a window) to PS[r] of its item. A task per (item, KV head, block of the item's rows)
// copies the keys its rows read once, transposed, so that the scores of a query are vectors over keys
// and no dot product ends in a horizontal sum. Items with few rows are cut into smaller blocks, so that
// every thread has tasks.
template <typename T>
void causal_attention(const float* Q, const T* Kp, const T* Vp, const RowContexts& c, int64_t R,
                      int64_t H, int64_t KV, int64_t D, float sc, float* O) {
  const int64_t *TB = c.TB, *IT = c.IT, *PS = c.PS, B = c.B, Lmax = c.Lmax;
  constexpr int64_t kBlockRows = 32, kMinRows = 4, kHeads = 4;
  std::vector<std::vector<int64_t>> rows(B);
  for (int64_t r = 0; r < R; ++r) rows[IT[r]].push_back(r);
  const int64_t want = 2 * pool::num_threads(), per_item = (want + B * KV - 1) / (B * KV);
  std::vector<std::tuple<int64_t, int64_t, int64_t>> blocks;  // (item, first of its rows, one past its last)
  for (int64_t b = 0; b < B; ++b) {
    const int64_t m = static_cast<int64_t>(rows[b].size());
    const int64_t parts = std::max((m + kBlockRows - 1) / kBlockRows, std::min(per_item, m / kMinRows));
    const int64_t size = parts > 0 ? (m + parts - 1) / parts : m;
    for (int64_t i = 0; i < m; i += size) blocks.emplace_back(b, i, std::min(m, i + size));
  }
  const int64_t G = H / KV, tasks = static_cast<int64_t>(blocks.size()) * KV, U = kv_units<T>(D);
  pool::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> kt, p, vt, krow, qs;  // vt: a 16-bit or q8_0 pool's values, as floats
    std::vector<const float*> vrows;
    std::vector<float*> outs;
    std::vector<int64_t> starts, ends;
    for (int64_t t = t0; t < t1; ++t) {
      const auto [b, i0, i1] = blocks[t / KV];
      const int64_t kv = t % KV;
      int64_t lo = Lmax, hi = 0;  // the keys the block's rows read: [lo, hi)
      for (int64_t i = i0; i < i1; ++i) lo = std::min(lo, c.first(rows[b][i])), hi = std::max(hi, PS[rows[b][i]] + 1);
      const int64_t n = hi - lo, npad = (n + 31) / 32 * 32;
      const int64_t* sl = TB + b * Lmax + lo;
      kt.resize(D * npad);
      krow.resize(16 * D);
      for (int64_t j0 = 0; j0 < npad; j0 += 16) {  // 16 keys as floats, then their columns: whole lines
        const int64_t got = std::max<int64_t>(0, std::min<int64_t>(16, n - j0));
        for (int64_t jj = 0; jj < got; ++jj) {
          const float* k = kv_row(Kp + (sl[j0 + jj] * KV + kv) * U, D, krow.data() + jj * D);
          if (k != krow.data() + jj * D) std::memcpy(krow.data() + jj * D, k, D * sizeof(float));
        }
        std::fill(krow.begin() + got * D, krow.end(), 0.f);  // keys past n score 0
        for (int64_t d = 0; d < D; ++d)
          for (int64_t jj = 0; jj < 16; ++jj) kt[d * npad + j0 + jj] = krow[jj * D + d];
      }
      if (!std::is_same_v<T, float>) vt.resize(n * D);
      vrows.resize(n);
      for (int64_t j = 0; j < n; ++j) vrows[j] = kv_row(Vp + (sl[j] * KV + kv) * U, D, vt.data() + j * D);
      const int64_t m = i1 - i0;
      starts.resize(m);
      ends.resize(m);
      for (int64_t i = 0; i < m; ++i) {  // keys [a, e) of the copy
        starts[i] = c.first(rows[b][i0 + i]) - lo;
        ends[i] = PS[rows[b][i0 + i]] + 1 - lo;
      }
      for (int64_t g0 = 0; g0 < G; g0 += kHeads) {
        const int64_t ng = std::min(kHeads, G - g0);
        qs.resize(m * ng * D);
        p.resize(m * ng * npad);
        outs.resize(m * ng);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t h = 0; h < ng; ++h) {
            const int64_t at = (rows[b][i0 + i] * H + kv * G + g0 + h) * D;
            for (int64_t d = 0; d < D; ++d) qs[(i * ng + h) * D + d] = Q[at + d] * sc;
            outs[i * ng + h] = O + at;
          }
        const float* k = kt.data();
        switch (ng) {
          case 4: block_attention<4>(qs.data(), m, starts.data(), ends.data(), k, npad, vrows, D, p.data(), outs.data()); break;
          case 3: block_attention<3>(qs.data(), m, starts.data(), ends.data(), k, npad, vrows, D, p.data(), outs.data()); break;
          case 2: block_attention<2>(qs.data(), m, starts.data(), ends.data(), k, npad, vrows, D, p.data(), outs.data()); break;
          default: block_attention<1>(qs.data(), m, starts.data(), ends.data(), k, npad, vrows, D, p.data(), outs.data()); break;
        }
      }
    }
  });
}

}  // namespace

namespace {

void check_context(const torch::Tensor& slots, const torch::Tensor& lengths, int64_t R, int64_t S) {
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.dim() == 2 &&
                  slots.size(0) == R && lengths.scalar_type() == torch::kInt64 && lengths.numel() == R,
              "slots must be int64 [R, Lmax], lengths int64 [R]");
  const int64_t Lmax = slots.size(1);
  const int64_t* SL = slots.data_ptr<int64_t>();
  const int64_t* LN = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(LN[r] >= 1 && LN[r] <= Lmax, "a context length is outside [1, Lmax]");
    for (int64_t j = 0; j < LN[r]; ++j)
      TORCH_CHECK(SL[r * Lmax + j] >= 0 && SL[r * Lmax + j] < S, "a context slot is outside the pool");
  }
}

// A uint8 pool holds q8_0 rows: D / 32 blocks of 34 bytes a row.
void check_pools(const torch::Tensor& k_pool, const torch::Tensor& v_pool, int64_t D) {
  const auto t = k_pool.scalar_type();
  const bool q8 = t == torch::kByte;
  TORCH_CHECK(!q8 || D % kQ8 == 0, "a q8_0 pool needs a head size that is a multiple of 32");
  const int64_t width = q8 ? D / kQ8 * static_cast<int64_t>(sizeof(Q8Block)) : D;
  TORCH_CHECK((t == torch::kFloat32 || t == torch::kBFloat16 || t == torch::kFloat16 || q8) && v_pool.scalar_type() == t &&
                  k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 3 &&
                  k_pool.sizes() == v_pool.sizes() && k_pool.size(2) == width,
              "pools must be contiguous [slots, KV, D] of one type: float32, bfloat16 or float16, or uint8 "
              "[slots, KV, D / 32 * 34] of q8_0 rows");
}

// f(K, V) with the pools' element pointers as their type (check_pools checked it).
template <typename Fn>
void with_pools(const torch::Tensor& k_pool, const torch::Tensor& v_pool, const Fn& f) {
  switch (k_pool.scalar_type()) {
    case torch::kBFloat16: f(k_pool.data_ptr<c10::BFloat16>(), v_pool.data_ptr<c10::BFloat16>()); break;
    case torch::kFloat16: f(k_pool.data_ptr<c10::Half>(), v_pool.data_ptr<c10::Half>()); break;
    case torch::kByte:
      f(reinterpret_cast<Q8Block*>(k_pool.data_ptr<uint8_t>()), reinterpret_cast<Q8Block*>(v_pool.data_ptr<uint8_t>()));
      break;
    default: f(k_pool.data_ptr<float>(), v_pool.data_ptr<float>()); break;
  }
}

}  // namespace

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                               torch::Tensor slots, torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q must be float32 [R, H, D]");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  check_pools(k_pool, v_pool, D);
  const int64_t KV = k_pool.size(1);
  TORCH_CHECK(H % KV == 0, "head counts do not match");
  check_context(slots, lengths, R, k_pool.size(0));
  auto out = torch::empty_like(q);
  const int64_t *SL = slots.data_ptr<int64_t>(), *LN = lengths.data_ptr<int64_t>(), Lmax = slots.size(1);
  with_pools(k_pool, v_pool, [&](auto* Kp, auto* Vp) {
    attention(q.data_ptr<float>(), Kp, Vp, R, H, KV, D, Lmax, static_cast<float>(scale), out.data_ptr<float>(),
              [&](int64_t r) { return std::pair<const int64_t*, int64_t>{SL + r * Lmax, LN[r]}; });
  });
  return out;
}

RowContexts row_contexts(const torch::Tensor& table, const torch::Tensor& item, const torch::Tensor& position,
                         int64_t window, int64_t R, int64_t S) {
  TORCH_CHECK(table.scalar_type() == torch::kInt64 && table.is_contiguous() && table.dim() == 2,
              "table must be int64 [items, Lmax]");
  TORCH_CHECK(item.scalar_type() == torch::kInt64 && item.numel() == R && position.scalar_type() == torch::kInt64 &&
                  position.numel() == R && item.is_contiguous() && position.is_contiguous(),
              "item and position must be int64 [R]");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  const RowContexts c{table.data_ptr<int64_t>(), item.data_ptr<int64_t>(), position.data_ptr<int64_t>(),
                        table.size(0), table.size(1), window};
  std::vector<int64_t> reach(c.B, 0);  // the context length each item's rows read
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(c.IT[r] >= 0 && c.IT[r] < c.B, "a row's item is outside the table");
    TORCH_CHECK(c.PS[r] >= 0 && c.PS[r] < c.Lmax, "a row's position is outside [0, Lmax)");
    reach[c.IT[r]] = std::max(reach[c.IT[r]], c.PS[r] + 1);
  }
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t j = 0; j < reach[b]; ++j)
      TORCH_CHECK(c.TB[b * c.Lmax + j] >= 0 && c.TB[b * c.Lmax + j] < S, "a context slot is outside the pool");
  return c;
}

// Causal attention of prompt rows over the paged pool, read in place: each row attends to its item's
// positions up to its own, the last `window` of them where window > 0 (a sliding-window layer).
torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                const torch::Tensor& table, const torch::Tensor& item, const torch::Tensor& position,
                                int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q must be float32 [R, H, D]");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  check_pools(k_pool, v_pool, D);
  const int64_t KV = k_pool.size(1);
  TORCH_CHECK(H % KV == 0, "head counts do not match");
  const RowContexts c = row_contexts(table, item, position, window, R, k_pool.size(0));
  auto out = torch::empty_like(q);
  with_pools(k_pool, v_pool, [&](auto* Kp, auto* Vp) {
    causal_attention(q.data_ptr<float>(), Kp, Vp, c, R, H, KV, D, static_cast<float>(scale), out.data_ptr<float>());
  });
  return out;
}

// Pool rows copied from slots `src` to slots `dst` of every layer, each key rotated by its row's `shift`
// positions: rotating a key at position p by the angles of d gives the key at p + d (a segment's KV spliced
// into another prompt). Pools are [layers, slots, KV, width]; cos and sin [tables, positions, D] the RoPE
// tables; layer_table [layers] each layer's. Sources and destinations must not overlap.
void move_rows(torch::Tensor k_pool, torch::Tensor v_pool, const torch::Tensor& src, const torch::Tensor& dst,
               const torch::Tensor& shift, const torch::Tensor& cos, const torch::Tensor& sin,
               const torch::Tensor& layer_table) {
  TORCH_CHECK(k_pool.dim() == 4 && cos.dim() == 3 && cos.sizes() == sin.sizes() &&
                  cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "pools must be [layers, slots, KV, width], cos and sin float32 [tables, positions, D]");
  const int64_t L = k_pool.size(0), S = k_pool.size(1), KV = k_pool.size(2), T = cos.size(0), P = cos.size(1);
  const int64_t D = cos.size(2), half = D / 2, n = src.numel();
  check_pools(k_pool[0], v_pool[0], D);
  TORCH_CHECK(src.scalar_type() == torch::kInt64 && dst.scalar_type() == torch::kInt64 &&
                  shift.scalar_type() == torch::kInt64 && dst.numel() == n && shift.numel() == n &&
                  src.is_contiguous() && dst.is_contiguous() && shift.is_contiguous(),
              "src, dst and shift must be int64 [n]");
  TORCH_CHECK(layer_table.scalar_type() == torch::kInt64 && layer_table.numel() == L && layer_table.is_contiguous(),
              "layer_table must be int64 [layers]");
  const int64_t *SR = src.data_ptr<int64_t>(), *DS = dst.data_ptr<int64_t>(), *LT = layer_table.data_ptr<int64_t>();
  const int64_t* SH = shift.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(SR[i] >= 0 && SR[i] < S && DS[i] >= 0 && DS[i] < S && std::abs(SH[i]) < P,
                "a slot is outside the pool, or a shift outside the tables");
  for (int64_t l = 0; l < L; ++l) TORCH_CHECK(LT[l] >= 0 && LT[l] < T, "a layer's table is outside cos");
  const float *C = cos.data_ptr<float>(), *SN = sin.data_ptr<float>();
  with_pools(k_pool, v_pool, [&](auto* Kp, auto* Vp) {
    using E = std::remove_pointer_t<decltype(Kp)>;
    const int64_t W = kv_units<E>(D);  // elements of one head's row
    pool::parallel_for(0, L * n, 16, [&](int64_t a, int64_t b) {
      std::vector<float> x(D), y(D), neg(D);
      for (int64_t t = a; t < b; ++t) {
        const int64_t l = t / n, i = t % n;
        const float *c = C + (LT[l] * P + std::abs(SH[i])) * D, *s = SN + (LT[l] * P + std::abs(SH[i])) * D;
        if (SH[i] < 0) {  // back: the angles negated, sin(-a) = -sin(a)
          for (int64_t d = 0; d < D; ++d) neg[d] = -s[d];
          s = neg.data();
        }
        const int64_t from = (l * S + SR[i]) * KV * W, to = (l * S + DS[i]) * KV * W;
        for (int64_t h = 0; h < KV; ++h) {
          const float* k = kv_row(Kp + from + h * W, D, x.data());
          int64_t j = 0;
          for (; half % kChain == 0 && j < half; j += kChain) {  // the halves layout: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
            const Chain x1 = load_chain(k + j), x2 = load_chain(k + j + half);
            const Chain y1 = x1 * load_chain(c + j) - x2 * load_chain(s + j);
            const Chain y2 = x2 * load_chain(c + j + half) + x1 * load_chain(s + j + half);
            std::memcpy(y.data() + j, &y1, sizeof y1);
            std::memcpy(y.data() + j + half, &y2, sizeof y2);
          }
          for (; j < half; ++j) {
            y[j] = k[j] * c[j] - k[j + half] * s[j];
            y[j + half] = k[j + half] * c[j + half] + k[j] * s[j + half];
          }
          kv_store(y.data(), D, Kp + to + h * W);
        }
        std::memcpy(Vp + to, Vp + from, KV * W * sizeof(E));
      }
    });
  });
}

// Rows x [..., D] (float32) as a q8_0 pool stores them: uint8 [..., D / 32 * 34], the bytes layer_forward
// writes (kv_store); the engine's torch path writes the same bytes (kv_rows.quantize_q8_0).
torch::Tensor quantize_kv(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() >= 1 && x.size(-1) % kQ8 == 0,
              "x must be contiguous float32 [..., D], D a multiple of 32");
  const int64_t D = x.size(-1), R = D ? x.numel() / D : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = D / kQ8 * static_cast<int64_t>(sizeof(Q8Block));
  auto out = torch::empty(shape, x.options().dtype(torch::kByte));
  const float* X = x.data_ptr<float>();
  auto* Y = reinterpret_cast<Q8Block*>(out.data_ptr<uint8_t>());
  pool::parallel_for(0, R, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) kv_store(X + r * D, D, Y + r * (D / kQ8));
  });
  return out;
}
