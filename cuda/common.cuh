// What the kernels and their launchers share, all of it host-safe (a file that only
// calls launchers is plain C++): the bf16 type, size arithmetic, the launchers'
// argument checks, the shared-memory opt-in. The device-side building blocks are in
// device_common.cuh.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "cuda/check.cuh"
#include "engine/base/error.hpp"

namespace spes::cuda {

using bf16 = __nv_bfloat16;

constexpr int kWarp = 32;

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

inline bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Host-side argument check for launchers: throws spes::Error naming the op.
inline void require(bool ok, const char* op, const std::string& what) {
  if (!ok) throw Error(std::string(op) + ": " + what);
}

// Pointer checks for launchers, run before any CUDA call so that a bad pointer is one
// clear error line ("op: name must be 16-byte aligned (got 0x…)") rather than a
// misaligned-address fault reported at some later, unrelated call.
// require_aligned: p may be null (optional argument); require_ptr: p must not be.
inline void require_aligned(const void* p, size_t bytes, const char* op, const char* name) {
  if (p == nullptr || aligned(p, bytes)) return;
  char addr[32];
  std::snprintf(addr, sizeof addr, "%p", p);
  throw Error(std::string(op) + ": " + name + " must be " + std::to_string(bytes) + "-byte aligned (got " + addr +
              ")");
}
inline void require_ptr(const void* p, size_t bytes, const char* op, const char* name) {
  require(p != nullptr, op, std::string(name) + " must not be null");
  require_aligned(p, bytes, op, name);
}
// For a kernel that reads `read` through a __restrict__ pointer while it writes
// `written`: on a GPU the two must not overlap (the compiler may load the first
// through the read-only path, ahead of the stores); the emulator cannot show it.
inline void require_disjoint(const void* written, size_t written_bytes, const void* read, size_t read_bytes,
                             const char* op, const char* what) {
  const auto w = reinterpret_cast<uintptr_t>(written), r = reinterpret_cast<uintptr_t>(read);
  if (written && read && written_bytes && read_bytes && w < r + read_bytes && r < w + written_bytes)
    throw Error(std::string(op) + ": " + what);
}

// Above 48 KB of dynamic shared memory a kernel must opt in, per device. Done once per
// (kernel, device), so that steady-state launches (and graph capture) make no extra
// calls; a GPU whose opt-in limit is below `bytes` gets one error line naming the op
// instead of a failed launch.
template <typename Kernel>
void allow_dynamic_smem(const char* op, Kernel kernel, size_t bytes) {
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  int dev = 0;
  cuda_check(cudaGetDevice(&dev));
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), dev};
  std::lock_guard<std::mutex> lock(mu);
  if (done.count(key)) return;
  int optin = 0;
  cuda_check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  require(bytes <= static_cast<size_t>(optin), op,
          "needs " + std::to_string(bytes) + " bytes of shared memory per block but GPU " + std::to_string(dev) +
              " allows " + std::to_string(optin));
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  done.insert(key);
}

}  // namespace spes::cuda
