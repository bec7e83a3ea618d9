// Device buffers for one cuda::MoeLayer outside a model (its tests and benches):
// every MoeSaved and MoeScratch buffer carved from one cudaMalloc, 256-byte aligned,
// filled with 0xFF bytes (NaN in fp32 and bf16) so a read before a write shows.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/check.cuh"
#include "cuda/moe.cuh"
#include "cuda/router.cuh"
#include "cuda/runtime.cuh"

namespace spes::test {

class MoeLayerBuffers {
 public:
  explicit MoeLayerBuffers(const cuda::MoeShape& s) {
    carve(s);  // null base: sizes only
    memory_ = cuda::DeviceBuffer(size_t(used_), "MoE layer buffers");
    cuda_check(cudaMemsetAsync(memory_.get(), 0xFF, memory_.bytes(), nullptr));
    cuda_check(cudaDeviceSynchronize());  // done before any stream's work uses the buffers
    used_ = 0;
    carve(s);
  }
  cuda::MoeSaved saved;
  cuda::MoeScratch scratch;

 private:
  template <class T>
  T* take(int64_t count) {
    used_ = (used_ + 255) / 256 * 256;
    T* p = memory_.get() ? reinterpret_cast<T*>(memory_.as<char>() + used_) : nullptr;
    used_ += int64_t(sizeof(T)) * count;
    return p;
  }
  void carve(const cuda::MoeShape& s) {
    const int64_t N = s.tokens, E = s.n_experts, K = s.top_k, S = s.slots(), d = s.d_model, H = s.hidden;
    saved = {take<float>(N * E),  take<float>(N),        take<int32_t>(N * K),       take<float>(N * K),
             take<int32_t>(E + 1), take<int32_t>(S),     take<int32_t>(S),           take<float>(E),
             take<float>(2),       take<cuda::bf16>(S * d), take<cuda::bf16>(S * 2 * H), take<cuda::bf16>(S * d),
             take<void*>(cuda::moe_gemm_pointer_count(E))};
    scratch = {take<float>(cuda::router_partials_count(N, E)), take<int32_t>(cuda::moe_dispatch_scratch_count(N, E, K)),
               take<cuda::bf16>(S * H), take<cuda::bf16>(S * d), take<cuda::bf16>(S * 2 * H), take<float>(N * K),
               take<cuda::bf16>(N * E)};
  }
  cuda::DeviceBuffer memory_;
  int64_t used_ = 0;
};

}  // namespace spes::test
