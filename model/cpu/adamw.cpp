// AdamW (decoupled weight decay, PyTorch semantics) and the helpers of global-norm
// gradient clipping.
#include <cmath>

#include "model/cpu/ops.hpp"

namespace spes::cpu {

// The formula of torch.optim.AdamW (single-tensor path), with its bias-correction
// arrangement (PyTorch updates m with lerp, which rounds slightly differently):
//   p *= 1 − lr·wd;  m = β1·m + (1−β1)·g;  v = β2·v + (1−β2)·g²;
//   p −= (lr / bc1) · m / (√v / √bc2 + eps),  bc_i = 1 − β_i^t.
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t t) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t));
  const float step_size = static_cast<float>(static_cast<double>(lr) / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float decay = 1.0f - lr * weight_decay;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i];
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    param[i] = param[i] * decay - step_size * mi / denom;
  }
}

// The result must not depend on the thread count (resume and the sync state hash
// need bit-identical clipping): the range is cut into a fixed number of blocks,
// each summed in order, and the block sums are added in block order.
double sum_squares(const float* g, int64_t n) {
  constexpr int64_t kBlocks = 64;
  double partial[kBlocks];
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < kBlocks; ++b) {
    const int64_t i0 = n * b / kBlocks;
    const int64_t i1 = n * (b + 1) / kBlocks;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = i0; i < i1; ++i) s += static_cast<double>(g[i]) * static_cast<double>(g[i]);
    partial[b] = s;
  }
  double total = 0.0;
  for (int64_t b = 0; b < kBlocks; ++b) total += partial[b];
  return total;
}

void scale_inplace(float* x, int64_t n, float s) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace spes::cpu
