// Weight-only quantized matmuls over llama.cpp's block formats, float32 activations and results.
//
// A weight keeps the blocks it ships in (a third to a half of float16's bytes), and each block is
// unpacked in registers right before its multiply-adds: batch-1 decoding streams every weight once per
// step, so fewer bytes is what makes a step faster. The block's scale and min are applied to the
// block's partial sums (y = sum_b d_b (q_b . x_b) + m_b sum(x_b)), the same value as a float32 matmul
// of the dequantized weights up to float rounding.
//
// Q4_1: per block of 32 weights: `qs` 16 bytes, byte j holds weight j (low nibble) and j + 16 (high);
//       `dm` two float16: weight = d * q + m.
// Q8_0: per block of 32 weights: `qs` 32 int8, `d` one float16: weight = d * q.
//
// Built at first start with -march=native for the CPU at hand (the cache key names the CPU), and run on
// torch's own thread pool (at::parallel_for), so it never competes with a second OpenMP runtime.

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;

#if defined(__F16C__)
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
#endif

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
inline Vec block_dot(const Vec* w, const float* x) {
  return _mm512_fmadd_ps(w[1], _mm512_loadu_ps(x + 16), _mm512_mul_ps(w[0], _mm512_loadu_ps(x)));
}
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vfma(Vec a, float s, Vec c) { return _mm256_fmadd_ps(a, _mm256_set1_ps(s), c); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
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
inline Vec block_dot(const Vec* w, const float* x) {
  Vec t = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
  for (int i = 1; i < 4; ++i) t = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(x + 8 * i), t);
  return t;
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
inline Vec block_dot(const Vec* w, const float* x) {
  float t = 0.f;
  for (int j = 0; j < 32; ++j) t += w[j].v * x[j];
  return {t};
}
#endif

// Activation rows sharing one pass over the weights: each weight block is read once per R rows, and
// R is a template argument so the accumulators stay in registers.
template <int R, bool HasMin>
void rows_pass(const float* x, const float* xsum, int64_t K, int64_t N, int64_t n0, int64_t n1,
               const uint8_t* Q, const uint16_t* S, int64_t qbytes, float* y) {
  const int64_t nb = K / kBlock;
  constexpr int fields = HasMin ? 2 : 1;
  for (int64_t n = n0; n < n1; ++n) {
    Vec acc[R];
    float msum[R];
    for (int r = 0; r < R; ++r) acc[r] = vzero(), msum[r] = 0.f;
    const uint8_t* q = Q + n * nb * qbytes;
    const uint16_t* s = S + n * nb * fields;
    for (int64_t b = 0; b < nb; ++b) {
      const float d = half_to_float(s[b * fields]);
      Vec w[kParts];  // the block's quants as floats, unpacked once for all R rows
      if (HasMin)
        q4_unpack(q + b * qbytes, w);
      else
        q8_unpack(q + b * qbytes, w);
      for (int r = 0; r < R; ++r) acc[r] = vfma(block_dot(w, x + r * K + b * kBlock), d, acc[r]);
      if (HasMin) {
        const float m = half_to_float(s[b * fields + 1]);
        for (int r = 0; r < R; ++r) msum[r] += m * xsum[r * nb + b];
      }
    }
    for (int r = 0; r < R; ++r) y[r * N + n] = vsum(acc[r]) + msum[r];
  }
}

template <bool HasMin>
void matmul(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* Q, const uint16_t* S,
            int64_t qbytes, float* y) {
  const int64_t nb = K / kBlock;
  std::vector<float> xsum(HasMin ? M * nb : 0);  // Q4_1's min term: each block's activation sum
  for (int64_t i = 0; i < (HasMin ? M * nb : 0); ++i) {
    float t = 0.f;
    for (int j = 0; j < kBlock; ++j) t += x[i * kBlock + j];
    xsum[i] = t;
  }
  // Output rows per task: enough to amortise scheduling, few enough that both threads get work.
  const int64_t grain = std::max<int64_t>(16, N / (4 * at::get_num_threads()));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
      const float* xr = x + r0 * K;
      const float* sr = xsum.data() + (HasMin ? r0 * nb : 0);
      float* yr = y + r0 * N;
      switch (std::min<int64_t>(4, M - r0)) {
        case 1: rows_pass<1, HasMin>(xr, sr, K, N, n0, n1, Q, S, qbytes, yr); break;
        case 2: rows_pass<2, HasMin>(xr, sr, K, N, n0, n1, Q, S, qbytes, yr); break;
        case 3: rows_pass<3, HasMin>(xr, sr, K, N, n0, n1, Q, S, qbytes, yr); break;
        default: rows_pass<4, HasMin>(xr, sr, K, N, n0, n1, Q, S, qbytes, yr); break;
      }
    }
  });
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32");
}

// A weight's blocks for inputs of width K: Q4_1 = 16 bytes of quants and float16 (d, m) per block,
// Q8_0 = 32 bytes and float16 d.
void check_weight(const std::string& format, const torch::Tensor& qs, const torch::Tensor& scales, int64_t K) {
  TORCH_CHECK(format == "Q4_1" || format == "Q8_0", "unknown block format ", format);
  const bool q4 = format == "Q4_1";
  const int64_t N = qs.size(0), nb = K / kBlock;
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() &&
                  qs.size(1) == nb * (q4 ? 16 : 32),
              "blocks do not match x's width");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && scales.is_contiguous() &&
                  scales.numel() == N * nb * (q4 ? 2 : 1),
              q4 ? "dm must be float16 [N, K/32, 2]" : "d must be float16 [N, K/32]");
}

// y = x @ W.T for a weight given as (format, quants, scales), checked: the dispatch every caller shares.
void block_matmul(const float* x, int64_t M, int64_t K, const std::string& format, const torch::Tensor& qs,
                  const torch::Tensor& scales, float* y) {
  check_weight(format, qs, scales, K);
  const int64_t N = qs.size(0);
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  if (format == "Q4_1")
    matmul<true>(x, M, K, N, qs.data_ptr<uint8_t>(), S, 16, y);
  else
    matmul<false>(x, M, K, N, qs.data_ptr<uint8_t>(), S, 32, y);
}

torch::Tensor quantized_mm(const torch::Tensor& x, const std::string& format, const torch::Tensor& qs,
                           const torch::Tensor& scales) {
  check_x(x);
  auto y = torch::empty({x.size(0), qs.size(0)}, x.options());
  block_matmul(x.data_ptr<float>(), x.size(0), x.size(1), format, qs, scales, y.data_ptr<float>());
  return y;
}

}  // namespace

torch::Tensor q4_1_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor dm) { return quantized_mm(x, "Q4_1", qs, dm); }

torch::Tensor q8_0_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor d) { return quantized_mm(x, "Q8_0", qs, d); }

namespace {

// Attention of single-token queries over contexts read in place from a paged pool. q [R, H, D] rows,
// pools [slots, KV, D], row r's context is slots[r, :lengths[r]] (checked by the caller). One task per
// (row, KV head) computes the H / KV query heads that share that K/V, so each K/V row is read once.
void attention(const float* Q, const float* Kp, const float* Vp, const int64_t* SL, const int64_t* LN,
               int64_t R, int64_t H, int64_t KV, int64_t D, int64_t Lmax, float sc, float* O) {
  const int64_t G = H / KV;
  at::parallel_for(0, R * KV, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(G * Lmax);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / KV, kv = t % KV, L = LN[r];
      const int64_t* sl = SL + r * Lmax;
      const float* qg = Q + (r * H + kv * G) * D;
      for (int64_t j = 0; j < L; ++j) {
        const float* k = Kp + (sl[j] * KV + kv) * D;
        for (int64_t g = 0; g < G; ++g) {
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[g * D + d] * k[d];
          p[g * Lmax + j] = dot * sc;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* pg = p.data() + g * Lmax;
        float mx = pg[0];
        for (int64_t j = 1; j < L; ++j) mx = std::max(mx, pg[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < L; ++j) sum += (pg[j] = std::exp(pg[j] - mx));
        const float inv = 1.f / sum;
        float* o = O + (r * H + kv * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
        for (int64_t j = 0; j < L; ++j) {
          const float* v = Vp + (sl[j] * KV + kv) * D;
          const float w = pg[j] * inv;
          for (int64_t d = 0; d < D; ++d) o[d] += w * v[d];
        }
      }
    }
  });
}

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

void check_pools(const torch::Tensor& k_pool, const torch::Tensor& v_pool, int64_t D) {
  TORCH_CHECK(k_pool.scalar_type() == torch::kFloat32 && v_pool.scalar_type() == torch::kFloat32 &&
                  k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 3 &&
                  k_pool.sizes() == v_pool.sizes() && k_pool.size(2) == D,
              "pools must be contiguous float32 [slots, KV, D]");
}

void rms_norm(const float* x, const float* w, int64_t M, int64_t K, float eps, float* y) {
  for (int64_t r = 0; r < M; ++r) {
    float ss = 0.f;
    for (int64_t i = 0; i < K; ++i) ss += x[r * K + i] * x[r * K + i];
    const float inv = 1.f / std::sqrt(ss / K + eps);
    for (int64_t i = 0; i < K; ++i) y[r * K + i] = w[i] * (x[r * K + i] * inv);
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
  attention(q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), slots.data_ptr<int64_t>(),
            lengths.data_ptr<int64_t>(), R, H, KV, D, slots.size(1), static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

// One Llama/Qwen2 decoder layer for R single-token rows, every linear on quantized blocks: what the
// runner's forward does for a decode step, in one call instead of ~35 torch ops (their dispatch costs
// more than their arithmetic at batch 1). x [R, hidden] is the residual stream (returned updated);
// cos/sin [R, D] the rows' RoPE; the rows' new K/V go to write_slots of the pools, then each row
// attends over slots[r, :lengths[r]] (its context, the new token included).
torch::Tensor decode_layer(torch::Tensor x, torch::Tensor ln1, std::string qkv_format, torch::Tensor qkv_qs,
                           torch::Tensor qkv_scales, c10::optional<torch::Tensor> qkv_bias, std::string o_format,
                           torch::Tensor o_qs, torch::Tensor o_scales, torch::Tensor ln2, std::string gu_format,
                           torch::Tensor gu_qs, torch::Tensor gu_scales, std::string down_format,
                           torch::Tensor down_qs, torch::Tensor down_scales, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor write_slots,
                           torch::Tensor slots, torch::Tensor lengths, int64_t n_heads, double eps, double scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be float32 [R, hidden]");
  const int64_t R = x.size(0), E = x.size(1), D = k_pool.size(2), KV = k_pool.size(1), H = n_heads;
  const int64_t QS = H * D, KS = KV * D, NQKV = QS + 2 * KS, I2 = gu_qs.size(0), I = I2 / 2;
  check_pools(k_pool, v_pool, D);
  check_context(slots, lengths, R, k_pool.size(0));
  TORCH_CHECK(write_slots.scalar_type() == torch::kInt64 && write_slots.numel() == R, "write_slots must be int64 [R]");
  TORCH_CHECK(qkv_qs.size(0) == NQKV && o_qs.size(0) == E && down_qs.size(0) == E && cos.size(1) == D,
              "layer shapes do not match");
  check_weight(qkv_format, qkv_qs, qkv_scales, E);  // all four before anything is written
  check_weight(o_format, o_qs, o_scales, QS);
  check_weight(gu_format, gu_qs, gu_scales, E);
  check_weight(down_format, down_qs, down_scales, I);
  const int64_t* WS = write_slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(WS[r] >= 0 && WS[r] < k_pool.size(0), "a write slot is outside the pool");

  auto opts = x.options();
  auto out = x.clone();
  auto h = torch::empty({R, std::max(E, I)}, opts);
  auto qkv = torch::empty({R, NQKV}, opts);
  auto q = torch::empty({R, H, D}, opts);
  auto attn = torch::empty({R, QS}, opts);
  auto proj = torch::empty({R, E}, opts);
  auto gu = torch::empty({R, I2}, opts);
  float *X = out.data_ptr<float>(), *Hh = h.data_ptr<float>(), *QKV = qkv.data_ptr<float>();
  float *Qr = q.data_ptr<float>(), *P = proj.data_ptr<float>(), *GU = gu.data_ptr<float>();
  float* Kp = k_pool.data_ptr<float>();
  float* Vp = v_pool.data_ptr<float>();
  const float *C = cos.data_ptr<float>(), *Sn = sin.data_ptr<float>();

  rms_norm(X, ln1.data_ptr<float>(), R, E, eps, Hh);
  block_matmul(Hh, R, E, qkv_format, qkv_qs, qkv_scales, QKV);
  if (qkv_bias.has_value()) {
    const float* B = qkv_bias->data_ptr<float>();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < NQKV; ++i) QKV[r * NQKV + i] += B[i];
  }
  // RoPE (rotate-half) on q and k; k and v go straight into the pool.
  const int64_t half = D / 2;
  for (int64_t r = 0; r < R; ++r) {
    const float *c = C + r * D, *sn = Sn + r * D;
    for (int64_t hd = 0; hd < H + KV; ++hd) {
      const float* src = QKV + r * NQKV + hd * D;
      float* dst = hd < H ? Qr + (r * H + hd) * D : Kp + (WS[r] * KV + (hd - H)) * D;
      for (int64_t i = 0; i < D; ++i) {
        const float rot = i < half ? -src[i + half] : src[i - half];
        dst[i] = src[i] * c[i] + rot * sn[i];
      }
    }
    std::copy(QKV + r * NQKV + QS + KS, QKV + (r + 1) * NQKV, Vp + WS[r] * KV * D);
  }
  attention(Qr, Kp, Vp, slots.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), R, H, KV, D, slots.size(1),
            static_cast<float>(scale), attn.data_ptr<float>());
  block_matmul(attn.data_ptr<float>(), R, QS, o_format, o_qs, o_scales, P);
  for (int64_t i = 0; i < R * E; ++i) X[i] += P[i];
  rms_norm(X, ln2.data_ptr<float>(), R, E, eps, Hh);
  block_matmul(Hh, R, E, gu_format, gu_qs, gu_scales, GU);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const float g = GU[r * I2 + i];
      Hh[r * I + i] = g / (1.f + std::exp(-g)) * GU[r * I2 + I + i];
    }
  block_matmul(Hh, R, I, down_format, down_qs, down_scales, P);
  for (int64_t i = 0; i < R * E; ++i) X[i] += P[i];
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_mm", &q4_1_mm, "x [M, K] float32 @ Q4_1 blocks [N, K].T -> [M, N] float32");
  m.def("q8_0_mm", &q8_0_mm, "x [M, K] float32 @ Q8_0 blocks [N, K].T -> [M, N] float32");
  m.def("decode_attention", &decode_attention, "single-token attention over paged float32 K/V");
  m.def("decode_layer", &decode_layer, "one decoder layer for single-token rows on quantized blocks");
}
