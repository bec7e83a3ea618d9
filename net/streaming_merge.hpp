// The coordinator's merge of one round (DESIGN §1 "Sync round"), streamed: pushes
// are decoded straight into one fp32 accumulator as they arrive, one chunk at a
// time, so the coordinator holds θ plus one model-sized accumulator whatever the
// number of nodes (the SPES reference keeps every upload). The accumulator sums
// what the codec carries: new values (fp32) or deltas against θ_old (lossy
// codecs). The mean over a chunk's contributors is the sum / count (fp32) or
// θ_old + sum / count: shared params average over the participating nodes, expert e
// over its participating owners, and a chunk nobody delivered keeps its value. One
// contributor gives back its value bit for bit; two add commutatively; with three or
// more the fp32 sum depends on arrival order by a rounding (every node still gets
// the coordinator's one result, so hashes agree). Contributions are summed scaled by
// 2^-s, 2^s ≥ the most contributors a chunk can have, so the sum never overflows
// where the mean is a float (net/finite_guard.hpp's argument); a power of two
// changes no rounding (outside the subnormal range), so the mean is the one of the
// unscaled sum. The outer optimizer
// (net/outer_optimizer) then steps the contributed chunks, and the expert-merging
// warm-up (model/expert_merge) runs on the result.
#pragma once
#include <cstdint>
#include <vector>

#include "model/layout.hpp"
#include "net/codec.hpp"
#include "net/grid.hpp"
#include "net/outer_optimizer.hpp"

namespace spes::net {

// Accumulates one round's pushes chunk by chunk (see the file comment).
class StreamingMerge {
 public:
  // threads: for decoding a chunk (0 = every core); max_contributors: nodes that may
  // push one chunk (n_nodes).
  StreamingMerge(const ChunkGrid& grid, Codec codec, int threads = 0, int max_contributors = 1);

  void begin_round();
  // One node's push of chunk c, already checked with payload_valid.
  void add(int c, const uint8_t* payload);

  int contributors(int c) const { return count_[c]; }
  // Mean new value of every contributed chunk, then the outer step (momentum: n
  // params, nesterov only); with merge_alpha > 0 the uncontributed expert chunks are
  // filled from θ and the warm-up runs on the result. Returns which chunks changed.
  std::vector<bool> close(const float* theta, const ParamLayout& layout, double merge_alpha, int64_t topk,
                          const OuterOptimizer& outer = {}, float* momentum = nullptr);
  // θ_new of element i after close() (valid for changed chunks).
  const float* target() const { return acc_.data(); }
  // Chunks the last close() left at θ_old because their outer step was not finite.
  int64_t outer_skipped() const { return outer_skipped_; }

 private:
  const ChunkGrid& grid_;
  Codec codec_;
  int threads_;
  float sum_scale_ = 1.0f;  // 2^-s, see the file comment
  std::vector<float> acc_;
  int64_t outer_skipped_ = 0;
  std::vector<int> count_;
};

}  // namespace spes::net
