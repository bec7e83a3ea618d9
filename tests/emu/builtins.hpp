// The CUDA built-ins that the emulated kernel files (and the cuda/common.cuh they
// include) use and a host compiler lacks, on the emulator (emu.hpp). Included before
// each kernel file by its generated wrapper (CMakeLists.txt), and first by the tests,
// whose kernel headers include cuda/common.cuh.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "tests/emu/emu.hpp"

// Variables, as in CUDA: thread_local because a CTA runs on one OS thread; the
// scheduler sets threadIdx before it resumes a fiber.
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

#define __launch_bounds__(...)

// A static __shared__ array: one per CTA, seen by all its threads. A CTA runs on one
// OS thread from start to end, one CTA at a time per thread, so a function-local
// thread_local is exactly that. Unlike the dynamic shared memory it is not poisoned
// at the start of a CTA (the emulator does not know where it lies): it holds what
// the previous CTA on that thread left, as on a GPU. (cuda_runtime.h defines
// __shared__ as nothing for a host compiler: a per-thread local.)
#undef __shared__
#define __shared__ static thread_local

inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::syncwarp(); }

// The warp collectives on values of 4 or 8 bytes, full-warp masks only (the only kind
// the kernels use) and CUDA's default width of 32.
namespace emu {
template <typename T>
uint64_t bits_of(unsigned mask, T value, const char* what) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "warp collectives take values of 4 or 8 bytes");
  if (mask != 0xffffffffu) fail(std::string(what) + " with a partial mask");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  return bits;
}
template <typename T>
T shuffled(Shuffle mode, unsigned mask, T value, int b, const char* what) {
  const uint64_t bits = shuffle(mode, bits_of(mask, value, what), b);
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}
}  // namespace emu

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  return emu::shuffled(emu::Shuffle::bfly, mask, value, lane_mask, "__shfl_xor_sync");
}
template <typename T>
T __shfl_up_sync(unsigned mask, T value, unsigned delta) {
  return emu::shuffled(emu::Shuffle::up, mask, value, int(delta), "__shfl_up_sync");
}
template <typename T>
T __shfl_sync(unsigned mask, T value, int src_lane) {
  return emu::shuffled(emu::Shuffle::idx, mask, value, src_lane, "__shfl_sync");
}
template <typename T>
unsigned __match_any_sync(unsigned mask, T value) {
  return emu::match_any(emu::bits_of(mask, value, "__match_any_sync"));
}

inline int __popc(unsigned x) { return std::popcount(x); }

// Integer atomics, shared or global: a CTA's threads switch only at barriers and
// collectives, but CTAs run on several OS threads.
inline int atomicAdd(int* address, int value) { return std::atomic_ref<int>(*address).fetch_add(value); }
inline int atomicExch(int* address, int value) { return std::atomic_ref<int>(*address).exchange(value); }
// membar.gl: the CTAs' OS threads see this one's earlier accesses before its later ones.
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
// The SM's cycle counter: nanoseconds of the host's steady clock (a wait that gives up
// after so many cycles meets the emulator's deadlock report first).
inline long long clock64() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Cache-hinted load (evict-first): a plain load on the host.
template <typename T>
T __ldcs(const T* p) {
  return *p;
}

// Read-only-cache load: a plain load on the host.
template <typename T>
T __ldg(const T* p) {
  return *p;
}

// CUDA's device-side integer min, found unqualified from any namespace.
inline int min(int a, int b) { return a < b ? a : b; }

// rsqrt.approx.f32 is within 2 ulp of 1/√x (CUDA C programming guide, mathematical
// functions); this one rounds twice, within 1 ulp.
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// A product the compiler may not fuse into an FMA (nvcc contracts a·b + c otherwise).
inline float __fmul_rn(float a, float b) {
  volatile float p = a * b;
  return p;
}

inline float __int_as_float(int bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The runtime's C++ overloads for kernel pointers, which cuda_runtime.h declares only
// for nvcc (__CUDACC__).
template <class T>
cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}
template <class T>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, T* kernel) {
  return ::cudaFuncGetAttributes(attr, reinterpret_cast<const void*>(kernel));
}
