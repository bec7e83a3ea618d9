// Global gradient norm: pass 1 (one launch per span) — a span of n values is cut
// into P(n) = clamp(⌈n / 65536⌉, 1, 1024) blocks of 256 threads; block b sums the
// float4s b·256 + tid + k·P·256 (k = 0, 1, …) per thread in double, then the
// block's threads in a fixed tree, into partial[b]. Pass 2: one warp adds all
// partials lane-strided in order, then a fixed shuffle tree. Reads each gradient
// once (4 B/param).
#include <algorithm>
#include <cmath>

#include "cuda/check.cuh"
#include "cuda/device_common.cuh"
#include "cuda/global_norm.cuh"
#include "cuda/launch.cuh"

namespace spes::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kPerBlock = 65536;
constexpr int kMaxBlocks = 1024;

int span_blocks(int64_t n) { return static_cast<int>(std::clamp<int64_t>(ceil_div(n, kPerBlock), 1, kMaxBlocks)); }

__device__ __forceinline__ double sq(float x) { return static_cast<double>(x) * static_cast<double>(x); }

__global__ void __launch_bounds__(kThreads) sum_squares_kernel(double* __restrict__ partial,
                                                               const float* __restrict__ g, int64_t n, bool vec) {
  __shared__ double s[kThreads / kWarp];
  double acc = 0.0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  if (vec) {
    const int64_t n4 = n / 4;
    const float4* g4 = reinterpret_cast<const float4*>(g);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n4; i += stride) {
      const float4 x = __ldcs(g4 + i);
      acc += sq(x.x);
      acc += sq(x.y);
      acc += sq(x.z);
      acc += sq(x.w);
    }
    // the n mod 4 tail goes to block 0, threads 0..2
    if (blockIdx.x == 0 && threadIdx.x < n - n4 * 4) acc += sq(g[n4 * 4 + threadIdx.x]);
  } else {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) acc += sq(g[i]);
  }
  acc = warp_sum(acc);
  if (threadIdx.x % kWarp == 0) s[threadIdx.x / kWarp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int w = 0; w < kThreads / kWarp; ++w) t += s[w];
    partial[blockIdx.x] = t;
  }
}

// One warp.
__global__ void norm_finish_kernel(double* __restrict__ norm_sq, float* __restrict__ scale,
                                   const double* __restrict__ partial, int count, double max_norm) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += kWarp) acc += partial[i];
  acc = warp_sum(acc);
  if (threadIdx.x == 0) {
    *norm_sq = acc;
    if (scale) {
      const double norm = sqrt(acc);
      *scale = (max_norm > 0.0 && norm > max_norm) ? static_cast<float>(max_norm / (norm + 1e-6)) : 1.0f;
    }
  }
}

}  // namespace

size_t global_norm_scratch_bytes(const GradSpan* spans, int n_spans) {
  size_t count = 0;
  for (int i = 0; i < n_spans; ++i) count += span_blocks(spans[i].n);
  return std::max<size_t>(count, 1) * sizeof(double);
}

void global_norm_clip(double* norm_sq, float* scale, const GradSpan* spans, int n_spans, double max_norm,
                      void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  const char* op = "global_norm_clip";
  require(scratch != nullptr && aligned(scratch, 8) && scratch_bytes >= global_norm_scratch_bytes(spans, n_spans),
          op, "scratch must be 8-byte aligned and hold global_norm_scratch_bytes(spans)");
  double* partial = static_cast<double*>(scratch);
  int count = 0;
  for (int i = 0; i < n_spans; ++i) {
    if (spans[i].n <= 0) continue;
    const int blocks = span_blocks(spans[i].n);
    launch(sum_squares_kernel, blocks, kThreads, 0, stream, partial + count, spans[i].ptr, spans[i].n,
           aligned(spans[i].ptr, 16));
    cuda_check_launch();
    count += blocks;
  }
  launch(norm_finish_kernel, 1, kWarp, 0, stream, norm_sq, scale, partial, count, max_norm);
  cuda_check_launch();
}

}  // namespace spes::cuda
