// One decoder layer for a step's rows in one call: norms, the q/k/v, o, gate/up and down linears on
// their blocks (matmul.h), RoPE, the K/V written to the pool and attention over it (attention.h), the
// gated activation, the residual adds. The families' switches are FusedLayer's.
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

#include "attention.h"
#include "matmul.h"
#include "pool.h"
#include "vmath.h"

namespace {

// h[r, i] = act(gu[r, i]) * gu[r, I + i] for gu [R, 2I] (gate and up side by side), each activation
// as torch computes it with Sleef's vectorised exp / tanh: silu x / (1 + exp(-x)), and GELU's tanh form
// 0.5 x (1 + tanh(beta (x + kappa x^3))).
constexpr float kGeluBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), kGeluKappa = 0.044715f;

inline float gelu_tanh(float x) { return 0.5f * x * (1.f + std::tanh(kGeluBeta * (x + kGeluKappa * (x * x * x)))); }

void gated_act(const float* GU, int64_t R, int64_t I, bool gelu, float* Hh) {
  pool::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *g = GU + r * 2 * I, *u = g + I;
      float* h = Hh + r * I;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps(), half = _mm512_set1_ps(0.5f),
                   beta = _mm512_set1_ps(kGeluBeta), kappa = _mm512_set1_ps(kGeluKappa);
      for (; i + 16 <= I; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        __m512 a;
        if (gelu) {
          const __m512 inner = _mm512_mul_ps(beta, _mm512_add_ps(x, _mm512_mul_ps(kappa, _mm512_mul_ps(_mm512_mul_ps(x, x), x))));
          a = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, Sleef_tanhf16_u10(inner)));
        } else {
          a = _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_sub_ps(zero, x))));
        }
        _mm512_storeu_ps(h + i, _mm512_mul_ps(a, _mm512_loadu_ps(u + i)));
      }
#elif defined(__AVX2__)
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps(), half = _mm256_set1_ps(0.5f),
                   beta = _mm256_set1_ps(kGeluBeta), kappa = _mm256_set1_ps(kGeluKappa);
      for (; i + 8 <= I; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        __m256 a;
        if (gelu) {
          const __m256 inner = _mm256_mul_ps(beta, _mm256_add_ps(x, _mm256_mul_ps(kappa, _mm256_mul_ps(_mm256_mul_ps(x, x), x))));
          a = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, Sleef_tanhf8_u10avx2(inner)));
        } else {
          a = _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10avx2(_mm256_sub_ps(zero, x))));
        }
        _mm256_storeu_ps(h + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < I; ++i) h[i] = (gelu ? gelu_tanh(g[i]) : g[i] / (1.f + std::exp(-g[i]))) * u[i];
    }
  });
}

// Rows a task of a layer's row-wise work takes: a decode step's few rows stay on the calling thread.
constexpr int64_t kRowGrain = 64;

// y = w * (x / rms(x)) per row; y may be x.
void rms_norm(const float* x, const float* w, int64_t M, int64_t K, float eps, float* y) {
  pool::parallel_for(0, M, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float ss = dot(x + r * K, x + r * K, K);
      const float inv = 1.f / std::sqrt(ss / K + eps);
      for (int64_t i = 0; i < K; ++i) y[r * K + i] = w[i] * (x[r * K + i] * inv);
    }
  });
}

// x += p, rows of K.
void add_rows(float* __restrict x, const float* __restrict p, int64_t M, int64_t K) {
  pool::parallel_for(0, M, kRowGrain, [x, p, K](int64_t r0, int64_t r1) {
    float* __restrict xs = x + r0 * K;
    const float* __restrict ps = p + r0 * K;
    for (int64_t i = 0; i < (r1 - r0) * K; ++i) xs[i] += ps[i];
  });
}

// A norm's factor [n] as a pointer, nullptr for an empty tensor (the family has no such norm).
const float* optional_norm(const torch::Tensor& w, int64_t n, const char* name) {
  if (w.numel() == 0) return nullptr;
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == n, name,
              " must be float32 [", n, "] or empty");
  return w.data_ptr<float>();
}

}  // namespace

// One decoder layer's weights and switches, checked once when the runner builds it: a step then
// passes only what changes, as the per-call conversion and checks of ~40 arguments cost a one-row step
// a noticeable share. The families' switches: q_norm / k_norm [D] an RMS norm over each head before
// RoPE, attn_out_norm / mlp_out_norm [hidden] norms on the two outputs before the residual adds (an
// empty tensor: none), and gelu for the tanh GELU in place of silu. Norm weights come as the factor
// applied (Gemma's 1 + w).
using Tensor = torch::Tensor;
using Formats = std::vector<std::string>;
using Tensors = std::vector<torch::Tensor>;

// A linear's parts, owned and checked at width K.
struct OwnedParts {
  Formats formats;
  Tensors a, b, panels;
  int64_t K = 0, N = 0;
  OwnedParts(Formats f, Tensors a_, Tensors b_, Tensors p, int64_t width)
      : formats(std::move(f)), a(std::move(a_)), b(std::move(b_)), panels(std::move(p)), K(width) {
    view().check(K);
    N = view().rows();
  }
  Parts view() const { return {formats, a, b, panels}; }
  void run(const float* x, int64_t M, float* y) const { view().run(x, M, K, y); }
};

struct FusedLayer {
  int64_t E, H, KV, D;
  Tensor ln1, ln2, qkv_bias, q_norm, k_norm, attn_out_norm, mlp_out_norm;
  OwnedParts qkv, o, gu, down;
  float eps, scale;
  bool gelu;
  const float *QN, *KN, *AN, *MN, *bias;

  FusedLayer(const Tensor& ln1_, const Formats& qkv_format, const Tensors& qkv_a, const Tensors& qkv_b,
             const Tensors& qkv_p, const c10::optional<Tensor>& bias_, const Formats& o_format, const Tensors& o_a,
             const Tensors& o_b, const Tensors& o_p, const Tensor& ln2_, const Formats& gu_format,
             const Tensors& gu_a, const Tensors& gu_b, const Tensors& gu_p, const Formats& down_format,
             const Tensors& down_a, const Tensors& down_b, const Tensors& down_p, int64_t n_heads,
             int64_t kv_heads, int64_t head_dim, double eps_, double scale_, const Tensor& q_norm_,
             const Tensor& k_norm_, const Tensor& attn_out_norm_, const Tensor& mlp_out_norm_, bool gelu_)
      : E(ln1_.numel()), H(n_heads), KV(kv_heads), D(head_dim),
        ln1(ln1_), ln2(ln2_), qkv_bias(bias_.has_value() ? *bias_ : Tensor()), q_norm(q_norm_), k_norm(k_norm_),
        attn_out_norm(attn_out_norm_), mlp_out_norm(mlp_out_norm_),
        qkv(qkv_format, qkv_a, qkv_b, qkv_p, E),  // all four checked before anything is written
        o(o_format, o_a, o_b, o_p, n_heads * head_dim),
        gu(gu_format, gu_a, gu_b, gu_p, E),
        down(down_format, down_a, down_b, down_p, gu.N / 2),
        eps(static_cast<float>(eps_)), scale(static_cast<float>(scale_)), gelu(gelu_) {
    TORCH_CHECK(H > 0 && KV > 0 && D > 0 && H % KV == 0 && D % 2 == 0, "head counts or head size do not fit");
    TORCH_CHECK(ln1.scalar_type() == torch::kFloat32 && ln1.is_contiguous() && ln2.scalar_type() == torch::kFloat32 &&
                    ln2.is_contiguous() && ln2.numel() == E,
                "ln1 and ln2 must be float32 [hidden]");
    TORCH_CHECK(qkv.N == (H + 2 * KV) * D && o.N == E && down.N == E && gu.N % 2 == 0, "layer shapes do not match");
    TORCH_CHECK(!qkv_bias.defined() || (qkv_bias.scalar_type() == torch::kFloat32 && qkv_bias.is_contiguous() &&
                                        qkv_bias.numel() == qkv.N),
                "qkv_bias must be float32 [q + k + v rows]");
    QN = optional_norm(q_norm, D, "q_norm");
    KN = optional_norm(k_norm, D, "k_norm");
    AN = optional_norm(attn_out_norm, E, "attn_out_norm");
    MN = optional_norm(mlp_out_norm, E, "mlp_out_norm");
    bias = qkv_bias.defined() ? qkv_bias.data_ptr<float>() : nullptr;
  }
};

// layer_forward's working buffers, per thread, kept between calls. A burst's prompt runs would otherwise
// allocate and free tens of MB each; freed between tensors still held, most of it stayed resident.
// The runner releases them after a step of many rows.
class Scratch {
 public:
  enum Slot { kNormed, kQKV, kQueries, kAttention, kProjection, kGateUp, kSlots };
  float* get(Slot s, int64_t n) {
    panel::Buffer<float>& b = slots_[s];
    if (static_cast<int64_t>(b.size()) < n) {
      panel::Buffer<float>().swap(b);  // the old one goes first: never both
      b.resize(n);
    }
    return b.data();
  }
  void release() {
    for (auto& b : slots_) panel::Buffer<float>().swap(b);
  }

 private:
  panel::Buffer<float> slots_[kSlots];
};
inline thread_local Scratch t_scratch;

// The layer for a step's rows: what the runner's forward does, in one call instead of ~35 torch ops
// (their dispatch costs more than their arithmetic at batch 1). x [R, hidden] is the residual stream
// (returned updated); cos/sin [R, D] the rows' RoPE; the rows' new K/V go to write_slots of the pools,
// then each row attends as prefill_attention's rows do (table, item, position, window): single-token
// rows (one row an item) a task per row, prompts an item at a time. With `keep` (int64 row indices,
// ascending) every row writes its K/V and attends, but only the kept rows go on through the output
// projection and the MLP, and only they come back: the last layer of a prompt, whose other rows no
// one reads. Every argument is a reference: the caller's tensors are released by pybind11 after the
// call, with the GIL held, not here.
torch::Tensor layer_forward(const FusedLayer& L, const Tensor& x, const Tensor& cos, const Tensor& sin,
                            const Tensor& k_pool, const Tensor& v_pool, const Tensor& write_slots,
                            const Tensor& table, const Tensor& item, const Tensor& position, int64_t window,
                            const c10::optional<Tensor>& keep) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.size(1) == L.E,
              "x must be float32 [R, hidden]");
  const int64_t R = x.size(0), E = L.E, D = L.D, KV = L.KV, H = L.H, I = L.gu.N / 2;
  const int64_t QS = H * D, KS = KV * D, NQKV = QS + 2 * KS;
  check_pools(k_pool, v_pool, D);
  TORCH_CHECK(k_pool.size(1) == KV, "pools must hold the layer's KV heads");
  const RowContexts context = row_contexts(table, item, position, window, R, k_pool.size(0));
  TORCH_CHECK(write_slots.scalar_type() == torch::kInt64 && write_slots.numel() == R, "write_slots must be int64 [R]");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == D && cos.size(0) == R && sin.sizes() == cos.sizes(),
              "cos and sin must be float32 [R, D]");
  const int64_t* WS = write_slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(WS[r] >= 0 && WS[r] < k_pool.size(0), "a write slot is outside the pool");
  if (keep.has_value()) {
    TORCH_CHECK(keep->scalar_type() == torch::kInt64 && keep->dim() == 1, "keep must be int64 [n]");
    const int64_t* kp = keep->data_ptr<int64_t>();
    for (int64_t i = 0; i < keep->numel(); ++i)
      TORCH_CHECK(kp[i] >= 0 && kp[i] < R && (i == 0 || kp[i] > kp[i - 1]), "keep must be ascending rows of x");
  }

  auto out = x.clone();
  Scratch& S = t_scratch;
  float *X = out.data_ptr<float>(), *Hh = S.get(Scratch::kNormed, R * std::max(E, I));
  float *QKV = S.get(Scratch::kQKV, R * NQKV), *Qr = S.get(Scratch::kQueries, R * QS);
  float *A = S.get(Scratch::kAttention, R * QS), *P = S.get(Scratch::kProjection, R * E);
  float* GU = S.get(Scratch::kGateUp, R * 2 * I);
  const float *C = cos.data_ptr<float>(), *Sn = sin.data_ptr<float>();
  const float *QN = L.QN, *KN = L.KN, *bias = L.bias, eps = L.eps;

  rms_norm(X, L.ln1.data_ptr<float>(), R, E, eps, Hh);
  L.qkv.run(Hh, R, QKV);
  // Per row: the q/k/v bias, per-head norms, then RoPE (rotate-half) on q and k; k and v go into the
  // pool in its element type (q8_0: quantized per block of 32, each head's row whole blocks).
  const int64_t half = D / 2;
  with_pools(k_pool, v_pool, [&](auto* Kp, auto* Vp) {
    const int64_t U = kv_units<std::remove_pointer_t<decltype(Kp)>>(D);  // a pool row's elements
    pool::parallel_for(0, R, kRowGrain, [&](int64_t r0, int64_t r1) {
      std::vector<float> head(D), key(D);
      for (int64_t r = r0; r < r1; ++r) {
        if (bias != nullptr)
          for (int64_t i = 0; i < NQKV; ++i) QKV[r * NQKV + i] += bias[i];
        const float *c = C + r * D, *sn = Sn + r * D;
        for (int64_t hd = 0; hd < H + KV; ++hd) {
          const float* src = QKV + r * NQKV + hd * D;
          const float* norm = hd < H ? QN : KN;
          if (norm != nullptr) {
            rms_norm(src, norm, 1, D, eps, head.data());
            src = head.data();
          }
          float* dst = hd < H ? Qr + (r * H + hd) * D : key.data();
          for (int64_t i = 0; i < D; ++i) {
            const float rot = i < half ? -src[i + half] : src[i - half];
            dst[i] = src[i] * c[i] + rot * sn[i];
          }
          if (hd >= H) kv_store(key.data(), D, Kp + (WS[r] * KV + (hd - H)) * U);
        }
        kv_store(QKV + r * NQKV + QS + KS, KS, Vp + WS[r] * KV * U);
      }
    });
    if (context.B == R) attention(Qr, Kp, Vp, R, H, KV, D, context.Lmax, L.scale, A, context);
    else causal_attention(Qr, Kp, Vp, context, R, H, KV, D, L.scale, A);
  });
  int64_t N = R;  // the rows that go on
  if (keep.has_value()) {
    N = keep->numel();
    out = out.index_select(0, *keep);
    X = out.data_ptr<float>();
    const int64_t* kp = keep->data_ptr<int64_t>();
    for (int64_t i = 0; i < N; ++i) std::memmove(A + i * QS, A + kp[i] * QS, QS * sizeof(float));  // kp[i] >= i
    if (N == 0) return out;
  }
  L.o.run(A, N, P);
  if (L.AN != nullptr) rms_norm(P, L.AN, N, E, eps, P);
  add_rows(X, P, N, E);
  rms_norm(X, L.ln2.data_ptr<float>(), N, E, eps, Hh);
  L.gu.run(Hh, N, GU);
  gated_act(GU, N, I, L.gelu, Hh);
  L.down.run(Hh, N, P);
  if (L.MN != nullptr) rms_norm(P, L.MN, N, E, eps, P);
  add_rows(X, P, N, E);
  return out;
}

// Frees this thread's layer_forward buffers (Scratch).
void release_scratch() { t_scratch.release(); }
