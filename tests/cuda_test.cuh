// Helpers for the CUDA-vs-CPU tests (tests/test_cuda_*.cu): one Runtime for the
// process, device buffers filled from host vectors (fp32, or rounded to bf16),
// NaN poisoning of outputs, and reading results back as fp32 — all on the
// runtime's stream, the one every kernel under test is launched on.
#pragma once
#include <cuda_bf16.h>

#include <cstring>
#include <vector>

#include "cuda/check.cuh"
#include "cuda/common.cuh"
#include "cuda/runtime.cuh"
#include "tests/bf16_values.hpp"
#include "tests/gpu_test.hpp"

namespace spes::test {

using spes::cuda::bf16;
using spes::cuda::DeviceBuffer;

inline spes::cuda::Runtime& runtime() {
  static spes::cuda::Runtime rt(0);
  return rt;
}
inline cudaStream_t stream() { return runtime().stream(); }

// Every helper below works on the runtime's stream. That stream is
// cudaStreamNonBlocking, so work on the legacy default stream (cudaMemset,
// cudaMemcpy, a <<<…>>> launch without a stream) is NOT ordered with the kernels
// under test: a poison could land after the kernel wrote its output.

// Host → device on the test stream, then synchronised: `h` is pageable and often a
// temporary that is gone as soon as the caller's statement ends.
template <class T>
inline void copy_to_device(T* d, const T* h, int64_t n) {
  if (n <= 0) return;
  cuda_check(cudaMemcpyAsync(d, h, size_t(n) * sizeof(T), cudaMemcpyHostToDevice, stream()));
  cuda_check(cudaStreamSynchronize(stream()));
}

// Device → host after everything queued on the test stream (so a kernel's errors
// surface here).
template <class T>
inline std::vector<T> copy_to_host(const T* d, int64_t n) {
  std::vector<T> h(size_t(n > 0 ? n : 0));
  if (n > 0) cuda_check(cudaMemcpyAsync(h.data(), d, size_t(n) * sizeof(T), cudaMemcpyDeviceToHost, stream()));
  cuda_check(cudaStreamSynchronize(stream()));
  return h;
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
  void poison() const { cuda_check(cudaMemsetAsync(buf.get(), 0xFF, buf.bytes(), stream())); }
  void zero() const { cuda_check(cudaMemsetAsync(buf.get(), 0, buf.bytes(), stream())); }
};

inline DevTensor<float> upload(const std::vector<float>& h) {
  DevTensor<float> d(int64_t(h.size()));
  copy_to_device(d.get(), h.data(), int64_t(h.size()));
  return d;
}
inline DevTensor<int32_t> upload(const std::vector<int32_t>& h) {
  DevTensor<int32_t> d(int64_t(h.size()));
  copy_to_device(d.get(), h.data(), int64_t(h.size()));
  return d;
}
inline DevTensor<bf16> upload_bf16(const std::vector<float>& h) {
  std::vector<bf16> t(h.size());
  for (size_t i = 0; i < h.size(); ++i) t[i] = __float2bfloat16_rn(h[i]);
  DevTensor<bf16> d(int64_t(h.size()));
  copy_to_device(d.get(), t.data(), int64_t(t.size()));
  return d;
}

inline std::vector<float> download(const float* d, int64_t n) { return copy_to_host(d, n); }
inline std::vector<float> download(const bf16* d, int64_t n) {
  const std::vector<bf16> t = copy_to_host(d, n);
  std::vector<float> h(t.size());
  for (size_t i = 0; i < t.size(); ++i) h[i] = __bfloat162float(t[i]);
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
