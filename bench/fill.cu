// The benches' buffer fill (declared in common.cuh): a hash of the element index and
// the seed, mapped to scale·[-1, 1), in a grid-stride loop.
#include "bench/common.cuh"

namespace spes::bench {
namespace {

__device__ float hashed_unit(int64_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return (h & 0xffffff) / 8388608.0f - 1.0f;
}

template <class T>
__global__ void fill_kernel(T* x, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = static_cast<T>(scale * hashed_unit(i, seed));
}

}  // namespace

void fill(__nv_bfloat16* x, int64_t n, cudaStream_t stream, uint32_t seed, float scale) {
  fill_kernel<<<1024, 256, 0, stream>>>(x, n, seed, scale);
  cuda_check_launch();
}
void fill(float* x, int64_t n, cudaStream_t stream, uint32_t seed, float scale) {
  fill_kernel<<<1024, 256, 0, stream>>>(x, n, seed, scale);
  cuda_check_launch();
}

}  // namespace spes::bench
