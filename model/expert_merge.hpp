// Expert-merging warm-up (README, Architecture: Sync round): model math on expert weights,
// used by the coordinator's merge (net/streaming_merge) and by `spes-engine
// merge-experts` on an HF export.
//
// Per layer, cosine similarity of the experts' flattened gate weights; expert e
// takes its top-k most similar others (k capped at E−1, ties to the lower index) as
// donors and θ_e ← θ_e + α·mean_donors(θ_j − θ_e) over gate, up and down, all from
// the pre-merge values (simultaneous). α = α0·(1 − min(step/decay_steps, 1)) at
// rounds whose step is a multiple of merge_interval.
#pragma once
#include <cstdint>
#include <vector>

#include "model/layout.hpp"

namespace spes {

// α of the warm-up at a round's global step; 0 when off or not a merge step.
double merge_alpha_at(double alpha0, int64_t interval, int64_t decay_steps, int64_t step);

// One expert's weights in one layer, wherever they live (flat buffer, safetensors).
template <class T>
struct ExpertWeights {
  T* gate = nullptr;
  T* up = nullptr;
  T* down = nullptr;
  int64_t gate_n = 0, up_n = 0, down_n = 0;
};

// donors[e]: e's top-k most similar other experts by cosine similarity of the gate
// weights (k capped at E−1; ties go to the lower index), in ascending index order.
template <class T>
std::vector<std::vector<int>> merge_donors(const std::vector<ExpertWeights<T>>& experts, int64_t topk);

// The simultaneous warm-up update of one layer's experts (math in double, stored as T).
template <class T>
void merge_layer(const std::vector<ExpertWeights<T>>& experts, double alpha, int64_t topk);

// The warm-up over every layer of a flat buffer laid out by `layout` (T = float for
// θ, double for the coordinator's accumulator).
template <class T>
void merge_experts_flat(T* params, const ParamLayout& layout, double alpha, int64_t topk);

}  // namespace spes
