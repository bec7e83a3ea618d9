// SwiGLU expert activation: h = silu(gate) ⊙ up, silu(g) = g·σ(g).
// Elementwise over S·F values per layer (1M at the tiny config), where a scalar
// std::exp call per element was ~10% of a CPU training step; fast_exp lets GCC
// vectorise the loops (fwd+bwd on 1M values, one thread: 5.3 ms → 0.86 ms).
#include <bit>
#include <cstdint>

#include "model/cpu/fast_exp.hpp"
#include "model/cpu/ops.hpp"

namespace spes::cpu {
namespace {

inline float sigmoid(float g) { return 1.0f / (1.0f + fast_exp(-g)); }

}  // namespace

void swiglu_forward(float* h, const float* gate, const float* up, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    h[i] = g * sigmoid(g) * up[i];
  }
}

// dsilu/dg = σ(g)·(1 + g·(1 − σ(g))). Inputs are read before outputs are written,
// so dgate/dup may alias gate/up.
void swiglu_backward(float* dgate, float* dup, const float* dh, const float* gate, const float* up,
                     int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float u = up[i];
    const float d = dh[i];
    const float sig = sigmoid(g);
    dgate[i] = d * u * sig * (1.0f + g * (1.0f - sig));
    dup[i] = d * g * sig;
  }
}

}  // namespace spes::cpu
