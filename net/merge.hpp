// The coordinator's merge rules (DESIGN §1 "Sync round").
//
// StreamingMerge: deltas are accumulated as they arrive, one chunk at a time, so
// the coordinator holds O(model) memory whatever the number of nodes (the SPES
// reference keeps every upload). Each node's contribution to a chunk is its new
// value θ_old + Δ_p; the mean over the chunk's contributors is θ_old + mean Δ:
// shared params average over the participating nodes, expert e over its
// participating owners, and a chunk nobody delivered keeps its value. The sum is
// kept in double: a handful of fp32 values add exactly, so the result does not
// depend on arrival order and one contributor gives back its value bit for bit.
//
// Expert-merging warm-up (merge_layer / merge_experts_flat): per layer, cosine
// similarity of the experts' flattened gate weights; expert e takes its top-k most
// similar others (k capped at E−1, ties to the lower index) as donors and
// θ_e ← θ_e + α·mean_donors(θ_j − θ_e) over gate, up and down, all from the
// pre-merge values (simultaneous). α = α0·(1 − min(step/decay_steps, 1)) at rounds
// whose step is a multiple of merge_interval.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/layout.hpp"
#include "net/grid.hpp"

namespace spes::net {

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

// Accumulates one round's pushes chunk by chunk (see the file comment).
class StreamingMerge {
 public:
  explicit StreamingMerge(const ChunkGrid& grid);

  void begin_round();
  // A contribution to chunk c as new values (fp32 codec) ...
  void add_values(int c, const float* v);
  // ... or as a decoded delta against the coordinator's θ_old (lossy codecs).
  void add_delta(int c, const float* theta_old, const float* delta);

  int contributors(int c) const { return count_[c]; }
  // Mean new value of every contributed chunk, rounded to fp32 (θ stays fp32), kept in
  // the double accumulator; with merge_alpha > 0 the uncontributed expert chunks are
  // filled from θ and the warm-up runs on the result. Returns which chunks changed.
  std::vector<bool> close(const float* theta, const ParamLayout& layout, double merge_alpha, int64_t topk);
  // The target θ_new of element i after close() (valid for changed chunks).
  const double* target() const { return acc_.data(); }

 private:
  const ChunkGrid& grid_;
  std::vector<double> acc_;
  std::vector<int> count_;
};

// `spes-engine merge-experts --in A.safetensors --out B.safetensors --alpha X [--topk K]`:
// the warm-up merge on an HF-named export, on its own (net/merge_cli.cpp).
int merge_experts_main(const std::vector<std::string>& args);

}  // namespace spes::net
