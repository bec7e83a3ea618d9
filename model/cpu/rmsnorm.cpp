// RMSNorm (also used as QK-norm over a whole projection): y = x · rstd · w,
// rstd = 1/sqrt(mean(x²) + eps), statistics in fp32.
#include <cmath>

#include "model/cpu/ops.hpp"

namespace spes::cpu {

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float* y = out + n * C;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < C; ++c) ss += x[c] * x[c];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
    rstd[n] = r;
    for (int64_t c = 0; c < C; ++c) y[c] = x[c] * r * weight[c];
  }
}

// With g = dout, xhat = x·rstd:  dx = rstd·(g⊙w − xhat · mean(g⊙w⊙xhat)),
// dw += Σ_n g ⊙ xhat.
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    const float* g = dout + n * C;
    float* dx = dinp + n * C;
    const float r = rstd[n];
    float dot = 0.0f;  // Σ_c g·w·xhat
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < C; ++c) dot += g[c] * weight[c] * x[c] * r;
    const float mean_dot = dot / static_cast<float>(C);
    for (int64_t c = 0; c < C; ++c) dx[c] = r * (g[c] * weight[c] - x[c] * r * mean_dot);
  }
  if (dweight == nullptr) return;  // frozen norm weight
  // Each thread owns a band of channels and sums over rows in row order, so the
  // result does not depend on the thread count.
  constexpr int64_t kBand = 32;
  const int64_t n_bands = (C + kBand - 1) / kBand;
#pragma omp parallel for schedule(static)
  for (int64_t band = 0; band < n_bands; ++band) {
    const int64_t c0 = band * kBand;
    const int64_t c1 = c0 + kBand < C ? c0 + kBand : C;
    for (int64_t n = 0; n < N; ++n) {
      const float* x = inp + n * C;
      const float* g = dout + n * C;
      const float r = rstd[n];
      for (int64_t c = c0; c < c1; ++c) dweight[c] += g[c] * x[c] * r;
    }
  }
}

}  // namespace spes::cpu
