// fp32 → bf16 casts: the compute copy of θ is made from fp32 values (a loaded
// checkpoint, a sync round's θ) with round-to-nearest-even, as adamw_update writes it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace spes::cuda {

// out[i] = bf16(in[i]) for i < n. Any alignment (16-byte vector path when aligned).
void float_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t stream);

}  // namespace spes::cuda
