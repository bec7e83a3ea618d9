#include "cuda/convert.cuh"

#include "cuda/check.cuh"
#include "cuda/device_common.cuh"
#include "cuda/launch.cuh"

namespace spes::cuda {

namespace {

constexpr int kThreads = 256;

// 8 values per thread when both pointers allow 16-/32-byte vectors, else 1.
__global__ void float_to_bf16_kernel(bf16* __restrict__ out, const float* __restrict__ in, int64_t n, bool vec) {
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  if (vec) {
    for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n / 8; i += stride) {
      const float4 a = reinterpret_cast<const float4*>(in)[2 * i];
      const float4 b = reinterpret_cast<const float4*>(in)[2 * i + 1];
      const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      reinterpret_cast<int4*>(out)[i] = pack8(f);
    }
    for (int64_t i = n / 8 * 8 + int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride)
      out[i] = __float2bfloat16_rn(in[i]);
  } else {
    for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride)
      out[i] = __float2bfloat16_rn(in[i]);
  }
}

}  // namespace

void float_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t stream) {
  require(n >= 0 && (n == 0 || (out != nullptr && in != nullptr)), "float_to_bf16", "needs buffers for n ≥ 0 values");
  if (n == 0) return;
  const bool vec = aligned(out, 16) && aligned(in, 16);
  const int64_t work = vec ? ceil_div(n, 8) : n;
  const unsigned blocks = unsigned(std::min<int64_t>(ceil_div(work, kThreads), 8192));
  launch(float_to_bf16_kernel, blocks, kThreads, 0, stream, out, in, n, vec);
  cuda_check_launch();
}

void float_to_bf16_from_host(bf16* out, const float* host, int64_t n, float* staging, int64_t staging_count,
                             cudaStream_t stream) {
  require(staging_count > 0 && staging != nullptr, "float_to_bf16_from_host", "needs a staging buffer");
  for (int64_t c0 = 0; c0 < n; c0 += staging_count) {
    const int64_t c = std::min(staging_count, n - c0);
    cuda_check(cudaMemcpyAsync(staging, host + c0, size_t(c) * sizeof(float), cudaMemcpyHostToDevice, stream));
    float_to_bf16(out + c0, staging, c, stream);
  }
}

}  // namespace spes::cuda
