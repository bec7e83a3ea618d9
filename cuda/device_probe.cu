#include "cuda/check.cuh"
#include "cuda/device_probe.hpp"

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

}  // namespace spes::cuda
