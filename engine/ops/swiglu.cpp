// SwiGLU expert activation: h = silu(gate) ⊙ up, silu(g) = g·σ(g).
#include <cmath>

#include "engine/ops/ops.hpp"

namespace spes::cpu {

void swiglu_forward(float* h, const float* gate, const float* up, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float sig = 1.0f / (1.0f + std::exp(-g));
    h[i] = g * sig * up[i];
  }
}

// dsilu/dg = σ(g)·(1 + g·(1 − σ(g))). Inputs are read before outputs are written,
// so dgate/dup may alias gate/up.
void swiglu_backward(float* dgate, float* dup, const float* dh, const float* gate, const float* up,
                     int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float u = up[i];
    const float d = dh[i];
    const float sig = 1.0f / (1.0f + std::exp(-g));
    const float silu = g * sig;
    dgate[i] = d * u * sig * (1.0f + g * (1.0f - sig));
    dup[i] = d * silu;
  }
}

}  // namespace spes::cpu
