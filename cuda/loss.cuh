// The loss parts that are means over tokens: CE = mean(losses) and the lm z-loss
// ZLM = mean(lse²), from crossentropy_forward_backward's per-token losses and lse.
// Summed in double in a fixed order (deterministic), written to the device so one
// small copy per micro-batch brings every loss part to the host.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace spes::cuda {

// sums[0] = Σ_{i<n} losses[i], sums[1] = Σ_{i<n} lse[i]² (double, one block).
void loss_sums(double* sums, const float* losses, const float* lse, int64_t n, cudaStream_t stream);

}  // namespace spes::cuda
