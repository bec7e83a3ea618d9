#include "cuda/check.cuh"
#include "cuda/device_probe.hpp"

namespace spes::cuda {

void throw_cuda_error(const char* what, const char* msg, const char* file, int line) {
  throw Error(std::string("CUDA error: ") + what + " failed at " + file + ":" + std::to_string(line) +
              ": " + msg);
}

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
  cublasLtHandle_t lt = nullptr;
  cublasStatus_t s = cublasLtCreate(&lt);
  if (s != CUBLAS_STATUS_SUCCESS) {
    *reason = std::string("cublasLtCreate: ") + cublasGetStatusString(s);
    return false;
  }
  cublasLtDestroy(lt);
  return true;
}

bool gpu_available(std::string* reason) {
  // Probed once: the answer cannot change within a process.
  static std::string why;
  static const bool ok = probe(&why);
  if (reason) *reason = why;
  return ok;
}

}  // namespace spes::cuda
