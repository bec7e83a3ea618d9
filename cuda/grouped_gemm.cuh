// Grouped GEMMs of the MoE experts: one launch per product per layer for all experts,
// reading the expert row ranges from device memory (no host sync, no per-expert host
// call, graph-capturable). Same contract as cuda/matmul.cuh and cpu::matmul_*:
// row-major, weights stored [out, in], bf16 in, fp32 accumulation.
//
// Rows ("slots") are expert-major: expert e owns rows [offsets[e], offsets[e+1]) of
// the [S, ·] activations, offsets[0..E] in DEVICE memory (moe_dispatch_indices writes
// them). offsets must be non-decreasing; rows outside [offsets[0], offsets[E]) are
// neither read nor written, and no row outside [0, S) is ever touched (offsets are
// clamped to [0, S] on the device). Per-expert row counts are arbitrary (0 included).
//
// weights / dweights are DEVICE arrays of E pointers, built once by the caller (the
// weights do not move): weights[e] is W_e, [OC, C] bf16; dweights[e] its fp32
// gradient, [OC, C]. Every pointer in them must be 16-byte aligned (a device table
// the host cannot check).
//
// Requirements, checked on the host before any CUDA call (spes::Error naming op,
// argument and requirement): C and OC positive multiples of 8 (16-byte rows),
// S in [0, INT32_MAX], E in [1, 256], bf16 tensors 16-byte aligned, offsets and
// trained_experts 4-byte aligned, pointer tables 8-byte aligned, the written
// activation disjoint from the read one. S = 0 (or n_trained = 0) is a no-op.
//
// Two kernel families compute these, with the same contract and the same results up
// to summation order: the portable one (mma.sync, any GPU of sm_80 or later) and the
// Hopper one (wgmma, an sm_90 GPU in a build that carries sm_90a code). `path` picks:
// automatic (the default) takes the Hopper family wherever it can run, else the
// portable one; portable and sm90a force one, for tests and benches (sm90a throws
// spes::Error where it cannot run).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/common.cuh"

namespace spes::cuda {

// automatic: the sm90a family where it can run (a compute capability 9.0 GPU and a
// build that carries sm_90a code), else the portable one; the environment variable
// SPES_GROUPED_GEMM=portable keeps it on the portable one.
enum class GroupedGemmPath { automatic, portable, sm90a };

// Whether the sm90a family can run on the current device (asked once per device),
// and if not, why (a sentence for test and bench output; empty when it can).
bool grouped_gemm_sm90a_available();
std::string grouped_gemm_sm90a_unavailable_reason();
// The family `automatic` takes on the current device, as a phrase for logs:
// "sm90a (wgmma)", or "portable" and why.
std::string grouped_gemm_automatic_path_description();

// out[s, 0:OC] = inp[s, 0:C] · W_eᵀ for every expert e and row s of it (bf16 out).
// gate|up: C = d, OC = 2H (gate and up stacked in W_e); down: C = H, OC = d.
void grouped_matmul_forward(bf16* out, const bf16* inp, const bf16* const* weights, const int32_t* offsets,
                            int64_t S, int64_t E, int64_t C, int64_t OC, cudaStream_t stream,
                            GroupedGemmPath path = GroupedGemmPath::automatic);

// The gate|up forward with SwiGLU in its store: gate_up[s, 0:2H] = inp[s, 0:C] · W_eᵀ
// (W_e = weights[e], [2H, C]: gate's rows, then up's) as grouped_matmul_forward with
// OC = 2H, and h[s, 0:H] = silu(gate)·up from those bf16 values, as swiglu_forward
// (cuda/swiglu.cuh) with ld_in = 2H would give: bit for bit the two calls, on either
// path, on the experts' rows (others untouched). Requirements as above (OC = 2H), H a
// multiple of 8, h 16-byte aligned and disjoint from inp and gate_up.
void grouped_matmul_forward_swiglu(bf16* gate_up, bf16* h, const bf16* inp, const bf16* const* weights,
                                   const int32_t* offsets, int64_t S, int64_t E, int64_t C, int64_t H,
                                   cudaStream_t stream, GroupedGemmPath path = GroupedGemmPath::automatic);

// dinp[s, 0:C] = dout[s, 0:OC] · W_e (overwritten, bf16).
void grouped_matmul_backward_input(bf16* dinp, const bf16* dout, const bf16* const* weights,
                                   const int32_t* offsets, int64_t S, int64_t E, int64_t C, int64_t OC,
                                   cudaStream_t stream, GroupedGemmPath path = GroupedGemmPath::automatic);

// The down product's backward-input with SwiGLU's backward in its epilogue, so that
// dh = dout · W_e never goes through memory: for every expert's rows s, dh[s, 0:H] =
// dout[s, 0:OC] · W_e (W_e = weights[e], [OC, H], the down weights), rounded to bf16,
// then as swiglu_backward (cuda/swiglu.cuh) with gate and up side by side in
// gate_up[s, 0:2H] (gate in [0, H), up in [H, 2H)): dgate_up[s, 0:H] = dLoss/dgate,
// dgate_up[s, H:2H] = dLoss/dup, and h[s, 0:H] = silu(gate)·up, the forward's h
// recomputed. Bit for bit what grouped_matmul_backward_input into a buffer (C = H)
// followed by swiglu_backward on those rows gives, on either path. Requirements as
// above (H in C's place), gate_up 16-byte aligned, and the two written tensors
// (dgate_up, h) disjoint from each other and from dout and gate_up.
void grouped_matmul_backward_input_swiglu(bf16* dgate_up, bf16* h, const bf16* dout, const bf16* const* weights,
                                          const bf16* gate_up, const int32_t* offsets, int64_t S, int64_t E,
                                          int64_t H, int64_t OC, cudaStream_t stream,
                                          GroupedGemmPath path = GroupedGemmPath::automatic);

// dweights[e] (fp32, [OC, C]) += dout[rows_e]ᵀ · inp[rows_e] for each expert e of the
// DEVICE list trained_experts[0:n_trained] (distinct entries in [0, E); an entry
// outside it is skipped). Experts not in the list get no work and their dweights[e]
// is never read (it may be null); a listed expert with no rows is left unchanged bit
// for bit. Deterministic: each element's sum is formed in a fixed order and added to
// dW once (no two adds to one element): the same bits every run. (The sm90a path's TMA
// kernel, grouped_gemm_sm90.cuh's WgradKernel, has the L2 do that add, which flushes a
// subnormal dW value or sum to zero.)
void grouped_matmul_backward_weight(float* const* dweights, const bf16* dout, const bf16* inp,
                                    const int32_t* offsets, const int32_t* trained_experts, int64_t n_trained,
                                    int64_t S, int64_t E, int64_t C, int64_t OC, cudaStream_t stream,
                                    GroupedGemmPath path = GroupedGemmPath::automatic);

}  // namespace spes::cuda
