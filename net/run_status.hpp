// What the coordinator's status page shows (net/README.md, Watching a run): the
// run's state, its last round, and per node its connection, its traffic and the
// training figures it reported with its pushes (net/train_figures.hpp), with their
// history. The coordinator's thread writes the StatusBoard at its events (a node
// joins or leaves, a push completes, a round closes); the status server's thread
// (net/status_server) takes a copy, RunStatus, and renders it (net/status_page).
// Its size is bounded: a node's history is thinned to kMaxCurvePoints.
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "net/train_figures.hpp"

namespace spes::net {

struct CurvePoint {
  int64_t step = 0;
  double value = 0;
};

// A figure's history: every reported point until kMaxCurvePoints, then every other
// point goes and only every second new one is kept (and so on: the curve keeps
// its shape over the whole run at a bounded size). Non-finite values are skipped.
constexpr size_t kMaxCurvePoints = 512;
class Curve {
 public:
  void add(int64_t step, double value);
  const std::vector<CurvePoint>& points() const { return points_; }

 private:
  std::vector<CurvePoint> points_;
  int64_t stride_ = 1;  // reported points per kept point
  int64_t skipped_ = 0;
};

struct NodeStatus {
  int id = 0;
  bool connected = false;
  int64_t last_round_pushed = 0;         // 0: no push completed since the coordinator started
  int64_t bytes_up = 0, bytes_down = 0;  // what the coordinator read from / wrote to its connections
  bool reported = false;                 // it sent figures with a push
  TrainFigures figures;                  // the last it sent (non-finite values: unknown)
  std::vector<CurvePoint> loss, val_ce;  // their history (Curve)
};

// The last round closed, as its row of rounds.csv shows it.
struct LastRound {
  int64_t round = 0, step = 0;  // round 0: none closed since the coordinator started
  int participants = 0;
  std::string missing_nodes;
  int64_t late_pushes = 0, bytes_in = 0, bytes_out = 0;
  double merge_alpha = 0, close_ms = 0;
  double closed_at_unix_s = 0;  // wall-clock time it closed
};

struct RunStatus {
  std::string run_id, codec;
  int n_nodes = 0;
  int64_t round = 0, step = 0;  // rounds completed, and the step of the last
  uint64_t state_hash = 0;
  int pushed = 0;               // nodes whose push of the open round (round + 1) is complete
  LastRound last;
  int64_t state_bytes = 0;      // files in state_dir (the state files), as of the last round
  int64_t bytes_in = 0, bytes_out = 0, connections = 0, snapshots = 0, dropped = 0;
  std::vector<std::pair<std::string, int64_t>> refusals;  // connections refused, by reason
  std::vector<std::pair<std::string, int64_t>> push_refusals;  // pushes refused, by reason (net/update_bound)
  double max_update_ratio = 0;  // the largest update / bound of an accepted push
  std::vector<NodeStatus> nodes;
  double uptime_s = 0;
};

class StatusBoard {
 public:
  StatusBoard(std::string run_id, std::string codec, int n_nodes, int64_t round, int64_t step, uint64_t hash,
              int64_t state_bytes);
  void node_connected(int node, bool connected);
  // A node's push of `round` is complete (`pushed` nodes so far); figures: null when it sent none.
  void node_pushed(int node, int64_t round, const TrainFigures* figures, int pushed);
  void round_closed(const LastRound& r, uint64_t state_hash, int64_t state_bytes);
  // A copy; the traffic and refusal counters are the caller's to fill in.
  RunStatus snapshot() const;

 private:
  mutable std::mutex mu_;
  RunStatus s_;
  std::vector<Curve> loss_, val_ce_;  // per node
  double started_ = 0;
};

// The bytes of the regular files directly in `folder` (0 when it cannot be read).
int64_t folder_bytes(const std::string& folder);
// Seconds since the Unix epoch.
double unix_now();

}  // namespace spes::net
