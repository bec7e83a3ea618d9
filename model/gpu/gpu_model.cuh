// The GPU twin of CpuModel (model/cpu/cpu_model): the same OLMoE decoder, the same
// order of ops and the same names, read side by side like llm.c's train_gpt2.c and
// train_gpt2.cu. What differs is only how each step runs:
//   - activations and compute weights are bf16, statistics and loss math fp32;
//   - RMSNorm is fused with the residual add that feeds it (cuda/rmsnorm), QK-norm
//     with RoPE (cuda/rope), the whole MoE block is one cuda::MoeLayer per layer;
//   - the lm head and cross-entropy run on chunks of tokens, forward and backward
//     together, so the [tokens, vocab] logits never exist at once (cuda/crossentropy).
// Every buffer comes from the backend's arena, sized by plan_gpu_memory
// (model/gpu_memory.hpp); nothing is allocated after construction.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda/moe.cuh"
#include "cuda/runtime.cuh"
#include "model/gpu_memory.hpp"
#include "model/layout.hpp"
#include "model/loss.hpp"

namespace spes {

// How the model runs its expert GEMMs: grouped. On an H200 (2026-11-27, spes-1b shape)
// the MoE layer alone ran faster per expert (bench_moe: 392/410 TFLOP/s forward/backward
// against 243/323 grouped), but the whole step did not: with per-expert GEMMs,
// bench_train_gpu's step spent 307 ms of 934 outside any kernel (grouped: 6 of 1179),
// and tiny-central, whose lm head is too small for matmul's split (so the expert GEMMs
// are the only change), trained at 0.32M tokens/s against 0.77M. The likeliest cause,
// not yet profiled: the host's time per call (16 experts × 6 GEMMs per layer and
// micro-batch, each a cublasGemmEx with a row count that changes with every routing).
// bench_train_gpu times the step's layer with this choice.
inline constexpr cuda::ExpertGemm kModelExpertGemm = cuda::ExpertGemm::grouped;

// The plan's buffers carved out of one arena, looked up by name at construction.
class GpuBuffers {
 public:
  GpuBuffers(const GpuMemoryPlan& plan, cuda::DeviceArena& arena);
  template <class T>
  T* get(const std::string& name) const {
    return static_cast<T*>(raw(name));
  }
  void* raw(const std::string& name) const;
  int64_t bytes(const std::string& name) const;

 private:
  std::unordered_map<std::string, std::pair<void*, int64_t>> at_;
};

class GpuModel {
 public:
  // weights: the bf16 compute copy of θ (whole layout); grads: fp32 gradients in
  // owned space (frozen experts have none).
  GpuModel(const ModelConfig& cfg, const ParamLayout& layout, const Ownership& own, int64_t batch,
           cuda::Runtime& rt, const GpuMemoryPlan& plan, const GpuBuffers& buf);
  ~GpuModel();

  // The token buffers the caller fills before a forward: [batch·seq_len] each.
  int32_t* inputs() const { return inputs_; }
  int32_t* targets() const { return targets_; }

  // Forward and loss only (eval); the CE and lm z-loss are means over the first
  // loss_tokens tokens (a padded last batch counts only its real rows; the router
  // statistics, unused in eval, include the padding).
  LossParts forward(const LossConfig& loss, float aux_factor, int64_t loss_tokens);
  // Forward, then backward of grad_scale · total loss; owned gradients accumulate
  // (+=); frozen experts get no weight gradients.
  LossParts forward_backward(const LossConfig& loss, float aux_factor, float grad_scale);

 private:
  struct LayerActs {
    cuda::bf16 *x_in, *an1, *q_raw, *k_raw, *v, *q, *k, *att, *attn_out, *h, *an2, *moe_out;
    float *rstd1, *rstd_q, *rstd_k, *att_lse, *rstd2;
    std::unique_ptr<cuda::MoeLayer> moe;
  };
  void embed_forward();
  void layer_forward(int l, float aux_factor);
  void lm_head(const LossConfig& loss, float grad_scale, bool backward);
  void layer_backward(int l, const LossConfig& loss, float grad_scale);
  LossParts read_loss_parts(int64_t loss_tokens);
  void set_count_scale(float aux_factor);
  float* grad_of(int64_t offset) const;
  const cuda::bf16* w(int64_t offset) const { return weights_ + offset; }

  ModelConfig cfg_;
  ParamLayout layout_;
  Ownership own_;
  int64_t B_, T_, N_, V_, Vpad_, chunk_;
  cuda::Runtime& rt_;
  cudaStream_t stream_;
  const cuda::bf16* weights_;
  float* grads_;
  int32_t *inputs_, *targets_;
  std::vector<LayerActs> acts_;
  cuda::bf16 *x_final_, *fnorm_, *logits_;
  float *rstd_f_, *ce_losses_, *ce_lse_;
  // Backward scratch, reused by every layer.
  cuda::bf16 *d_res_, *d_a_, *d_att_, *d_q_, *d_q_raw_, *d_k_, *d_v_, *d_k_raw_;
  void *attention_scratch_, *norm_scratch_, *embedding_scratch_;
  size_t embedding_scratch_bytes_;
  float2* rope_table_;
  float* count_scale_;    // [E]: the decayed aux-loss factor on owned experts' LB counts
  double* loss_sums_;     // [2]: Σ CE, Σ lse² (cuda/loss)
  float last_aux_factor_ = -1.0f;
  // Pinned host copies of the loss parts: Σ CE, Σ lse², then LB and RZ per layer.
  struct PinnedFree {
    void operator()(void* p) const;
  };
  std::unique_ptr<double, PinnedFree> host_sums_;
  std::unique_ptr<float, PinnedFree> host_aux_;
  std::unique_ptr<float, PinnedFree> host_count_scale_;
};

}  // namespace spes
