// Per-token cross-entropy over the vocabulary, plus the pieces of the lm z-loss
// (ZLM = mean_t lse_t², README, Architecture: Loss). Softmax in fp32 with the max subtracted.
#include <cmath>

#include "model/cpu/ops.hpp"

namespace spes::cpu {

void crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                          int64_t N, int64_t V) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* z = logits + n * V;
    float maxv = z[0];
    for (int64_t i = 1; i < V; ++i) maxv = z[i] > maxv ? z[i] : maxv;
    // The sum in double: in float, 151k terms (a real vocabulary) put lse ~1e-5 low,
    // and this is the oracle the GPU kernel (exact to float64) is checked against.
    double sum = 0.0;
    for (int64_t i = 0; i < V; ++i) sum += std::exp(z[i] - maxv);
    const float l = maxv + float(std::log(sum));
    lse[n] = l;
    losses[n] = l - z[targets[n]];
  }
}

// d/dz (lse − z_y) = p − onehot(y);  d/dz lse² = 2·lse·p.
// Each element is read once and then written, so dlogits may alias logits.
void crossentropy_backward(float* dlogits, const float* logits, const float* lse,
                           const int32_t* targets, int64_t N, int64_t V, float ce_scale, float z_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* z = logits + n * V;
    float* dz = dlogits + n * V;
    const float l = lse[n];
    const float pscale = ce_scale + z_scale * 2.0f * l;
    const int64_t y = targets[n];
    for (int64_t i = 0; i < V; ++i) {
      const float p = std::exp(z[i] - l);
      dz[i] = p * pscale - (i == y ? ce_scale : 0.0f);
    }
  }
}

}  // namespace spes::cpu
