// QK-norm + RoPE, fused: q = q_norm(Wq·a), k = k_norm(Wk·a) where the
// norm is an RMSNorm over the whole projection (qknorm_rope_*: C = H·D channels,
// before the split into heads; OLMoE, OLMo-2) or over each head (qknorm_head_rope_*:
// D channels per head, one weight of D entries shared by the heads; Qwen3), then
// RoPE in the rotate_half (NeoX) convention on [B,T,H,D].
// Same math as cpu::rmsnorm_forward (over B·T rows of H·D, or B·T·H rows of D)
// followed by cpu::rope_forward (fp32 in between: the normalised value is never
// rounded to bf16 before the rotation).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace spes::cuda {

// The RoPE table for positions [0, T): table[t·D/2 + i] = (cos, sin) of
// t·theta^(−2i/D), computed in double and rounded once to fp32 — the values
// cpu::rope_forward uses. Built once at start-up (T·D/2·8 bytes: 2 MiB for
// T = 4096, D = 128), read by the kernels from L1/L2, so no transcendental
// functions run per step.
size_t rope_table_bytes(int64_t T, int64_t D);
void rope_table_init(float2* table, int64_t T, int64_t D, double theta, cudaStream_t stream);

// inp: the projection output [B·T, H·D] (bf16); out: the rotated q or k, same
// layout (must not alias inp: backward needs inp). rstd[B·T] saved (fp32).
// Position of row n is n mod T. H·D must be a multiple of 8 (≤ 8192), D even,
// bf16 pointers 16-byte aligned; `table` from rope_table_init for this T and D.
void qknorm_rope_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight, const float2* table,
                         int64_t B, int64_t T, int64_t H, int64_t D, float eps, cudaStream_t stream);

size_t qknorm_rope_backward_scratch_bytes(int64_t B, int64_t T, int64_t H, int64_t D);

// dinp (bf16, overwritten) = d(rmsnorm)/d(inp) applied to rope_backward(dout);
// dweight (fp32, nullable = frozen) += Σ_n rope_backward(dout)⊙x̂ (deterministic,
// via `scratch` of qknorm_rope_backward_scratch_bytes).
void qknorm_rope_backward(bf16* dinp, float* dweight, void* scratch, const bf16* dout, const bf16* inp,
                          const bf16* weight, const float* rstd, const float2* table, int64_t B, int64_t T, int64_t H,
                          int64_t D, cudaStream_t stream);

// Per-head QK-norm (Qwen3): as above with the RMSNorm over each head's D channels;
// weight [D], rstd[B·T·H] (token-major, as cpu::rmsnorm_forward over B·T·H rows).
// D must be a multiple of 8 (≤ 8192); H·D any width.
void qknorm_head_rope_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight, const float2* table,
                              int64_t B, int64_t T, int64_t H, int64_t D, float eps, cudaStream_t stream);

size_t qknorm_head_rope_backward_scratch_bytes(int64_t B, int64_t T, int64_t H, int64_t D);

// dweight[D] += Σ over every (token, head) row, deterministic as qknorm_rope_backward's.
void qknorm_head_rope_backward(bf16* dinp, float* dweight, void* scratch, const bf16* dout, const bf16* inp,
                               const bf16* weight, const float* rstd, const float2* table, int64_t B, int64_t T,
                               int64_t H, int64_t D, cudaStream_t stream);

}  // namespace spes::cuda
