// The values a bf16 tensor holds, on the host: shared by the kernel tests
// (tests/cuda_test.cuh) and test_gpu_step, which feed their CPU references exactly
// what the kernels see.
#pragma once
#include <cuda_bf16.h>

#include <vector>

namespace spes::test {

// Round to nearest even at bf16 precision (what the kernels' stores and float_to_bf16 do).
inline float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

inline std::vector<float> rounded_bf16(std::vector<float> v) {
  for (auto& x : v) x = bf16_round(x);
  return v;
}

}  // namespace spes::test
