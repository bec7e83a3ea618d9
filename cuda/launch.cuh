// The launch seam of the hand-written kernels: the <<<>>> launch, the attributed
// launch (thread-block clusters), the dynamic shared memory and the sm_90 guard, the
// constructs a kernel file needs that a host C++ compiler cannot take or that the
// host must run differently. Kept in one header so that the host emulator
// (tests/emu/, test_emu) can compile the kernel files unchanged as C++
// with its own tests/emu/cuda/launch.cuh shadowing this one: same names, same
// signatures.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>

// 1 in a compilation pass that emits device code for sm_90 or later, else 0. Kernel
// bodies that need sm_90 hardware (thread-block clusters, distributed shared memory)
// are compiled under it: empty in the host pass and for older GPUs, and the launcher
// asks cudaFuncGetAttributes' ptxVersion whether the build holds them. A project macro
// rather than __CUDA_ARCH__ itself so that the emulator, which runs those bodies as an
// H100 in a host build, can set it to 1.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SPES_SM90_DEVICE_CODE 1
#else
#define SPES_SM90_DEVICE_CODE 0
#endif

namespace spes::cuda {

// The CTA's dynamic shared memory (the launch's smem_bytes) as an array of T; every
// extern __shared__ array names the same base. Declared here, at namespace scope,
// rather than in each kernel so that the emulator can give each CTA its own; a kernel
// reads it as `float* smem = dynamic_smem<float>;`, which compiles to the same PTX as
// `extern __shared__ float smem[];` in the kernel (an accessor function did not: it
// reordered address arithmetic in attention.cu's dkv kernel; nor did a cast of a byte
// array in the norm kernels).
template <typename T>
extern __shared__ __align__(16) T dynamic_smem[];

// kernel<<<grid, block, smem_bytes, stream>>>(args...); the arguments convert to the
// kernel's parameter types here, as in a call.
template <typename... Params>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
            std::type_identity_t<Params>... args) {
  kernel<<<grid, block, smem_bytes, stream>>>(args...);
}

// cudaLaunchKernelEx(&config, kernel, args...): a launch with attributes (a cluster
// dimension); returns its error as the runtime does. Here rather than called directly
// because the runtime's C entry point takes the arguments as void*, which the
// emulator could not call the kernel with: its twin keeps the types.
template <typename... Params>
cudaError_t launch_ex(const cudaLaunchConfig_t& config, void (*kernel)(Params...),
                      std::type_identity_t<Params>... args) {
  return cudaLaunchKernelEx(&config, kernel, args...);
}

}  // namespace spes::cuda
