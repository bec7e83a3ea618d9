// The op interface and its CPU reference implementation: plain fp32
// C++, OpenMP over rows, OpenBLAS for GEMMs. Every CUDA kernel is tested against
// these. One file per op family in model/cpu/, *_forward / *_backward side by side.
//
// Conventions: row-major; N = tokens (B·T) of a micro-batch; C = channels.
// Activation gradients are *overwritten*; weight gradients are *accumulated* (+=),
// so micro-batches accumulate; a null weight-gradient pointer means the weight is
// frozen and its weight-gradient product is skipped entirely.
#pragma once
#include <cstdint>

namespace spes::cpu {

// ---- embedding.cpp: out[n] = table[tokens[n]] --------------------------------
void embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t N, int64_t C);
// Deterministic: rows are reduced per vocabulary entry in token order.
void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t N, int64_t C);

// ---- matmul.cpp: out[N,OC] = inp[N,C] · weight[OC,C]ᵀ (weights stored [out,in]) --
void matmul_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC);
// dinp (nullable) = dout·weight; dweight (nullable) += doutᵀ·inp.
void matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t C, int64_t OC);

// ---- rmsnorm.cpp: out = inp / sqrt(mean(inp²) + eps) · weight; rstd[N] saved ----
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps);
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C);

// ---- rope.cpp: rotate_half (NeoX) RoPE on x[B,T,H,D], position = pos0 + t -------
// out[i] = x[i]·cos − x[i+D/2]·sin, out[i+D/2] = x[i+D/2]·cos + x[i]·sin,
// angle = position · theta^(−2i/D). out may alias x. pos0 > 0: decoding with a KV cache.
void rope_forward(float* out, const float* x, int64_t B, int64_t T, int64_t H, int64_t D, double theta,
                  int64_t pos0 = 0);
void rope_backward(float* dx, const float* dout, int64_t B, int64_t T, int64_t H, int64_t D, double theta);

// ---- attention.cpp: causal softmax(q·kᵀ/√D)·v --------------------------------
// q, out: [B,T,H,D]; k, v: [B,T,Hkv,D] (the layouts the QKV projections produce);
// query head h reads kv head h / (H/Hkv) (GQA). lse: [B,H,T] log-sum-exp of the
// scaled scores, saved for backward.
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D);
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D);

// ---- router.cpp: probs = softmax(logits) (fp32), top-k, weights ---------------
// Ties in top-k go to the lower expert index. weights = top-k probs, divided by
// their sum when renorm. lse[N] = logsumexp(logits) (for the router z-loss).
void router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_w, const float* logits,
                    int64_t N, int64_t E, int64_t K, bool renorm);
// dlogits = softmax backward of dprobs, where dprobs collects: dtopk_w scattered
// through the (optional) renormalisation, plus lb_dprob[e] for every token (the LB
// loss is linear in p with a per-expert coefficient), plus the router z-loss term
// rz_scale · 2·lse_t added straight to dlogits as rz_scale·2·lse_t·p_{t,e}.
void router_backward(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                     const int32_t* topk_idx, const float* topk_w, const float* lb_dprob,
                     float rz_scale, int64_t N, int64_t E, int64_t K, bool renorm);

// ---- moe.cpp: dropless token dispatch / combine -------------------------------
// Slots s ∈ [0, N·K) ordered by expert, then token, then k (stable, deterministic).
// offsets[E+1]: expert e owns slots [offsets[e], offsets[e+1]).
// slot_token[s]: source token; token_slot[t·K + k]: slot of (token t, choice k).
void moe_dispatch_indices(int32_t* offsets, int32_t* slot_token, int32_t* token_slot,
                          const int32_t* topk_idx, int64_t N, int64_t E, int64_t K);
// xe[s] = x[slot_token[s]] for S = N·K slots.
void moe_gather_forward(float* xe, const float* x, const int32_t* slot_token, int64_t S, int64_t C);
// dx[t] = Σ_k dxe[token_slot[t·K+k]] (no atomics: each token sums its own K rows).
void moe_gather_backward(float* dx, const float* dxe, const int32_t* token_slot, int64_t N,
                         int64_t K, int64_t C);
// out[t] = Σ_k topk_w[t,k] · ye[token_slot[t·K+k]].
void moe_combine_forward(float* out, const float* ye, const float* topk_w, const int32_t* token_slot,
                         int64_t N, int64_t K, int64_t C);
// dye[slot(t,k)] = topk_w[t,k]·dout[t]; dtopk_w[t,k] = dout[t]·ye[slot(t,k)].
void moe_combine_backward(float* dye, float* dtopk_w, const float* dout, const float* ye,
                          const float* topk_w, const int32_t* token_slot, int64_t N, int64_t K,
                          int64_t C);

// ---- swiglu.cpp: h = silu(gate) ⊙ up, elementwise over n ------------------------
void swiglu_forward(float* h, const float* gate, const float* up, int64_t n);
void swiglu_backward(float* dgate, float* dup, const float* dh, const float* gate, const float* up,
                     int64_t n);

// ---- crossentropy.cpp: per-token CE over logits[N,V] and the lm z-loss ----------
// losses[n] = lse_n − logits[n, targets[n]]; lse[n] saved.
void crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                          int64_t N, int64_t V);
// dlogits = ce_scale·(softmax − onehot) + z_scale·2·lse·softmax. dlogits may alias logits.
void crossentropy_backward(float* dlogits, const float* logits, const float* lse,
                           const int32_t* targets, int64_t N, int64_t V, float ce_scale, float z_scale);

// ---- adamw.cpp -----------------------------------------------------------------
// PyTorch AdamW: p ← p·(1 − lr·wd); p ← p − lr·m̂/(√v̂ + eps), step t ≥ 1.
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t t);
// Σ g² in double, deterministic (fixed-order partial sums).
double sum_squares(const float* g, int64_t n);
void scale_inplace(float* x, int64_t n, float s);

}  // namespace spes::cpu
