// fp32 → bf16 casts: the compute copy of θ is made from fp32 values (a loaded
// checkpoint, a sync round's θ) with round-to-nearest-even, as adamw_update writes it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace spes::cuda {

// out[i] = bf16(in[i]) for i < n. Any alignment (16-byte vector path when aligned).
void float_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t stream);

// out[i] = bf16(host[i]) for i < n from fp32 values in host memory, through a device
// buffer of `staging_count` fp32 values, one chunk at a time: a θ of any size (a
// loaded checkpoint, a sync round's θ) becomes compute weights through a staging
// buffer of fixed size. The chunks reuse the buffer in stream order. `host` should be
// pinned (else each copy blocks) and must not change until the stream is synchronised.
void float_to_bf16_from_host(bf16* out, const float* host, int64_t n, float* staging, int64_t staging_count,
                             cudaStream_t stream);

}  // namespace spes::cuda
