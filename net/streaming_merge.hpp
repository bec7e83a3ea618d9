// The coordinator's merge of one round (DESIGN §1 "Sync round"), streamed: deltas
// are accumulated as they arrive, one chunk at a time, so the coordinator holds
// O(model) memory whatever the number of nodes (the SPES reference keeps every
// upload). Each node's contribution to a chunk is its new value θ_old + Δ_p; the
// mean over the chunk's contributors is θ_old + mean Δ: shared params average over
// the participating nodes, expert e over its participating owners, and a chunk
// nobody delivered keeps its value. The sum is kept in double: a handful of fp32
// values add exactly, so the result does not depend on arrival order and one
// contributor gives back its value bit for bit. The outer optimizer
// (net/outer_optimizer) then steps the contributed chunks, and the expert-merging
// warm-up (model/expert_merge) runs on the result.
#pragma once
#include <cstdint>
#include <vector>

#include "model/layout.hpp"
#include "net/grid.hpp"
#include "net/outer_optimizer.hpp"

namespace spes::net {

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
  // the double accumulator, then the outer step (momentum: n params, nesterov only);
  // with merge_alpha > 0 the uncontributed expert chunks are filled from θ and the
  // warm-up runs on the result. Returns which chunks changed.
  std::vector<bool> close(const float* theta, const ParamLayout& layout, double merge_alpha, int64_t topk,
                          const OuterOptimizer& outer = {}, float* momentum = nullptr);
  // The target θ_new of element i after close() (valid for changed chunks).
  const double* target() const { return acc_.data(); }

 private:
  const ChunkGrid& grid_;
  std::vector<double> acc_;
  std::vector<int> count_;
};

}  // namespace spes::net
