// What the sm_90a kernel families (cuda/grouped_gemm_sm90.cu, grouped_gemm_tma_sm90.cu,
// attention_sm90.cu, tma_check.cu) ask of a device before they run, asked once per
// device: one probe and one cache for all, so they agree on when Hopper code can run.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <string>

#include "cuda/check.cuh"

namespace spes::cuda {

// Whether the file that includes this was compiled with its sm_90a code: CMake
// defines SPES_SM90A_KERNELS for the sm_90a files where 90 is among the build's
// architectures (CMakeLists.txt). A constant of each file (internal linkage), as the
// macro is: read it in a .cu file only, never in inline or template code of a header,
// which would then mean different things in different files.
#if defined(SPES_SM90A_KERNELS)
constexpr bool kBuiltForSm90a = true;
#else
constexpr bool kBuiltForSm90a = false;
#endif

// Empty when an sm_90a family can run on device `dev`: the build carries its sm_90a
// code (`built_for_sm90a`: its file compiled with SPES_SM90A_KERNELS), the GPU is
// compute capability 9.0, it allows `smem_bytes` of shared memory per block, and the
// driver loaded `kernel` (any of the family's: one module answers for all) as 9.0
// machine code from PTX 9.0 or later (an older architecture's PTX JIT-compiled for the
// GPU reports its own ptxVersion). Else the first requirement that failed.
template <typename Kernel>
std::string sm90a_unavailable_reason(int dev, bool built_for_sm90a, size_t smem_bytes, Kernel kernel) {
  int major = 0, minor = 0, optin = 0;
  cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  cuda_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  cuda_check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  if (!built_for_sm90a)
    return "this build has no sm_90a code (9.0 is not among its CUDA architectures, or it is the host emulator)";
  if (major != 9 || minor != 0)
    return "the GPU is compute capability " + std::to_string(major) + "." + std::to_string(minor) +
           ", sm_90a code runs on 9.0 alone";
  if (smem_bytes > static_cast<size_t>(optin))
    return "the kernels need " + std::to_string(smem_bytes) + " bytes of shared memory per block, the GPU allows " +
           std::to_string(optin);
  cudaFuncAttributes fa{};
  cuda_check(cudaFuncGetAttributes(&fa, kernel));
  if (fa.binaryVersion == 90 && fa.ptxVersion >= 90) return "";
  return "the driver loaded its kernels as binary version " + std::to_string(fa.binaryVersion) + " from PTX " +
         std::to_string(fa.ptxVersion) + ", not sm_90a code";
}

// query(dev) for the current device, computed on its first call there and kept (nothing
// is kept when it throws). Thread-safe: one mutex over all devices (a few calls per step,
// one host thread per GPU). One cache per Info type.
template <typename Info, typename Query>
const Info& per_device(Query query) {
  static std::mutex mu;
  static std::map<int, Info> devices;
  int dev = 0;
  cuda_check(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = devices.find(dev);
  if (it == devices.end()) it = devices.emplace(dev, query(dev)).first;
  return it->second;
}

}  // namespace spes::cuda
