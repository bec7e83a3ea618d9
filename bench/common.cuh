// Shared bench harness for the CUDA microbenchmarks (bench/bench_*.cu).
//
// Every bench prints, per kernel: the problem size, the median time over >= 20
// timed runs after warm-up (CUDA events around each run), the achieved GB/s or
// TFLOP/s, and that figure as a % of a ceiling this same process measures on this
// device: a large device-to-device copy (GB/s, bytes read + bytes written) and a
// large cuBLAS bf16 GEMM (TFLOP/s, fp32 accumulation). Comparing against measured
// ceilings rather than datasheet peaks keeps the percentages honest across SKUs
// (H100 SXM vs PCIe, clocks, ECC).
//
// Byte convention: "bytes" passed to a row are the bytes the kernel must move at
// minimum (every input read once + every output written once), the same
// convention the copy ceiling uses (a copy of n bytes moves 2n).
//
// One stream: Bench owns the process's Runtime, and the fills, the ceilings and
// every timed row run on its stream (b.stream(), cudaStreamNonBlocking). Work on
// the legacy default stream would not be ordered with it, so benches launch
// everything on b.stream() and copy with the helpers below.
//
// Usage:
//   int main() {
//     spes::bench::Bench b;                  // prints "no GPU: <why>" and sets !ok()
//     if (!b.ok()) return 0;
//     cudaStream_t s = b.stream();
//     b.mem_row("rmsnorm fwd", "16384x768", [&] { launch(..., s); }, bytes);
//     b.flop_row("gemm", "16384x768x2048", [&] { ... }, flops);
//   }
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cuda/check.cuh"
#include "cuda/device_probe.hpp"
#include "cuda/runtime.cuh"

namespace spes::bench {

constexpr int kWarmup = 5;
constexpr int kRuns = 25;  // >= 20 timed runs, median reported

// Median time in ms of `kRuns` runs of f() on `stream`, after `kWarmup` runs.
// Each run is bracketed by its own pair of events so the median discards outliers
// (clock ramp, first-touch, other tenants).
template <class F>
float median_ms(F&& f, cudaStream_t stream, int warmup = kWarmup, int runs = kRuns) {
  for (int i = 0; i < warmup; ++i) f();
  cuda_check(cudaStreamSynchronize(stream));
  std::vector<cudaEvent_t> ev(2 * runs);
  for (auto& e : ev) cuda_check(cudaEventCreate(&e));
  for (int i = 0; i < runs; ++i) {
    cuda_check(cudaEventRecord(ev[2 * i], stream));
    f();
    cuda_check(cudaEventRecord(ev[2 * i + 1], stream));
  }
  cuda_check(cudaStreamSynchronize(stream));
  cuda_check_launch();
  std::vector<float> t(runs);
  for (int i = 0; i < runs; ++i) cuda_check(cudaEventElapsedTime(&t[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) cuda_check(cudaEventDestroy(e));
  std::nth_element(t.begin(), t.begin() + runs / 2, t.end());
  return t[runs / 2];
}

// Owning device buffer for benches (no arena needed here).
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t n) : bytes(n) { cuda_check(cudaMalloc(&p, n ? n : 1)); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

// Fills a device buffer on `stream` with a deterministic pseudo-random pattern (values
// in scale·[-1, 1)) so benches never time NaN/denormal paths on uninitialised memory.
// The kernels are in fill.cu, so that the benches themselves are plain C++.
void fill(__nv_bfloat16* x, int64_t n, cudaStream_t stream, uint32_t seed = 1, float scale = 1.0f);
void fill(float* x, int64_t n, cudaStream_t stream, uint32_t seed = 1, float scale = 1.0f);
inline void zero(void* x, size_t bytes, cudaStream_t stream) { cuda_check(cudaMemsetAsync(x, 0, bytes, stream)); }
// Host → device on `stream`, synchronised: the pageable source may go away after.
inline void copy_to_device(void* d, const void* h, size_t bytes, cudaStream_t stream) {
  cuda_check(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, stream));
  cuda_check(cudaStreamSynchronize(stream));
}

// Ceiling 1: large device-to-device copy, GB/s counting read + write bytes.
inline double measure_copy_gbps(cudaStream_t stream) {
  const size_t n = size_t(1) << 30;  // 1 GiB each way: far beyond L2
  DevBuf a(n), b(n);
  cuda_check(cudaMemsetAsync(a.p, 1, n, stream));
  float ms = median_ms([&] { cuda_check(cudaMemcpyAsync(b.p, a.p, n, cudaMemcpyDeviceToDevice, stream)); }, stream);
  return 2.0 * n / (ms * 1e-3) / 1e9;
}

// Ceiling 2: large cuBLAS bf16 GEMM (fp32 accumulate, bf16 out), TFLOP/s, on a
// handle already bound to `stream`.
inline double measure_gemm_tflops(cublasHandle_t h, cudaStream_t stream) {
  const int M = 8192, N = 8192, K = 8192;
  DevBuf A(size_t(M) * K * 2), B(size_t(K) * N * 2), C(size_t(M) * N * 2);
  fill(A.as<__nv_bfloat16>(), int64_t(M) * K, stream, 11, 0.5f);
  fill(B.as<__nv_bfloat16>(), int64_t(K) * N, stream, 12, 0.5f);
  const float alpha = 1.0f, beta = 0.0f;
  float ms = median_ms(
      [&] {
        cublas_check(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, B.p, CUDA_R_16BF, K, A.p,
                                  CUDA_R_16BF, K, &beta, C.p, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
      },
      stream);
  return 2.0 * M * N * K / (ms * 1e-3) / 1e12;
}

// One bench process: probes the GPU, creates the Runtime (stream, cuBLASLt, GEMM
// plans) and a plain cuBLAS handle on the same stream (the peer some benches time us
// against; the engine itself runs cuBLASLt only), measures both ceilings once on the
// stream, prints rows.
class Bench {
 public:
  explicit Bench(bool need_gemm_ceiling = true) {
    std::string why;
    if (!spes::cuda::gpu_available(&why)) {
      std::printf("no GPU: %s\n", why.c_str());
      return;
    }
    ok_ = true;
    rt_ = std::make_unique<spes::cuda::Runtime>(0);
    cublas_check(cublasCreate(&cublas_));
    cublas_check(cublasSetStream(cublas_, stream()));
    cudaDeviceProp prop{};
    cuda_check(cudaGetDeviceProperties(&prop, rt_->info().ordinal));
    copy_gbps_ = measure_copy_gbps(stream());
    if (need_gemm_ceiling) gemm_tflops_ = measure_gemm_tflops(cublas_, stream());
    std::printf("device: %s (sm_%d%d, %d SMs, %.1f GiB)\n", prop.name, prop.major, prop.minor,
                prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0);
    std::printf("ceilings: D2D copy %.0f GB/s (read+write, 1 GiB)", copy_gbps_);
    if (need_gemm_ceiling) std::printf(", cuBLAS bf16 GEMM %.1f TFLOP/s (8192^3)", gemm_tflops_);
    std::printf("\nmedian of %d runs after %d warm-up\n", kRuns, kWarmup);
    std::printf("%-34s %-22s %10s %12s %8s\n", "kernel", "size", "ms", "achieved", "%ceil");
  }
  ~Bench() {
    if (cublas_) cublasDestroy(cublas_);  // destructor path: nothing useful to do on error
  }
  Bench(const Bench&) = delete;
  Bench& operator=(const Bench&) = delete;
  bool ok() const { return ok_; }
  spes::cuda::Runtime& runtime() const { return *rt_; }
  cublasHandle_t cublas() const { return cublas_; }
  cudaStream_t stream() const { return rt_->stream(); }
  double copy_gbps() const { return copy_gbps_; }
  double gemm_tflops() const { return gemm_tflops_; }

  // Memory-bound kernel: `bytes` = minimum bytes moved (reads + writes). f must
  // launch its work on stream(), where it is timed.
  template <class F>
  float mem_row(const std::string& name, const std::string& size, F&& f, double bytes) {
    float ms = median_ms(f, stream());
    double gbps = bytes / (ms * 1e-3) / 1e9;
    std::printf("%-34s %-22s %10.4f %8.0f GB/s %7.1f%%\n", name.c_str(), size.c_str(), ms, gbps,
                100.0 * gbps / copy_gbps_);
    std::fflush(stdout);
    return ms;
  }
  // Compute-bound kernel: `flops` = useful floating-point operations; on stream().
  template <class F>
  float flop_row(const std::string& name, const std::string& size, F&& f, double flops) {
    float ms = median_ms(f, stream());
    double tf = flops / (ms * 1e-3) / 1e12;
    std::printf("%-34s %-22s %10.4f %6.1f TFLOP/s %7.1f%%\n", name.c_str(), size.c_str(), ms, tf,
                gemm_tflops_ > 0 ? 100.0 * tf / gemm_tflops_ : 0.0);
    std::fflush(stdout);
    return ms;
  }

 private:
  bool ok_ = false;
  std::unique_ptr<spes::cuda::Runtime> rt_;
  cublasHandle_t cublas_ = nullptr;
  double copy_gbps_ = 0, gemm_tflops_ = 0;
};

}  // namespace spes::bench
