// The CUDA built-ins that cuda/attention.cu (and the cuda/common.cuh it includes)
// use and a host compiler lacks, on the emulator (emu.hpp). Included before the
// kernels' source by attention_emu.cpp only, so that the test itself sees none of them.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "tests/emu/emu.hpp"

// Variables, as in CUDA: thread_local because a CTA runs on one OS thread; the
// scheduler sets threadIdx before it resumes a fiber.
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

#define __launch_bounds__(...)

inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::syncwarp(); }

// Full-warp masks only (the only kind the kernels use).
template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffled values are 4 or 8 bytes");
  if (mask != 0xffffffffu) emu::fail("__shfl_xor_sync with a partial mask");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = emu::shfl_xor(bits, lane_mask);
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

// Cache-hinted load (evict-first): a plain load on the host.
template <typename T>
T __ldcs(const T* p) {
  return *p;
}

// CUDA's device-side integer min, found unqualified from any namespace.
inline int min(int a, int b) { return a < b ? a : b; }

// The runtime's C++ overload for kernel pointers, which cuda_runtime.h declares only
// for nvcc (__CUDACC__).
template <class T>
cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}
