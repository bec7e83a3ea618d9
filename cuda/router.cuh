// MoE router on the device: fp32 softmax over the E logits, top-k
// (ties to the lower expert index), optional renormalisation, the statistics of the
// load-balancing loss (with the SPES decayed factor as a per-expert count scale) and
// of the router z-loss, and the backward. Semantics: cpu::router_forward/backward.
//
// Determinism: no float atomics anywhere. The per-expert Σ_t p_{t,e} is reduced in
// two fixed-shape stages (per-warp partials over a fixed token block, then one
// fixed tree per expert), so the LB loss and its gradient are bit-reproducible.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace spes::cuda {

constexpr int64_t kRouterMaxExperts = 256;  // 8 logits per lane of a warp
constexpr int64_t kRouterMaxTopK = 32;      // one choice per lane

// Floats of the `partials` scratch that router_forward fills and router_aux_forward
// reduces (per-warp partial sums of p and lse², plus the reduced columns).
int64_t router_partials_count(int64_t N, int64_t E);

// probs[N,E], lse[N], topk_idx[N,K], topk_w[N,K] as cpu::router_forward, from fp32
// or bf16 logits[N,E]; also writes the per-warp LB / z-loss partials. probs may alias
// logits (fp32): every row is read whole before it is written.
// Requires 1 ≤ K ≤ min(E, 32), E ≤ 256.
void router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_w, float* partials,
                    const float* logits, int64_t N, int64_t E, int64_t K, bool renorm,
                    cudaStream_t stream);
void router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_w, float* partials,
                    const bf16* logits, int64_t N, int64_t E, int64_t K, bool renorm,
                    cudaStream_t stream);

// This layer's aux losses from the partials and the dispatch offsets[E+1]
// (count_e = offsets[e+1] − offsets[e]); all on the device, no host sync:
//   lb_weight[e] = s_e · count_e · E / (K·N²)       (s_e = count_scale[e], 1 when null)
//   aux[0] = LB = Σ_e lb_weight[e] · Σ_t p_{t,e}     (= E/(N·K)·Σ_e s_e·count_e·mean_t p_{t,e})
//   aux[1] = RZ = mean_t lse_t²
// count_scale is the SPES decayed aux-loss factor for owned experts (1 elsewhere).
// LB is linear in p with coefficient lb_weight[e], so cpu::router_backward's
// lb_dprob for a loss term c·LB is c·lb_weight (router_backward's lb_scale).
void router_aux_forward(float* aux, float* lb_weight, float* partials, const int32_t* offsets,
                        const float* count_scale, int64_t N, int64_t E, int64_t K,
                        cudaStream_t stream);

// dlogits[N,E] as cpu::router_backward with lb_dprob[e] scaled by lb_scale (lb_dprob
// nullable = no LB term). Output fp32 (tests, fp32 consumers) or bf16 (the router
// weight-gradient GEMM input).
void router_backward(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                     const int32_t* topk_idx, const float* topk_w, const float* lb_dprob,
                     float lb_scale, float rz_scale, int64_t N, int64_t E, int64_t K, bool renorm,
                     cudaStream_t stream);
void router_backward(bf16* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                     const int32_t* topk_idx, const float* topk_w, const float* lb_dprob,
                     float lb_scale, float rz_scale, int64_t N, int64_t E, int64_t K, bool renorm,
                     cudaStream_t stream);

}  // namespace spes::cuda
