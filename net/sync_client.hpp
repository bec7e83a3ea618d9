// The node side of a sync round (README, Architecture: "Sync round"), called by the trainer every
// sync_steps optimizer steps with its full flat parameter buffer:
//
//   Δ over the owned ranges = params − sync_base (+ the codec's error-feedback
//   residual) → encode → push in grid chunks (idempotent per (round, node)) →
//   receive the round result (only the chunks that changed, encoded θ_new − θ_old)
//   → params = θ_old + decoded, bit-identical to the coordinator's θ (the state
//   hash in RoundDone proves it) → sync_base = params over the owned ranges.
//
// θ_old is the node's θ at the last round: frozen params as they are (they never
// change locally) and sync_base over the owned ranges. AdamW moments are the
// trainer's and are kept.
//
// Faults: a lost connection is retried with exponential backoff and jitter (a
// restarted coordinator is picked up without user action; pushes are resent
// safely). A node that is behind (it restarted from an older checkpoint, or its
// push came after the round closed: "stale round") gets a full snapshot: params
// become the coordinator's θ and the local work since its last round is dropped.
//
// It takes plain values (SyncClientParams); the program builds them from its config
// and keeps SyncState in its checkpoints (engine/net_sync.cpp).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/layout.hpp"
#include "model/owned_space.hpp"
#include "net/codec.hpp"
#include "net/tls_files.hpp"
#include "net/train_figures.hpp"

namespace spes::net {

struct SyncClientParams {
  std::string run_id;
  int node_id = 0;
  int n_nodes = 1;
  Codec codec = Codec::fp32;
  std::string secret;                       // the shared secret itself ("" = none)
  bool allow_insecure = false;              // no secret and no TLS towards a non-loopback coordinator
  TlsFiles tls;                             // TLS 1.3: the run's CA, this node's certificate and key (off: empty)
  std::string coordinator = "127.0.0.1:29500";  // "host:port" to dial
  double round_timeout_s = 600;             // the coordinator's; bounds how long a round may take
  ParamLayout layout;
  int64_t n_experts = 0;
  OwnedSpace space;                         // the parameters this node trains and pushes
  uint64_t fingerprint = 0;                 // model_fingerprint of this node's ownership
  std::span<const float> initial_params;    // the seeded init θ (layout.total); read in the constructor only
};

// What a node must keep across restarts (its checkpoint): the round it holds, θ
// of that round over the owned parameters, and the lossy codecs' error feedback.
struct SyncState {
  int64_t round = 0;
  std::vector<float> base;      // owned space
  std::vector<float> residual;  // owned space; empty for fp32
};

// What one sync round did, as the node saw it (the trainer keeps a few of these
// fields in its CSV: engine/sync_hook.hpp's SyncStats).
struct RoundReport {
  int64_t round = 0;          // the round the node now holds
  double ms = 0;              // wall time of sync_round
  double push_ms = 0, wait_ms = 0, pull_ms = 0;  // encode+send, coordinator merge, receive+apply+hash
  int64_t bytes_up = 0, bytes_down = 0;
  uint64_t state_hash = 0;    // hash of θ after the round (equal to the coordinator's)
  bool resynced = false;      // params were replaced by a snapshot (no push this time)
  int participants = 0;
  double merge_alpha = 0;
  bool stop = false;          // the run ends at this round: a node or the coordinator was asked to stop
};

struct SyncClientOptions {
  double connect_timeout_s = 10;
  double retry_for_s = 3600;        // give up after the coordinator is unreachable this long
  double backoff_min_s = 0.2, backoff_max_s = 10;
  double io_timeout_s = 0;          // silence tolerated while waiting; 0 = max(60, round_timeout_s + 120)
  bool log = true;
  int threads = 0;                  // encode/decode threads (0 = every core); results do not depend on it
};

class SyncClient {
 public:
  // A fresh node: sync_base = the seeded init θ over the owned ranges, round 0
  // (the coordinator starts from the same θ). restore() replaces it on resume.
  explicit SyncClient(const SyncClientParams& params, SyncClientOptions opt = {});
  ~SyncClient();
  SyncClient(const SyncClient&) = delete;
  SyncClient& operator=(const SyncClient&) = delete;

  // One sync round at optimizer step `step`; the push carries `figures` (the
  // coordinator's status page) and `ask_stop` (this node asks the run to end at this
  // round: the report's `stop` then says it does). Throws NetError when the
  // coordinator refuses this node (secret, run id, fingerprint, codec...) or stays
  // unreachable for retry_for_s.
  RoundReport sync_round(float* params, int64_t step, const TrainFigures& figures = {}, bool ask_stop = false);

  // Connects and authenticates now, retrying as a round does: the coordinator counts
  // this node from the start of its run (a signal to it then waits for the node's
  // next round: net/README.md, Stopping a run), and a wrong secret, run id or
  // fingerprint is said before the first step. A node that is behind takes its
  // snapshot at its next round, as before. Throws as sync_round does. After an attempt
  // that failed, `give_up` (if given) may end the wait: then false, not connected.
  bool join(const float* params, const std::function<bool()>& give_up = {});

  // Overlapped rounds ([spes] overlap): start_round pushes a copy of params on a
  // helper thread and returns at once, so the node keeps training; finish_round
  // waits for that round (if it has not arrived yet) and applies it keeping the
  // local progress since the push: θ ← θ_global + (θ − θ_pushed) on the owned
  // ranges, θ ← θ_global elsewhere (after a resync from a snapshot: θ_global); a
  // parameter not trained since the push becomes θ_global bit for bit.
  // The returned report's state_hash is θ_global's, checked against the coordinator.
  // No other call may run while a round is in flight.
  void start_round(const float* params, int64_t step, const TrainFigures& figures = {}, bool ask_stop = false);
  bool round_in_flight() const;
  RoundReport finish_round(float* params);

  SyncState state() const;
  // Resume from a saved state (disconnects). An empty base keeps the current one; a
  // residual of the wrong size (another codec) restarts the error feedback at zero.
  void restore(const SyncState& s);
  // Closes the connection; the next round reconnects.
  void disconnect();
  // Tells the coordinator that this node's first step after `round` was not finite
  // (it logs the round and the nodes that pushed to it). Best effort: one attempt,
  // false when it could not be sent.
  bool report_bad_round(int64_t round, const std::string& why);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spes::net
