// The loss of one micro-batch in parts (README, Architecture: Loss): CE + lb·LB + router_z·RZ +
// lm_z·ZLM, the SPES decayed aux-loss factor, and the expert-load metric. Shared by
// the CPU and GPU models and the trainer.
#pragma once
#include <cstdint>
#include <vector>

#include "model/model_config.hpp"

namespace spes {

// Loss parts of one micro-batch, each a mean over its tokens (LB and RZ also
// averaged over layers), plus tokens routed to each expert ([layer][expert]).
struct LossParts {
  double ce = 0, lb = 0, router_z = 0, lm_z = 0;
  std::vector<int64_t> expert_counts;  // n_layers × n_experts
  double total(const LossConfig& c) const {
    return ce + c.lb_coef * lb + c.router_z_coef * router_z + c.lm_z_coef * lm_z;
  }
};

// Coefficient of variation of tokens per expert, averaged over layers.
double expert_load_cv(const std::vector<int64_t>& counts, int64_t n_layers, int64_t n_experts);

// SPES decayed aux loss factor for owned experts' counts: 0.7 → 1.0 linearly over
// the first 20% of the run (1 when the option is off).
float aux_loss_factor(const LossConfig& c, int64_t step, int64_t total_steps);

}  // namespace spes
