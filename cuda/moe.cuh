// Token-routed experts on the device (README, Architecture: "The model"): the
// dropless dispatch that groups the routed (token, choice) pairs by expert, and the
// gather and combine around the experts' grouped GEMMs (cuda/grouped_gemm), forward
// and backward; semantics: cpu::moe_dispatch_indices, moe_gather_*, moe_combine_*.
// bf16 rows, fp32 sums.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace spes::cuda {

// ---- dispatch / combine kernels -------------------------------------------------
// Slots s ∈ [0, S = N·K) are ordered by expert, then token, then k; expert e owns
// [offsets[e], offsets[e+1]). Computed by counts → scan → rank, all on the device and
// without relying on atomic ordering (only integer counts use atomics), so the
// permutation is exactly the CPU's. Requires topk_idx ∈ [0, E), E ≤ 1024.

// int32 elements of scratch that moe_dispatch_indices needs.
int64_t moe_dispatch_scratch_count(int64_t N, int64_t E, int64_t K);
void moe_dispatch_indices(int32_t* offsets, int32_t* slot_token, int32_t* token_slot, int32_t* scratch,
                          const int32_t* topk_idx, int64_t N, int64_t E, int64_t K,
                          cudaStream_t stream);
// xe[s] = x[slot_token[s]], rows of C.
void moe_gather_forward(bf16* xe, const bf16* x, const int32_t* slot_token, int64_t S, int64_t C,
                        cudaStream_t stream);
// dx[t] = Σ_k dxe[token_slot[t·K+k]] (fp32 sum in k order; each token sums its own
// K rows, so no atomics).
void moe_gather_backward(bf16* dx, const bf16* dxe, const int32_t* token_slot, int64_t N, int64_t K,
                         int64_t C, cudaStream_t stream);
// out[t] = Σ_k topk_w[t,k]·ye[token_slot[t·K+k]] (fp32 sum in k order).
void moe_combine_forward(bf16* out, const bf16* ye, const float* topk_w, const int32_t* token_slot,
                         int64_t N, int64_t K, int64_t C, cudaStream_t stream);
// dye[slot(t,k)] = topk_w[t,k]·dout[t]; dtopk_w[t,k] = dout[t]·ye[slot(t,k)] (fp32,
// fixed-order warp reduction).
void moe_combine_backward(bf16* dye, float* dtopk_w, const bf16* dout, const bf16* ye,
                          const float* topk_w, const int32_t* token_slot, int64_t N, int64_t K,
                          int64_t C, cudaStream_t stream);

}  // namespace spes::cuda
