// Overlapped rounds with eager updates (Kale et al. 2025, "Eager updates for
// overlapped communication and computation in DiLoCo"): while round k is in flight
// the node trains on a stand-in for its result, and corrects when it lands.
//
// At the push of round k the node holds θ_{k−1} (the last round's θ) plus its own
// progress d over the owned parameters. The round's update U_k = θ_k − θ_{k−1} is
// the mean of its owners' deltas; the stand-in Û_k takes this node's own delta at its
// weight in that mean and, for the rest, the last update U_{k−1}:
//
//   owned by c nodes (this one among them):  Û = d/c + (1 − 1/c)·U_{k−1}
//   owned by this node alone (c = 1):        Û = d, untouched (the round's result, bar the warm-up)
//   not owned by this node:                   Û = U_{k−1}
//
// θ ← θ_{k−1} + Û, and training goes on. When θ_k arrives: θ ← θ_k + (θ − (θ_{k−1} + Û))
// (the progress since the push is kept). Two exactness rules make the bitwise
// properties hold: an element still at its stand-in becomes θ_k itself, and one
// whose θ_k equals its stand-in keeps its value. So one node owning every parameter
// (fp32: the coordinator returns its push bit for bit) trains exactly as it would
// alone, and θ outside the owned ranges is θ_k after every round.
//
// U_{k−1} lives only in memory: a resumed node (its checkpoint holds a settled round)
// starts again from U = 0, as the first round does.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "model/owned_space.hpp"

namespace spes::net {

class EagerOverlap {
 public:
  // owner_counts: [flat range, how many nodes own it] over this node's owned ranges
  // (ascending; a part absent from the list counts as owned by this node alone).
  EagerOverlap(const OwnedSpace& space, std::vector<std::pair<Range, int>> owner_counts, int64_t total);
  ~EagerOverlap();

  // At the push: params = θ_{k−1} + local progress (owned), θ_{k−1} elsewhere; base =
  // θ_{k−1} over the owned space. Replaces params by the stand-in θ_{k−1} + Û.
  void start(float* params, const std::vector<float>& base);
  // When θ_k (global, the whole layout) lands: params ← θ_k + (params − stand-in).
  // After a snapshot (resynced) params ← θ_k and U restarts at 0.
  void finish(float* params, const float* global, bool resynced);

 private:
  struct Plan;

  const OwnedSpace& space_;
  std::vector<std::pair<Range, int>> counts_;
  int64_t total_;
  int mode_ = 2;
  std::unique_ptr<Plan> plan_;  // per flat range: how its stand-in is made
  std::vector<float> previous_;  // θ_{k−1}
  std::vector<float> update_;    // U_{k−1} (empty: zero)
  std::vector<float> standin_;   // θ_{k−1} + Û
};

}  // namespace spes::net
