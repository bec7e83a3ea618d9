// θ at the start of a fresh run. Every node and the coordinator must start from the
// same θ (README, Architecture: Sync round): the seeded init, or — with [train] init
// — the parameters of a checkpoint (an upcycled model, `spes-engine upcycle`, or any
// earlier run of the same model shape). The trainer, the sync client's base and the
// coordinator's fresh state all come from here.
#pragma once
#include "engine/config.hpp"
#include "model/layout.hpp"

namespace spes {

// Fills theta (layout.total floats): [train] init's params when it is set, else
// init_parameters(seed). The checkpoint's own config must have the same model
// shape (vocab_size, d_model, n_layers, n_heads, n_kv_heads, n_experts,
// expert_hidden, qk_norm, tie_embeddings): ConfigError naming the key and both
// values otherwise; other [model] differences (top_k, rope_theta, ...) are logged.
void initial_theta(const Config& cfg, const ParamLayout& layout, float* theta);

}  // namespace spes
