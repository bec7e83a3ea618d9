// Causal multi-head attention with grouped KV heads: out = softmax(q·kᵀ/√D)·v.
// Forward saves lse = logsumexp of each row of scaled scores, so backward rebuilds
// the probabilities exactly (p = exp(s − lse)) without storing the T×T matrix, as
// FlashAttention does. The loops are arranged so the innermost one is a plain
// vectorisable loop with no reduction: scores run over keys with K held transposed
// in a per-task scratch (Kt[d][j]), weighted sums run over the head dimension.
#include <cmath>
#include <vector>

#include "engine/ops/ops.hpp"

namespace spes::cpu {
namespace {

// Kt[d·T + j] = k[b, j, kvh, d] for j < T: the keys of one (batch, kv head) transposed.
void transpose_head(float* Kt, const float* k, int64_t b, int64_t kvh, int64_t T, int64_t Hkv, int64_t D) {
  for (int64_t j = 0; j < T; ++j) {
    const float* kr = k + ((b * T + j) * Hkv + kvh) * D;
    for (int64_t d = 0; d < D; ++d) Kt[d * T + j] = kr[d];
  }
}

// s[j] = scale · Σ_d q[d]·Kt[d][j] for j ≤ t; returns max_j s[j]. Forward and
// backward both call this, so they see bit-identical scores.
float causal_scores(float* s, const float* qr, const float* Kt, int64_t t, int64_t T, int64_t D,
                    float scale) {
  const int64_t n = t + 1;
  for (int64_t j = 0; j < n; ++j) s[j] = 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float qd = qr[d] * scale;
    const float* kt = Kt + d * T;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] += qd * kt[j];
  }
  float maxv = s[0];
  for (int64_t j = 1; j < n; ++j) maxv = s[j] > maxv ? s[j] : maxv;
  return maxv;
}

}  // namespace

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D) {
  const int64_t group = H / Hkv;  // query heads per kv head
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
#pragma omp parallel
  {
    std::vector<float> Kt(D * T);
    std::vector<float> s(T);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H;
      const int64_t h = bh % H;
      const int64_t kvh = h / group;
      transpose_head(Kt.data(), k, b, kvh, T, Hkv, D);
      for (int64_t t = 0; t < T; ++t) {
        const float* qr = q + ((b * T + t) * H + h) * D;
        float* o = out + ((b * T + t) * H + h) * D;
        const float maxv = causal_scores(s.data(), qr, Kt.data(), t, T, D, scale);
        float sum = 0.0f;
        for (int64_t j = 0; j <= t; ++j) {
          s[j] = std::exp(s[j] - maxv);
          sum += s[j];
        }
        for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
        for (int64_t j = 0; j <= t; ++j) {
          const float pj = s[j];
          const float* vr = v + ((b * T + j) * Hkv + kvh) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += pj * vr[d];
        }
        const float inv = 1.0f / sum;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        lse[(b * H + h) * T + t] = maxv + std::log(sum);
      }
    }
  }
}

// Per query row t (p_j = exp(s_j − lse_t), g = dout_t):
//   dv_j += p_j·g;   dp_j = g·v_j;   ds_j = p_j·(dp_j − Δ_t),  Δ_t = Σ_j p_j·dp_j = g·out_t;
//   dq_t = scale·Σ_j ds_j·k_j;   dk_j += scale·ds_j·q_t.
// Tasks are (batch, kv head) so that all query heads writing one dk/dv slice run in
// one task, in a fixed order: no atomics, same bits for any thread count.
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D) {
  const int64_t group = H / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
#pragma omp parallel
  {
    std::vector<float> Kt(D * T);
    std::vector<float> Vt(D * T);
    std::vector<float> s(T);
    std::vector<float> dp(T);
    std::vector<float> dqr(D);
#pragma omp for schedule(static)
    for (int64_t bk = 0; bk < B * Hkv; ++bk) {
      const int64_t b = bk / Hkv;
      const int64_t kvh = bk % Hkv;
      transpose_head(Kt.data(), k, b, kvh, T, Hkv, D);
      transpose_head(Vt.data(), v, b, kvh, T, Hkv, D);
      for (int64_t j = 0; j < T; ++j) {
        float* dkr = dk + ((b * T + j) * Hkv + kvh) * D;
        float* dvr = dv + ((b * T + j) * Hkv + kvh) * D;
        for (int64_t d = 0; d < D; ++d) dkr[d] = 0.0f;
        for (int64_t d = 0; d < D; ++d) dvr[d] = 0.0f;
      }
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        for (int64_t t = 0; t < T; ++t) {
          const int64_t row = ((b * T + t) * H + h) * D;
          const float* qr = q + row;
          const float* g = dout + row;
          const float* o = out + row;
          const int64_t n = t + 1;
          causal_scores(s.data(), qr, Kt.data(), t, T, D, scale);
          const float l = lse[(b * H + h) * T + t];
          for (int64_t j = 0; j < n; ++j) s[j] = std::exp(s[j] - l);  // s now holds p
          // dp_j = Σ_d g[d]·Vt[d][j], vectorised over j like the scores.
          for (int64_t j = 0; j < n; ++j) dp[j] = 0.0f;
          for (int64_t d = 0; d < D; ++d) {
            const float gd = g[d];
            const float* vt = Vt.data() + d * T;
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) dp[j] += gd * vt[j];
          }
          float delta = 0.0f;
          for (int64_t d = 0; d < D; ++d) delta += g[d] * o[d];
          for (int64_t d = 0; d < D; ++d) dqr[d] = 0.0f;
          for (int64_t j = 0; j < n; ++j) {
            const float pj = s[j];
            const float dsj = pj * (dp[j] - delta) * scale;
            const float* kr = k + ((b * T + j) * Hkv + kvh) * D;
            float* dkr = dk + ((b * T + j) * Hkv + kvh) * D;
            float* dvr = dv + ((b * T + j) * Hkv + kvh) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) {
              dqr[d] += dsj * kr[d];
              dkr[d] += dsj * qr[d];
              dvr[d] += pj * g[d];
            }
          }
          float* dqo = dq + row;
          for (int64_t d = 0; d < D; ++d) dqo[d] = dqr[d];
        }
      }
    }
  }
}

}  // namespace spes::cpu
