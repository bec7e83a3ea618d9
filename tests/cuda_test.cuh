// Helpers for the CUDA-vs-CPU tests (tests/test_cuda_*.cu): one Runtime for the
// process, device buffers filled from host vectors (fp32, or rounded to bf16),
// NaN poisoning of outputs, and reading results back as fp32.
#pragma once
#include <cuda_bf16.h>

#include <cstring>
#include <vector>

#include "cuda/check.cuh"
#include "cuda/common.cuh"
#include "cuda/runtime.cuh"
#include "tests/gpu_test.hpp"

namespace spes::test {

using spes::cuda::bf16;
using spes::cuda::DeviceBuffer;

inline spes::cuda::Runtime& runtime() {
  static spes::cuda::Runtime rt(0);
  return rt;
}
inline cudaStream_t stream() { return runtime().stream(); }

inline float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// The values a bf16 tensor actually holds: what the CPU reference must be fed.
inline std::vector<float> rounded_bf16(std::vector<float> v) {
  for (auto& x : v) x = bf16_round(x);
  return v;
}

// A device tensor of n elements of T (float, bf16, int32_t, …).
template <class T>
struct DevTensor {
  DeviceBuffer buf;
  int64_t n = 0;
  DevTensor() = default;
  explicit DevTensor(int64_t count) : buf(size_t(count > 0 ? count : 1) * sizeof(T), "test tensor"), n(count) {}
  T* get() const { return buf.as<T>(); }
  operator T*() const { return get(); }
  // All bits set: NaN as fp32 and as bf16, so an element a kernel forgot stays NaN.
  void poison() const { cuda_check(cudaMemset(buf.get(), 0xFF, buf.bytes())); }
};

inline DevTensor<float> upload(const std::vector<float>& h) {
  DevTensor<float> d(int64_t(h.size()));
  cuda_check(cudaMemcpy(d.get(), h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}
inline DevTensor<int32_t> upload(const std::vector<int32_t>& h) {
  DevTensor<int32_t> d(int64_t(h.size()));
  cuda_check(cudaMemcpy(d.get(), h.data(), h.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  return d;
}
inline DevTensor<bf16> upload_bf16(const std::vector<float>& h) {
  std::vector<bf16> t(h.size());
  for (size_t i = 0; i < h.size(); ++i) t[i] = __float2bfloat16_rn(h[i]);
  DevTensor<bf16> d(int64_t(h.size()));
  cuda_check(cudaMemcpy(d.get(), t.data(), t.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  return d;
}

// Synchronises the test stream first, so a kernel's errors surface here.
inline std::vector<float> download(const float* d, int64_t n) {
  cuda_check(cudaStreamSynchronize(stream()));
  std::vector<float> h(n);
  cuda_check(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  return h;
}
inline std::vector<float> download(const bf16* d, int64_t n) {
  cuda_check(cudaStreamSynchronize(stream()));
  std::vector<bf16> t(n);
  cuda_check(cudaMemcpy(t.data(), d, n * sizeof(bf16), cudaMemcpyDeviceToHost));
  std::vector<float> h(n);
  for (int64_t i = 0; i < n; ++i) h[i] = __bfloat162float(t[i]);
  return h;
}

inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline std::vector<int32_t> random_tokens(int64_t n, int64_t V) {
  std::uniform_int_distribution<int32_t> d(0, int32_t(V - 1));
  std::vector<int32_t> t(n);
  for (auto& x : t) x = d(rng());
  return t;
}

}  // namespace spes::test
