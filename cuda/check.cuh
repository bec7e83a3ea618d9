// Checked CUDA / cuBLAS / NCCL calls: every call goes through one of these, which
// throws spes::Error naming the call, file:line and the library's own message.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "engine/base/error.hpp"

namespace spes::cuda {

[[noreturn]] void throw_cuda_error(const char* what, const char* msg, const char* file, int line);

inline void cuda_check_impl(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess) throw_cuda_error(what, cudaGetErrorString(e), file, line);
}
inline void cublas_check_impl(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) throw_cuda_error(what, cublasGetStatusString(s), file, line);
}
inline void nccl_check_impl(ncclResult_t r, const char* what, const char* file, int line) {
  if (r != ncclSuccess) throw_cuda_error(what, ncclGetErrorString(r), file, line);
}

}  // namespace spes::cuda

#define cuda_check(call) ::spes::cuda::cuda_check_impl((call), #call, __FILE__, __LINE__)
#define cublas_check(call) ::spes::cuda::cublas_check_impl((call), #call, __FILE__, __LINE__)
#define nccl_check(call) ::spes::cuda::nccl_check_impl((call), #call, __FILE__, __LINE__)
// After a kernel launch: catches bad launch configurations at the launch site.
#define cuda_check_launch() cuda_check(cudaGetLastError())
