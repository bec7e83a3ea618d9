// Causal multi-head attention on tensor cores (FlashAttention-2 style), forward and
// backward. Same layouts and semantics as spes::cpu::attention_forward/backward:
//   q, out, dq, dout: [B,T,H,D] bf16      (the layout the Q projection produces)
//   k, v, dk, dv:     [B,T,Hkv,D] bf16    (query head h reads kv head h / (H/Hkv))
//   lse:              [B,H,T] fp32, natural-log logsumexp of the scaled scores
// scale = 1/√D, causal (key j visible to query t iff j ≤ t). D ∈ {32, 64, 128}; any
// B ≥ 1, T ≥ 0, H a multiple of Hkv. All pointers 16-byte aligned (cudaMalloc'd
// buffers at offsets that are multiples of 8 elements).
//
// No T×T matrix is ever written to global memory. Both passes are deterministic:
// no atomics, every output element is reduced by one thread in a fixed order
// (dK/dV sum over the query heads of a GQA group inside one CTA).
//
// Forward and backward each have two kernel families with the same contract and the
// same results up to summation order and rounding: the portable one (mma.sync, any
// GPU of sm_80 or later, every D; cuda/attention.cu) and the Hopper one (wgmma, D = 64
// and 128, an sm_90 GPU in a build that carries sm_90a code; cuda/attention_sm90.cu).
// `path` picks: automatic (the default) takes the Hopper family wherever it can run
// and agrees with the portable one on the device, else the portable one; portable and
// sm90a force one, for tests and benches (sm90a throws spes::Error where it cannot
// run, or for D = 32).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace spes::cuda {

using bf16 = __nv_bfloat16;

// automatic: the sm90a family where it can run, D is 64 or 128 and it passed its check
// on the device (attention_sm90a_check_failure), else the portable one; the environment
// variable SPES_ATTENTION=portable keeps it on the portable one.
enum class AttentionPath { automatic, portable, sm90a };

// Whether the sm90a kernels can run on the current device (asked once per device),
// and if not, why (a sentence for test and bench output; empty when it can).
bool attention_sm90a_available();
std::string attention_sm90a_unavailable_reason();

// Empty where the sm90a kernels cannot run, or where they agree with the portable ones
// on the current device: both families run forward and backward on one small problem
// at D = 64 and 128 and must agree within the bf16 tolerance (attention_check.cu).
// Else the first disagreement, a sentence, which the automatic choice also says once
// on stderr as it falls back to the portable kernels. Run once per device, on its
// first call (the automatic choice's first sm90a-eligible call makes it); throws
// spes::Error, naming the check, when the kernels fail to run.
std::string attention_sm90a_check_failure();

// The family `automatic` takes on the current device for head dim D (running the
// check above if it has not run): where a caller wants the choice made, and said,
// before its first call (the GPU backend at start-up, the step bench).
AttentionPath attention_automatic_path(int64_t D);
// The same choice as a phrase for logs: "sm90a (wgmma), agreeing with the portable
// kernels on this GPU", or "portable" and why.
std::string attention_automatic_path_description(int64_t D);

// out = softmax(q·kᵀ/√D + causal mask)·v, lse = per-row logsumexp (saved for backward).
void attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                       int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, cudaStream_t stream,
                       AttentionPath path = AttentionPath::automatic);

// Bytes of device scratch attention_backward needs (the row sums D_i = dout·out).
size_t attention_backward_scratch_bytes(int64_t B, int64_t T, int64_t H);

// dq, dk, dv (overwritten, not accumulated) from dout and the forward's out and lse.
// `scratch` holds attention_backward_scratch_bytes(B, T, H) bytes, 16-byte aligned.
void attention_backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                        const bf16* v, const bf16* out, const float* lse, void* scratch, int64_t B,
                        int64_t T, int64_t H, int64_t Hkv, int64_t D, cudaStream_t stream,
                        AttentionPath path = AttentionPath::automatic);

}  // namespace spes::cuda
