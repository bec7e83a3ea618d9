// The model's shape and the loss coefficients: everything that decides the
// parameter layout and the math of one forward/backward (README, Architecture: The
// model, Loss).
#pragma once
#include <cstdint>
#include <string>

namespace spes {

struct ModelConfig {
  int64_t vocab_size = 256;
  int64_t d_model = 128;
  int64_t n_layers = 4;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 4;      // GQA when < n_heads
  int64_t n_experts = 8;
  int64_t top_k = 2;
  int64_t expert_hidden = 256;
  int64_t seq_len = 256;       // training context; exported as max_position_embeddings
  double rope_theta = 10000.0;
  bool qk_norm = true;
  bool qk_norm_per_head = false;  // with qk_norm: one RMSNorm over each head's head_dim channels (Qwen3)
  int64_t head_dim_key = 0;       // [model] head_dim: 0 = d_model / n_heads
  bool post_norm = false;         // OLMo-2: norms on the attention and MLP outputs, none on their inputs
  double norm_eps = 1e-5;
  bool norm_topk_prob = false;
  bool tie_embeddings = false;
  double init_std = 0.02;

  int64_t head_dim() const { return head_dim_key ? head_dim_key : d_model / n_heads; }
  int64_t q_dim() const { return head_dim() * n_heads; }  // width of q and of the attention output
  int64_t kv_dim() const { return head_dim() * n_kv_heads; }
  // Rows of the q/k norm weight and rows the q/k RMSNorm runs over per token.
  int64_t q_norm_width() const { return qk_norm_per_head ? head_dim() : q_dim(); }
  int64_t k_norm_width() const { return qk_norm_per_head ? head_dim() : kv_dim(); }
  int64_t q_norm_rows() const { return qk_norm_per_head ? n_heads : 1; }
  int64_t k_norm_rows() const { return qk_norm_per_head ? n_kv_heads : 1; }
};

// Loss = CE + lb·LB + router_z·RZ + lm_z·ZLM (README, Architecture: Loss).
struct LossConfig {
  double lb_coef = 0.01;
  double router_z_coef = 0.001;
  double lm_z_coef = 1e-5;
  // SPES decayed aux loss: owned experts' counts in LB scaled by a factor rising
  // linearly 0.7 -> 1.0 over the first 20% of the run's steps.
  bool decayed_aux_loss = false;
  bool operator==(const LossConfig&) const = default;
};

}  // namespace spes
