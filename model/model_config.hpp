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
  double norm_eps = 1e-5;
  bool norm_topk_prob = false;
  bool tie_embeddings = false;
  double init_std = 0.02;

  int64_t head_dim() const { return d_model / n_heads; }
  int64_t kv_dim() const { return head_dim() * n_kv_heads; }
};

// Loss = CE + lb·LB + router_z·RZ + lm_z·ZLM (README, Architecture: Loss).
struct LossConfig {
  double lb_coef = 0.01;
  double router_z_coef = 0.001;
  double lm_z_coef = 1e-5;
  // SPES decayed aux loss: owned experts' counts in LB scaled by a factor rising
  // linearly 0.7 -> 1.0 over the first 20% of the run's steps.
  bool decayed_aux_loss = false;
};

}  // namespace spes
