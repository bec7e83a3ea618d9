// Token embedding lookup and its backward (scatter-add into the table).
#include <cstring>

#include "model/cpu/ops.hpp"

namespace spes::cpu {

void embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    std::memcpy(out + n * C, table + static_cast<int64_t>(tokens[n]) * C, sizeof(float) * C);
  }
}

// Several tokens may share a table row, so rows cannot be split across threads
// without atomics. Instead each thread owns a band of channels and walks all tokens
// in order: every table element is summed in token order whatever the thread count.
void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t N, int64_t C) {
  constexpr int64_t kBand = 32;
  const int64_t n_bands = (C + kBand - 1) / kBand;
#pragma omp parallel for schedule(static)
  for (int64_t band = 0; band < n_bands; ++band) {
    const int64_t c0 = band * kBand;
    const int64_t c1 = c0 + kBand < C ? c0 + kBand : C;
    for (int64_t n = 0; n < N; ++n) {
      float* dst = dtable + static_cast<int64_t>(tokens[n]) * C;
      const float* src = dout + n * C;
      for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
    }
  }
}

}  // namespace spes::cpu
