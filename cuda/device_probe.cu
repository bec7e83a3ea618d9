#include "cuda/check.cuh"
#include "cuda/device_probe.hpp"
#include "cuda/matmul.cuh"
#include "cuda/runtime.cuh"

namespace spes::cuda {

void throw_cuda_error(const char* what, const char* msg, const char* file, int line) {
  throw Error(std::string("CUDA error: ") + what + " failed at " + file + ":" + std::to_string(line) +
              ": " + msg);
}

// A kernel that does nothing: its attributes exist only if this binary carries code
// (or PTX) the device can run.
__global__ void probe_kernel() {}

static bool probe(std::string* reason) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    *reason = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e);
    return false;
  }
  if (count == 0) {
    *reason = "no CUDA device";
    return false;
  }
  int dev = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess) {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, probe_kernel) != cudaSuccess) {
      cudaGetLastError();  // clear it, so that later checks do not report it
      *reason = std::string(prop.name) + " is sm_" + std::to_string(prop.major) + std::to_string(prop.minor) +
                " but this binary has no code for it (rebuild with CUDA_ARCHS=\"" + std::to_string(prop.major) +
                std::to_string(prop.minor) + "\")";
      return false;
    }
  }
  cublasLtHandle_t lt = nullptr;
  cublasStatus_t s = cublasLtCreate(&lt);
  if (s != CUBLAS_STATUS_SUCCESS) {
    *reason = std::string("cublasLtCreate: ") + cublasGetStatusString(s);
    return false;
  }
  cublasLtDestroy(lt);
  return true;
}

int gpu_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

bool gpu_available(std::string* reason) {
  // Probed once: the answer cannot change within a process.
  static std::string why;
  static const bool ok = probe(&why);
  if (reason) *reason = why;
  return ok;
}

namespace {

// Dense bf16 tensor-core peak by device name (datasheet, dense), 0 when unknown.
double datasheet_bf16_peak(const std::string& name) {
  struct Row {
    const char* match;
    double flops;
  };
  static const Row rows[] = {{"H200", 989.4e12}, {"H100 PCIe", 756.0e12}, {"H100 NVL", 835.0e12},
                             {"H100", 989.4e12}, {"A100", 312.0e12}};
  for (const Row& r : rows)
    if (name.find(r.match) != std::string::npos) return r.flops;
  return 0;
}

double measured_bf16_peak(const Runtime& rt) {
  const int64_t n = 4096;
  const cudaStream_t stream = rt.stream();
  DeviceBuffer a(size_t(n * n) * 2, "peak GEMM"), b(size_t(n * n) * 2, "peak GEMM"), c(size_t(n * n) * 2, "peak GEMM");
  cuda_check(cudaMemsetAsync(a.get(), 0x3c, a.bytes(), stream));  // bf16 ≈ 0.0116, not zero
  cuda_check(cudaMemsetAsync(b.get(), 0x3c, b.bytes(), stream));
  cudaEvent_t e0, e1;
  cuda_check(cudaEventCreate(&e0));
  cuda_check(cudaEventCreate(&e1));
  auto gemm = [&] {
    rt.gemm().run(false, false, n, n, n, a.as<bf16>(), n, b.as<bf16>(), n, c.get(), DType::bf16, n, 1.0f, 0.0f,
                  stream);
  };
  for (int i = 0; i < 3; ++i) gemm();
  cuda_check(cudaEventRecord(e0, stream));
  const int reps = 20;
  for (int i = 0; i < reps; ++i) gemm();
  cuda_check(cudaEventRecord(e1, stream));
  cuda_check(cudaEventSynchronize(e1));
  float ms = 0;
  cuda_check(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 2.0 * double(n) * n * n * reps / (double(ms) / 1e3);
}

}  // namespace

double bf16_peak_flops(const Runtime& rt, std::string* source) {
  const std::string& name = rt.info().name;
  if (const double flops = datasheet_bf16_peak(name); flops > 0) {
    if (source) *source = "datasheet dense bf16 peak of " + name;
    return flops;
  }
  if (source) *source = "a 4096³ bf16 GEMM measured at start-up on " + name;
  return measured_bf16_peak(rt);
}

}  // namespace spes::cuda
