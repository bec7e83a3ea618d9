// Fused lm-head cross-entropy + lm z-loss: one kernel computes each row's
// log-sum-exp, its loss and (optionally) the logit gradient, reading the bf16
// logits once and writing the gradient once. No probability matrix is ever
// stored: the caller computes logits for a chunk of tokens, calls this (the
// gradient may overwrite the logits in place), then runs the lm-head backward
// GEMMs on that chunk. Same math as cpu::crossentropy_forward + _backward.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace spes::cuda {

// logits: N rows of V values, row stride ld ≥ V elements (bf16).
// losses[n] = lse[n] − logits[n, targets[n]] and lse[n] = logsumexp(logits[n]) (fp32).
// dlogits (nullable: forward only, e.g. eval), same stride, may alias logits:
//   ce_scale·(softmax − onehot(target)) + z_scale·2·lse·softmax, rounded to bf16.
// (z-loss ZLM = mean lse² is reduced from lse[] by the caller; with z_scale =
// lm_z_coef / tokens this is its exact gradient.) targets must lie in [0, V).
// dlogits, when distinct from logits, must have the same address alignment mod 16.
//
// Implementations: `cluster` (sm_90+) splits each row over a cluster of 8 blocks
// that keep their slice in shared memory, so the row crosses HBM once each way;
// `row` (any GPU) gives each row one block that reads it twice (the second read
// mostly from L2). `automatic` picks cluster when the device and build allow it.
enum class CeImpl { automatic, cluster, row };

void crossentropy_forward_backward(bf16* dlogits, float* losses, float* lse, const bf16* logits,
                                   const int32_t* targets, int64_t N, int64_t V, int64_t ld, float ce_scale,
                                   float z_scale, cudaStream_t stream, CeImpl impl = CeImpl::automatic);

// Whether the cluster implementation can run on the current device for this V.
// Answered from a per-device cache after the first call (the device attributes, the
// shared-memory opt-in and the cluster occupancy are queried once, not per call).
bool crossentropy_cluster_supported(int64_t V);

}  // namespace spes::cuda
