// The insider bound (issue 33): a node with valid credentials can push any finite
// Δ, and in SPES most experts have one owner, so no vote among nodes can catch a
// poisoned push; its size can. Each pushed chunk's update size, the RMS of Δ in the
// codec's decoded values (fp32: the pushed value − θ_old), is checked against
//
//   bound = kappa × median of the accepted sizes of its class over the last `rounds`
//           rounds, or, while the class has no history (or its median is 0),
//           first × RMS(θ_old of the chunk)
//
// A class is what honest training moves alike: a shared chunk alone (every node
// pushes it), and chunk j of every expert block together (the blocks have one
// layout, so chunk j of each holds the same tensors, trained with the same
// schedule). Pooling the experts lets an expert that was idle (no tokens, so only
// weight decay moved it) come back without being refused, and keeps a hostile node
// that owns a minority of the experts, or of the nodes pushing a shared chunk, from
// moving the median: only accepted sizes enter the history, and the median is the
// lower one (of an even count, the smaller middle value), so a half of hostile
// values cannot drag it up either. A push over the bound is refused as a whole by
// the coordinator (net/coordinator.cpp). What a hostile insider can still do within
// the bound is in net/README.md, What the coordinator guarantees.
//
// The history lives in memory: a restarted coordinator starts again with the
// θ-relative bound. The check reads the sizes only: the merge's arithmetic is
// untouched.
#pragma once
#include <cstdint>
#include <vector>

#include "net/grid.hpp"

namespace spes::net {

struct UpdateBoundRules {
  double kappa = 16;  // bound = kappa × median of the class's accepted sizes; 0 = off
  int rounds = 16;    // the history: the last `rounds` rounds
  double first = 1;   // no history yet: bound = first × RMS(θ_old of the chunk)
  bool on() const { return kappa > 0; }
};

// RMS of x[0, n), and of x − base (fp32 pushes carry values), in double.
double rms(const float* x, int64_t n);
double rms_diff(const float* x, const float* base, int64_t n);

class UpdateBound {
 public:
  UpdateBound(const ChunkGrid& grid, UpdateBoundRules rules);
  const UpdateBoundRules& rules() const { return rules_; }
  // Whether chunk c's class has accepted sizes with a median above 0 (else the bound
  // is θ-relative: a class honest training never moved has nothing to scale).
  bool has_history(int c) const { return median_[size_t(class_[size_t(c)])] > 0; }
  // The bound of chunk c; theta_rms is read only when its class has no history.
  double bound(int c, double theta_rms) const;
  // An accepted push of chunk c by `node` with size `size`: pending until the round
  // closes (a push refused later in the round leaves with withdraw).
  void accept(int node, int c, double size, double bound);
  void withdraw(int node);
  // The round's accepted sizes enter the history; the oldest round beyond `rounds` leaves.
  void close_round();
  // The largest size / bound of any accepted push so far (how close honest training came).
  double max_ratio() const { return max_ratio_; }

 private:
  struct Pending {
    int node, cls;
    float size;
    double ratio;
  };
  UpdateBoundRules rules_;
  std::vector<int> class_;                            // per chunk
  std::vector<std::vector<std::vector<float>>> hist_;  // [class][round slot] accepted sizes
  std::vector<double> median_;                        // per class: lower median of its history, -1 = none
  std::vector<Pending> pending_;
  int64_t closed_ = 0;  // rounds closed: the ring slot
  double max_ratio_ = 0;
};

}  // namespace spes::net
