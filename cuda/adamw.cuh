// AdamW over the owned parameter ranges: fp32 master weights and moments, the bf16 compute copy written back in the same pass. Same formula as
// cpu::adamw_update (PyTorch AdamW, single-tensor arrangement).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace spes::cuda {

// One contiguous range of n parameters, step t ≥ 1:
//   g = grad·(*grad_scale)   (grad_scale: device pointer, nullable = 1; the
//                             clipping factor written by global_norm_clip, so no
//                             host round trip sits between the norm and the update)
//   m = β1·m + (1−β1)·g;  v = β2·v + (1−β2)·g²
//   master = master·(1 − lr·wd) − (lr/bc1)·m / (√v/√bc2 + eps)
//   weights (bf16, nullable) = round_to_nearest(master)
// One pass: reads grad, master, m, v (16 B) and writes master, m, v, weights
// (14 B) per parameter. 16-byte vector path when master/grad/m/v are 16-byte
// aligned (and weights 8-byte aligned), scalar otherwise.
void adamw_update(float* master, bf16* weights, const float* grad, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t t, const float* grad_scale,
                  cudaStream_t stream);

}  // namespace spes::cuda
