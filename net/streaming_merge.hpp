// The coordinator's merge of one round (README, Architecture: Sync round), streamed:
// pushes are decoded straight into an accumulator as they arrive, one chunk at a
// time, so the coordinator holds one model-sized accumulator (θ is in its state file)
// whatever the number of nodes (the SPES reference keeps every upload). The
// accumulator sums what the codec carries: new values (fp32) or deltas against θ_old
// (lossy codecs). The mean over a chunk's contributors is the sum / count (fp32) or
// θ_old + sum / count: shared params average over the participating nodes, expert e
// over its participating owners, and a chunk nobody delivered keeps its value.
//
// The merge must not depend on arrival order (a run is reproducible, and the same
// run over TLS or plaintext gives the same hashes), so the sum's width depends on
// how many nodes may push a chunk: up to two, fp32 (one contributor is its value bit
// for bit, two add commutatively); three or more (shared params, DiLoCo-style
// ownership), double (a few fp32 values of similar magnitude add exactly, in any
// order). A SPES expert has one or two owners, so most of the model sums in fp32.
// fp32 sums are scaled by 2^-s, 2^s ≥ their contributors, so a sum of finite values
// never overflows (net/finite_guard.hpp); a power of two changes no rounding outside
// the subnormal range. The outer optimizer (net/outer_optimizer) then steps the
// contributed chunks, and the expert-merging warm-up (model/expert_merge) runs on
// the result.
#pragma once
#include <cstdint>
#include <vector>

#include "model/layout.hpp"
#include "net/codec.hpp"
#include "net/grid.hpp"
#include "net/outer_optimizer.hpp"
#include "net/state_file.hpp"

namespace spes::net {

// Accumulates one round's pushes chunk by chunk (see the file comment).
class StreamingMerge {
 public:
  // threads: for decoding a chunk (0 = every core); owners[c]: how many nodes may
  // push chunk c.
  StreamingMerge(const ChunkGrid& grid, Codec codec, int threads, const std::vector<int>& owners);
  // Every chunk with the same number of possible contributors.
  StreamingMerge(const ChunkGrid& grid, Codec codec, int threads = 0, int max_contributors = 1);

  void begin_round();
  // One node's push of chunk c, already checked with payload_valid. `decoded`: the
  // payload already decoded (the coordinator's overflow check did it), so that a
  // dense lossy chunk is not decoded twice; the sum is the same bits either way.
  void add(int c, const uint8_t* payload, const float* decoded = nullptr);
  // A refused push is refused as a whole (issue 13): `chunks`, the ones its node
  // added this round, leave the merge. A chunk it alone contributed is as if never
  // pushed (the next add starts it afresh). A chunk that others may push too cannot
  // be un-summed exactly, so it is voided, whatever has arrived so far (the result
  // must not depend on arrival order): it keeps θ_old this round and later pushes of
  // it are ignored. Nothing of the refused push reaches θ, at the price of the
  // others' contributions to those chunks for one round.
  void withdraw(const std::vector<int>& chunks);

  // Mean new value of every contributed chunk (θ_old read chunk by chunk from `old`,
  // the completed round's state), then the outer step, whose momentum goes into
  // `next` (every chunk of it, when the state has one); with merge_alpha > 0 the
  // uncontributed expert chunks are filled from θ_old and the warm-up runs on the
  // result. Returns which chunks changed.
  std::vector<bool> close(const StateReader& old, StateWriter& next, const ParamLayout& layout, double merge_alpha,
                          int64_t topk, const OuterOptimizer& outer = {});
  // θ_new of element i after close() (valid for changed chunks).
  const float* target() const { return acc_.data(); }
  // Chunks the last close() left at θ_old because their outer step was not finite.
  int64_t outer_skipped() const { return outer_skipped_; }

 private:
  const ChunkGrid& grid_;
  Codec codec_;
  int threads_;
  float sum_scale_ = 1.0f;  // 2^-s for the fp32 sums, see the file comment
  std::vector<float> acc_;  // fp32 sums, then θ_new of every chunk
  std::vector<double> wide_;  // the double sums of chunks with 3+ owners
  std::vector<int64_t> wide_at_;  // per chunk: its offset in wide_, or -1
  int64_t outer_skipped_ = 0;
  std::vector<int> count_;
  std::vector<int> owners_;    // per chunk: how many nodes may push it
  std::vector<uint8_t> void_;  // chunks voided by withdraw() this round
};

}  // namespace spes::net
