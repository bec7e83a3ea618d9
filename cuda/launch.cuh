// The launch seam of the hand-written kernels: the <<<>>> launch and the dynamic
// shared memory, the two constructs every kernel file needs that a host C++ compiler
// cannot take. Kept in one header so that the host emulator (tests/emu/, the
// test_emu_* tests) can compile the kernel files unchanged as C++ with its own
// tests/emu/cuda/launch.cuh shadowing this one: same names, same signatures.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>

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

}  // namespace spes::cuda
