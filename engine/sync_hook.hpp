// What the trainer needs from a sync protocol (README, Architecture: "Sync round"): called every
// sync_steps optimizer steps with the node's full fp32 θ on the host, which it
// replaces by the round's global θ. Its state travels in checkpoints.
// engine/net_sync implements it over net/ (the TCP protocol to the coordinator).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "net/train_figures.hpp"

namespace spes {

struct CheckpointState;

// Per-step sync columns of the CSV (zero on steps without a round).
struct SyncStats {
  int64_t round = 0;
  double ms = 0;
  int64_t bytes_up = 0, bytes_down = 0;
  uint64_t state_hash = 0;  // hash of θ after the round: equal on every node and the coordinator
  double inflight_ms = 0;   // overlapped rounds: from the push to this step, where it was applied
  double wait_ms = 0;       // overlapped rounds: how long the step loop waited for it
  bool stop = false;        // the run ends at this round (a node or the coordinator was asked to stop)
};

class SyncHook {
 public:
  virtual ~SyncHook() = default;
  // figures: the node's training figures, reported with the push (the coordinator's
  // status page shows them); ask_stop: this node asks the run to end at this round
  // (a later round's result says where it does: SyncStats::stop).
  virtual SyncStats sync_round(float* params, int64_t step, const net::TrainFigures& figures, bool ask_stop) = 0;
  // Before the first step (after load_state): meet the coordinator now rather than
  // at the first round. False when it gave up: `give_up` said so after an attempt
  // that could not reach the coordinator.
  virtual bool join(const float*, const std::function<bool()>& /*give_up*/) { return true; }
  virtual void save_state(CheckpointState& s) const = 0;
  virtual void load_state(const CheckpointState& s, float* params) = 0;
  // Overlapped rounds: whether one is in flight, and applying it now (overlap_steps
  // after its push, before a checkpoint, at the end of the run).
  virtual bool round_in_flight() const { return false; }
  virtual SyncStats settle(float*) { return {}; }
  // The first step after `round` was not finite: tell the coordinator (best effort).
  virtual void report_bad_round(int64_t, const std::string&) {}
};

}  // namespace spes
