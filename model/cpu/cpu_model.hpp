// The OLMoE-style MoE decoder (README, Architecture: The model) as a sequence of op calls on the CPU
// reference ops (model/cpu/ops.hpp): forward, loss, and a hand-written backward into owned-space
// gradients. Activations for one micro-batch are sized once, at construction.
#pragma once
#include <cstdint>
#include <vector>

#include "model/layout.hpp"
#include "model/loss.hpp"
#include "model/model_config.hpp"

namespace spes {

class CpuModel {
 public:
  CpuModel(const ModelConfig& cfg, const ParamLayout& layout, const Ownership& own, int64_t batch,
           int64_t seq_len);

  // Forward and loss only (eval). aux_factor scales owned experts' LB counts.
  LossParts forward(const float* params, const int32_t* inputs, const int32_t* targets,
                    const LossConfig& loss, float aux_factor = 1.0f);
  // Forward, then backward of grad_scale · total loss: grads (owned space, see
  // Ownership) are accumulated (+=); frozen experts get no weight gradients.
  LossParts forward_backward(const float* params, float* grads, const int32_t* inputs,
                             const int32_t* targets, const LossConfig& loss, float aux_factor,
                             float grad_scale);

  int64_t batch() const { return B_; }

  // Bytes of activations and scratch a model of this shape allocates (computed
  // from the same list the constructor sizes, without allocating), and what this
  // one holds.
  static int64_t planned_bytes(const ModelConfig& cfg, const ParamLayout& layout, const Ownership& own,
                               int64_t batch, int64_t seq_len);
  int64_t allocated_bytes();

  // Last forward's per-token logits [B·T, V] (valid until backward overwrites them).
  const float* logits() const { return logits_.data(); }

 private:
  struct LayerActs {
    std::vector<float> x_in, an1, rstd1, q_raw, k_raw, v, q_n, k_n, rstd_q, rstd_k, q, k, att, lse, h,
        an2, rstd2, router_logits, probs, router_lse, topk_w, xe, gate, up, act, ye;
    // Post-norm only (empty otherwise): the attention and MoE outputs before their norms.
    std::vector<float> o_raw, y_raw;
    std::vector<int32_t> topk_idx, offsets, slot_token, token_slot;
  };
  void layer_forward(const float* params, int l, const float* x_in, float* x_out, float aux_factor,
                     LossParts& parts);
  void layer_backward(const float* params, float* grads, int l, float* dx, const LossConfig& loss,
                      float aux_factor, float grad_scale);
  void attention_forward_block(const float* params, int l, float* out);
  void attention_backward_block(const float* params, float* grads, int l, const float* d_out);
  void moe_forward_block(const float* params, int l, const float* x, float* y);
  void moe_backward_block(const float* params, float* grads, int l, const float* d_y, const LossConfig& loss,
                          float aux_factor, float grad_scale);
  float* grad_of(float* grads, int64_t offset) const;
  CpuModel(const ModelConfig& cfg, const ParamLayout& layout, const Ownership& own, int64_t batch, int64_t seq_len,
           bool allocate);
  template <class F>
  void for_each_buffer(F&& f);

  ModelConfig cfg_;
  ParamLayout layout_;
  Ownership own_;
  int64_t B_, T_, N_, S_;
  std::vector<LayerActs> acts_;
  std::vector<float> x_final_, fnorm_, rstd_f_, logits_, ce_lse_, ce_losses_;
  std::vector<int32_t> inputs_, targets_;
  // Backward scratch, reused by every layer.
  std::vector<float> d_x_, d_a_, d_b_, d_q_, d_k_, d_v_, d_att_, d_logits_r_, d_topk_w_, d_xe_,
      d_xe2_, d_ye_, d_act_, d_gate_, d_up_, lb_dprob_;
  std::vector<float> d_c_;  // post-norm only: gradient of a branch output before its norm
  int64_t planned_bytes_ = 0;
};

}  // namespace spes
