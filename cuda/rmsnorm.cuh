// RMSNorm fused with the residual add (y = x / sqrt(mean(x²) + eps) · w, statistics
// in fp32). Same math as cpu::rmsnorm_forward / rmsnorm_backward.
//
// In the pre-norm block `h = x + Attn(RMSNorm_in(x))`, `x' = h + MoE(RMSNorm_post(h))`
// every norm input is a fresh residual sum, so forward takes the residual and the
// branch output, writes the new residual and its normalised copy in one pass.
// Backward adds the norm's input gradient to the residual-stream gradient: the sum
// is the gradient of the new residual, hence of both the old residual and the branch.
//
// Post-norm (OLMo-2: `h = x + RMSNorm_attn(Attn(x))`, `x' = h + RMSNorm_mlp(MoE(h))`)
// normalises the branch instead: rmsnorm_post_forward adds the normalised branch to
// the residual in the same pass, and rmsnorm_post_backward first completes the
// residual gradient (adding the MoE input's gradient, which arrives apart from it).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace spes::cuda {

// The widest row the norm kernels take (these and rope.cuh's QK-norms): each keeps a
// row in registers, at most 4 16-byte vectors a thread and 256 threads a row.
constexpr int64_t kNormMaxChannels = 8 * 256 * 4;

// x = res_in + branch, rounded to bf16 and written to res_out (branch == nullptr:
// x = res_in, res_out untouched — the first layer's input norm);
// out = x · rstd · weight, rstd[n] = 1/sqrt(mean_c x² + eps) (fp32). The norm uses
// the bf16-rounded x, i.e. exactly what backward will read. res_out may alias res_in.
// C must be a multiple of 8 (≤ 8192) and every pointer 16-byte aligned.
void rmsnorm_forward(bf16* out, float* rstd, bf16* res_out, const bf16* res_in, const bf16* branch,
                     const bf16* weight, int64_t N, int64_t C, float eps, cudaStream_t stream);

// Scratch rmsnorm_backward needs for its deterministic dweight partials (0 when the
// weight is frozen). Plan it once per (N, C) on the device that will run it.
size_t rmsnorm_backward_scratch_bytes(int64_t N, int64_t C);

// dres_out = dres_in + dx, where dx = rstd·(dout⊙w − x̂·mean(dout⊙w⊙x̂)), x̂ = x·rstd.
// dres_in == nullptr means 0 (e.g. the final norm); dres_out may alias dres_in.
// dweight (fp32, nullable = frozen) += Σ_n dout⊙x̂, without float atomics, using
// `scratch` (rmsnorm_backward_scratch_bytes).
void rmsnorm_backward(bf16* dres_out, float* dweight, void* scratch, const bf16* dout, const bf16* dres_in,
                      const bf16* x, const bf16* weight, const float* rstd, int64_t N, int64_t C,
                      cudaStream_t stream);

// Post-norm: res_out = bf16(res_in + x · rstd · weight) (fp32 sum, rounded once),
// rstd as rmsnorm_forward's, over x. res_out must not overlap x.
void rmsnorm_post_forward(bf16* res_out, float* rstd, const bf16* res_in, const bf16* x, const bf16* weight,
                          int64_t N, int64_t C, float eps, cudaStream_t stream);

// Post-norm backward: dres (the residual's gradient, in place) += dbranch, rounded to
// bf16 (dbranch == nullptr: left as it is); then dx = the norm's input gradient for
// dout = dres, dweight as rmsnorm_backward's (its scratch size too).
void rmsnorm_post_backward(bf16* dx, float* dweight, void* scratch, bf16* dres, const bf16* dbranch, const bf16* x,
                           const bf16* weight, const float* rstd, int64_t N, int64_t C, cudaStream_t stream);

}  // namespace spes::cuda
