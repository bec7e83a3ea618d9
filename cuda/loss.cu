#include "cuda/loss.cuh"

#include "cuda/check.cuh"
#include "cuda/common.cuh"
#include "cuda/launch.cuh"

namespace spes::cuda {

namespace {

constexpr int kThreads = 1024;

// One block: thread t sums i ≡ t (mod 1024) in order, then a fixed tree. A few
// microseconds for 64k tokens, once per micro-batch.
__global__ void __launch_bounds__(kThreads) loss_sums_kernel(double* __restrict__ sums, const float* __restrict__ losses,
                                                             const float* __restrict__ lse, int64_t n) {
  __shared__ double s_loss[kThreads], s_z[kThreads];
  double a = 0.0, z = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    a += double(losses[i]);
    z += double(lse[i]) * double(lse[i]);
  }
  s_loss[threadIdx.x] = a;
  s_z[threadIdx.x] = z;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) {
      s_loss[threadIdx.x] += s_loss[threadIdx.x + w];
      s_z[threadIdx.x] += s_z[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    sums[0] = s_loss[0];
    sums[1] = s_z[0];
  }
}

}  // namespace

void loss_sums(double* sums, const float* losses, const float* lse, int64_t n, cudaStream_t stream) {
  require(sums != nullptr && losses != nullptr && lse != nullptr && n >= 0, "loss_sums", "needs buffers and n ≥ 0");
  launch(loss_sums_kernel, 1, kThreads, 0, stream, sums, losses, lse, n);
  cuda_check_launch();
}

}  // namespace spes::cuda
