// What the two grouped GEMM kernel families share (cuda/grouped_gemm.cu's portable
// mma.sync one, cuda/grouped_gemm_sm90.cu's wgmma one): the expert limit, the operand
// layouts, and what a forward or backward-input tile's store writes. Internal to
// those two files; the public contract is cuda/grouped_gemm.cuh.
#pragma once
#include "cuda/common.cuh"

namespace spes::cuda::grouped {

// grouped_gemm.cuh's E ≤ 256: each family's tile scan gives every expert one thread
// of a CTA (each family asserts that its CTA has that many).
constexpr int kMaxExperts = 256;

// Which operand index is contiguous in global memory: k (K-major) or the operand's m
// or n (MN-major). No operand is ever transposed in memory.
enum class Major { k, mn };

// What a forward or backward-input tile's store writes: the product, or SwiGLU's
// forward or backward computed from it on the way out.
enum class Epilogue {
  plain,            // out = the product
  swiglu_forward,   // the gate|up forward: out = gate|up ([S, 2N]), h = silu(gate)·up ([S, N])
  swiglu_backward,  // the down backward-input: the product is dh ([S, N]); out = h recomputed,
                    // dgate_up = the gradients of gate_up's gate and up ([S, 2N])
};

// The SwiGLU epilogues' tensors besides out (null where an epilogue has no use for one).
struct SwigluOperands {
  const bf16* gate_up;  // swiglu_backward: read
  bf16* dgate_up;       // swiglu_backward: written
  bf16* h;              // swiglu_forward: written
};

__device__ __forceinline__ int clamp_int(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

}  // namespace spes::cuda::grouped
