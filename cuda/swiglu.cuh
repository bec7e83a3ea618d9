// Expert SwiGLU activation on the device: h = silu(gate) ⊙ up, silu(g) = g·σ(g),
// forward and backward side by side (semantics: cpu::swiglu_forward/backward).
//
// The expert GEMM writes gate and up side by side in one [rows, 2H] buffer (gate in
// columns [0, H), up in [H, 2H)), so the kernels take row strides: `ld_in` is the
// row stride of gate/up (and dgate/dup), h and dh are dense [rows, H]. With separate
// [rows, H] buffers pass ld_in = H. bf16 in and out, fp32 math.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace spes::cuda {

// h[r, c] = silu(gate[r·ld_in + c]) · up[r·ld_in + c], r < rows, c < H.
void swiglu_forward(bf16* h, const bf16* gate, const bf16* up, int64_t rows, int64_t H, int64_t ld_in,
                    cudaStream_t stream);

// dgate = dh·u·σ(g)·(1 + g·(1 − σ(g))), dup = dh·silu(g) (strided like gate/up).
// h_out (nullable, dense [rows, H]) receives the recomputed forward h, so the
// forward need not keep h alive until backward. h_out may alias dh, and dgate/dup
// may alias gate/up: each element is read before the same thread overwrites it.
void swiglu_backward(bf16* dgate, bf16* dup, bf16* h_out, const bf16* dh, const bf16* gate,
                     const bf16* up, int64_t rows, int64_t H, int64_t ld_in, cudaStream_t stream);

}  // namespace spes::cuda
