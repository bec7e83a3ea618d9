// Dropless MoE token dispatch and combine. Tokens are permuted into expert-major
// slots so each expert's rows are contiguous and its GEMMs need no gather; every
// backward is a per-token or per-slot loop with a fixed summation order (no atomics).
#include <cassert>
#include <cstring>

#include "model/cpu/ops.hpp"

namespace spes::cpu {

// A counting sort by expert; iterating tokens (then k) in order makes it stable,
// so slots are ordered by expert, then token, then k.
void moe_dispatch_indices(int32_t* offsets, int32_t* slot_token, int32_t* token_slot,
                          const int32_t* topk_idx, int64_t N, int64_t E, int64_t K) {
  // offsets[e+1] first holds the count of expert e, then (after the prefix sum) the
  // first slot of e, and serves as e's fill cursor; once every slot is placed it has
  // advanced to e's end, which is exactly offsets[e+1]. No scratch memory needed.
  for (int64_t e = 0; e <= E; ++e) offsets[e] = 0;
  for (int64_t i = 0; i < N * K; ++i) {
    assert(topk_idx[i] >= 0 && topk_idx[i] < E);
    offsets[topk_idx[i] + 1]++;
  }
  // Shift to starts: offsets[e+1] = Σ_{f<e} count_f.
  int32_t running = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int32_t count = offsets[e + 1];
    offsets[e + 1] = running;
    running += count;
  }
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = topk_idx[t * K + k];
      const int32_t s = offsets[e + 1]++;
      slot_token[s] = static_cast<int32_t>(t);
      token_slot[t * K + k] = s;
    }
  }
}

void moe_gather_forward(float* xe, const float* x, const int32_t* slot_token, int64_t S, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < S; ++s) {
    std::memcpy(xe + s * C, x + static_cast<int64_t>(slot_token[s]) * C, sizeof(float) * C);
  }
}

void moe_gather_backward(float* dx, const float* dxe, const int32_t* token_slot, int64_t N,
                         int64_t K, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    float* d = dx + t * C;
    const float* src0 = dxe + static_cast<int64_t>(token_slot[t * K]) * C;
    for (int64_t c = 0; c < C; ++c) d[c] = src0[c];
    for (int64_t k = 1; k < K; ++k) {
      const float* src = dxe + static_cast<int64_t>(token_slot[t * K + k]) * C;
      for (int64_t c = 0; c < C; ++c) d[c] += src[c];
    }
  }
}

void moe_combine_forward(float* out, const float* ye, const float* topk_w, const int32_t* token_slot,
                         int64_t N, int64_t K, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    float* o = out + t * C;
    for (int64_t c = 0; c < C; ++c) o[c] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float w = topk_w[t * K + k];
      const float* y = ye + static_cast<int64_t>(token_slot[t * K + k]) * C;
      for (int64_t c = 0; c < C; ++c) o[c] += w * y[c];
    }
  }
}

// token_slot is a bijection onto [0, N·K), so every dye row is written exactly once.
void moe_combine_backward(float* dye, float* dtopk_w, const float* dout, const float* ye,
                          const float* topk_w, const int32_t* token_slot, int64_t N, int64_t K,
                          int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    const float* g = dout + t * C;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t s = token_slot[t * K + k];
      const float w = topk_w[t * K + k];
      const float* y = ye + s * C;
      float* dy = dye + s * C;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < C; ++c) dot += g[c] * y[c];
      for (int64_t c = 0; c < C; ++c) dy[c] = w * g[c];
      dtopk_w[t * K + k] = dot;
    }
  }
}

}  // namespace spes::cpu
