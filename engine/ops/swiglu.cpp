// SwiGLU expert activation: h = silu(gate) ⊙ up, silu(g) = g·σ(g).
// Elementwise over S·F values per layer (1M at the tiny config), where a scalar
// std::exp call per element was ~10% of a CPU training step; exp_vec below lets GCC
// vectorise the loops (fwd+bwd on 1M values, one thread: 5.3 ms → 0.86 ms).
#include <bit>
#include <cstdint>

#include "engine/ops/ops.hpp"

namespace spes::cpu {
namespace {

// e^x, ≤ 1.3 ulp, branch-free so loops calling it vectorise (same construction as
// exp_softmax in attention.cpp; the two should share a header). Valid for any x in
// [−1e30, 1e30]: underflow gives 0, overflow gives +inf.
inline float exp_vec(float x) {
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x·log2 e)
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t biased = static_cast<int32_t>(n) + 127;
  biased = biased < 0 ? 0 : biased;      // 2^n underflows to 0
  biased = biased > 255 ? 255 : biased;  // 255 is the exponent of +inf
  return p * std::bit_cast<float>(biased << 23);
}

inline float sigmoid(float g) { return 1.0f / (1.0f + exp_vec(-g)); }

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
