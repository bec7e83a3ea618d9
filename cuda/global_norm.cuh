// Global gradient norm and the clipping factor (the trainer's global-norm gradient
// clipping), deterministic: a fixed partition of each span (a function of its
// length only, not of the device) into blocks, each summed in a fixed order in
// double, then the partials added in a fixed order — the same total on every run
// and every GPU. No float atomics.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace spes::cuda {

struct GradSpan {
  const float* ptr;
  int64_t n;
};

// Scratch (partials) for these spans; plan it once.
size_t global_norm_scratch_bytes(const GradSpan* spans, int n_spans);

// *norm_sq (device double) = Σ over all spans of g² (accumulated in double);
// *scale (device float, nullable) = max_norm / (√norm_sq + 1e-6) when max_norm > 0
// and √norm_sq > max_norm, else 1 — the rule of the CPU trainer; adamw_update reads
// it as its grad_scale. Copy *norm_sq back asynchronously for logging / NaN checks.
void global_norm_clip(double* norm_sq, float* scale, const GradSpan* spans, int n_spans, double max_norm,
                      void* scratch, size_t scratch_bytes, cudaStream_t stream);

}  // namespace spes::cuda
