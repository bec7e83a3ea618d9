// MoE router: fp32 softmax over the E expert logits, top-k selection, the routing
// weights, and the backward of everything the loss reads from the router (routing
// weights, the load-balancing loss through p, the router z-loss through lse).
#include <cassert>
#include <cmath>

#include "model/cpu/ops.hpp"

namespace spes::cpu {

void router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_w, const float* logits,
                    int64_t N, int64_t E, int64_t K, bool renorm) {
  assert(K >= 1 && K <= E);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* z = logits + n * E;
    float* p = probs + n * E;
    float maxv = z[0];
    for (int64_t e = 1; e < E; ++e) maxv = z[e] > maxv ? z[e] : maxv;
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      p[e] = std::exp(z[e] - maxv);
      sum += p[e];
    }
    const float inv = 1.0f / sum;
    for (int64_t e = 0; e < E; ++e) p[e] *= inv;
    lse[n] = maxv + std::log(sum);

    // Top-k by repeated argmax over p. A strict '>' keeps the first (lowest-index)
    // expert among equals, so ties go to the lower index; choices come out in
    // descending probability. K is small (2–8), so O(K·E) is fine.
    int32_t* idx = topk_idx + n * K;
    float* w = topk_w + n * K;
    float wsum = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t j = 0; j < k; ++j) taken = taken || idx[j] == e;
        if (taken) continue;
        if (best < 0 || p[e] > p[best]) best = e;
      }
      idx[k] = static_cast<int32_t>(best);
      w[k] = p[best];
      wsum += p[best];
    }
    if (renorm) {
      for (int64_t k = 0; k < K; ++k) w[k] /= wsum;
    }
  }
}

// Per token, with p = probs, S = Σ_k p[idx_k], w_k = p[idx_k]/S (renorm) or p[idx_k]:
//   dp_e  = lb_dprob[e] (+ the top-k term for chosen e)
//   top-k term: renorm:  dp[idx_j] += (dw_j − Σ_k dw_k·w_k) / S   (since ∂w_k/∂p_j = (δ_kj − w_k)/S)
//               else:    dp[idx_j] += dw_j
//   dlogits_e = p_e·(dp_e − Σ_f p_f·dp_f)  +  rz_scale·2·lse·p_e   (∂lse²/∂z_e = 2·lse·p_e)
// lb_dprob may be null (no load-balancing term). E ≤ 1024 (dp lives on the stack).
void router_backward(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                     const int32_t* topk_idx, const float* topk_w, const float* lb_dprob,
                     float rz_scale, int64_t N, int64_t E, int64_t K, bool renorm) {
  constexpr int64_t kMaxE = 1024;
  assert(E <= kMaxE);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* p = probs + n * E;
    const int32_t* idx = topk_idx + n * K;
    const float* w = topk_w + n * K;
    const float* dw = dtopk_w + n * K;
    float dp[kMaxE];
    for (int64_t e = 0; e < E; ++e) dp[e] = lb_dprob != nullptr ? lb_dprob[e] : 0.0f;
    if (renorm) {
      float s = 0.0f;
      float dw_dot_w = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        s += p[idx[k]];
        dw_dot_w += dw[k] * w[k];
      }
      for (int64_t k = 0; k < K; ++k) dp[idx[k]] += (dw[k] - dw_dot_w) / s;
    } else {
      for (int64_t k = 0; k < K; ++k) dp[idx[k]] += dw[k];
    }
    float p_dot_dp = 0.0f;
    for (int64_t e = 0; e < E; ++e) p_dot_dp += p[e] * dp[e];
    const float z_term = rz_scale * 2.0f * lse[n];
    float* dz = dlogits + n * E;
    for (int64_t e = 0; e < E; ++e) dz[e] = p[e] * (dp[e] - p_dot_dp) + z_term * p[e];
  }
}

}  // namespace spes::cpu
