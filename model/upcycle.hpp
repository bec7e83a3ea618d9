// Sparse upcycling: a dense model (one expert per layer, n_experts = top_k = 1)
// becomes an E-expert MoE whose experts all start from the dense MLP — how SPES
// starts SPES-9B from a dense model (noise 0.5) instead of from scratch.
//
//   shared tensors (embedding, attention, norms, final norm, lm_head): copied;
//   router of layer ℓ: fresh, the MoE config's seeded init (init_tensor, `seed`);
//   expert e, tensor W ∈ {gate, up, down} of layer ℓ:
//       W_e = W_dense + X · rms(W_dense) · ε,   rms(W) = sqrt(mean over W's elements of w²),
//       ε ~ N(0, 1) elementwise, drawn from a stream keyed by (seed, ℓ, e, W) and the
//       element's index (model/seeded_normal.hpp), so each (expert, tensor) has its own noise.
//   X is the relative noise: rms(W_e − W_dense) / rms(W_dense) ≈ X (within ~1/sqrt(2n)
//   for an n-element tensor). X = 0 gives E exact copies: with norm_topk_prob = true
//   (or top_k = E) the top-k weights sum to 1, so the MoE computes the dense model.
#pragma once
#include <cstdint>
#include <span>
#include <string>

#include "model/layout.hpp"
#include "model/model_config.hpp"

namespace spes {

struct UpcycleOptions {
  double noise = 0.0;  // X, relative to each tensor's rms
  uint64_t seed = 0;   // noise streams and the fresh routers
};

// Throws ConfigError when `moe` cannot be upcycled from `dense`: the dense model
// is not one-expert, or a shape key differs (d_model, n_layers, n_heads,
// n_kv_heads, vocab_size, qk_norm, tie_embeddings, expert_hidden vs the dense
// MLP's hidden size). The message names the key and both values; dense_name and
// moe_name say where each came from.
void check_upcyclable(const ModelConfig& dense, const ModelConfig& moe, const std::string& dense_name,
                      const std::string& moe_name);

// θ of the MoE model (moe_layout.total floats into `out`) from the dense θ.
// Calls check_upcyclable, then checks every tensor it copies by name and shape
// (ConfigError naming the tensor and both shapes).
void upcycle(const ModelConfig& dense, const ParamLayout& dense_layout, std::span<const float> dense_params,
             const ModelConfig& moe, const ParamLayout& moe_layout, float* out, const UpcycleOptions& opt,
             const std::string& dense_name = "dense model", const std::string& moe_name = "MoE config");

}  // namespace spes
