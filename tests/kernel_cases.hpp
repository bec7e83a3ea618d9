// Test cases and host helpers shared by a kernel's GPU test (tests/test_cuda_*.cu) and
// its emulator test (tests/emu/test_emu_*.cpp): the same inputs on both, so a case
// that the emulator passes in CI is the case the GPU runs.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

namespace spes::test {

// MoE dispatch: N tokens, E experts, top-K, routed among `allowed` experts.
struct DispatchCase {
  int64_t N, E, K;
  std::vector<int32_t> allowed;  // empty: all experts
  const char* what;
};
inline std::vector<DispatchCase> dispatch_cases() {
  return {
      {3000, 16, 2, {}, "several chunks, last one partial"},
      {5, 4, 4, {}, "every expert on every token"},
      {700, 8, 2, {0, 2, 5}, "empty experts"},
      {2500, 4, 1, {3}, "all tokens on one expert"},
      {2049, 64, 8, {}, "fine-grained"},
      {1, 3, 2, {}, "one token"},
      {4096, 256, 2, {}, "E = 256, exact chunk multiple"},
  };
}

// Logits stored with row stride ld ≥ V; the padding is NaN.
inline std::vector<float> strided(const std::vector<float>& dense, int64_t N, int64_t V, int64_t ld) {
  std::vector<float> s(N * ld, NAN);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < V; ++i) s[n * ld + i] = dense[n * V + i];
  return s;
}
// The first V values of each row of a strided matrix.
inline std::vector<float> dense_of(const std::vector<float>& s, int64_t N, int64_t V, int64_t ld) {
  std::vector<float> d(N * V);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < V; ++i) d[n * V + i] = s[n * ld + i];
  return d;
}

}  // namespace spes::test
