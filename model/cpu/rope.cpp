// Rotary position embedding, rotate_half (NeoX / HF Llama-OLMoE) convention: the
// head dimension is split into halves [0, D/2) and [D/2, D), and pair (i, i+D/2)
// is rotated by angle t · theta^(−2i/D).
#include <cassert>
#include <cmath>

#include "model/cpu/ops.hpp"

namespace spes::cpu {
namespace {

constexpr int64_t kMaxHalf = 1024;  // D ≤ 2048: the cos/sin row lives on the stack

// cos/sin of position t for the D/2 frequencies, in double then rounded once.
void rope_angles(float* cs, float* sn, int64_t t, int64_t D, double theta) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
    const double angle = static_cast<double>(t) * inv_freq;
    cs[i] = static_cast<float>(std::cos(angle));
    sn[i] = static_cast<float>(std::sin(angle));
  }
}

// One rotation for forward (sign = +1) and its transpose for backward (sign = −1):
// the rotation is orthogonal, so the gradient is the rotation by −angle.
// Both halves are read before either is written, so out may alias x.
void rope_apply(float* out, const float* x, int64_t B, int64_t T, int64_t H, int64_t D, double theta,
                float sign, int64_t pos0) {
  assert(D % 2 == 0 && D / 2 <= kMaxHalf);
  const int64_t half = D / 2;
  // Parallel over positions: the angles are computed once per t and shared by all
  // B·H rows at that position.
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float cs[kMaxHalf];
    float sn[kMaxHalf];
    rope_angles(cs, sn, pos0 + t, D, theta);
    for (int64_t i = 0; i < half; ++i) sn[i] *= sign;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t off = ((b * T + t) * H + h) * D;
        const float* xr = x + off;
        float* yr = out + off;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = xr[i];
          const float x2 = xr[i + half];
          yr[i] = x1 * cs[i] - x2 * sn[i];
          yr[i + half] = x2 * cs[i] + x1 * sn[i];
        }
      }
    }
  }
}

}  // namespace

void rope_forward(float* out, const float* x, int64_t B, int64_t T, int64_t H, int64_t D, double theta,
                  int64_t pos0) {
  rope_apply(out, x, B, T, H, D, theta, 1.0f, pos0);
}

// dx may alias dout.
void rope_backward(float* dx, const float* dout, int64_t B, int64_t T, int64_t H, int64_t D, double theta) {
  rope_apply(dx, dout, B, T, H, D, theta, -1.0f, 0);
}

}  // namespace spes::cpu
