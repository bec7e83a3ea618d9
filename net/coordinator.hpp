// The merge coordinator: keeps the global θ in fp32 (in its state file,
// net/state_file) and runs sync rounds (README, Architecture: Sync round) over the
// protocol of net/protocol.fbs. It takes plain values (CoordinatorParams); the
// program builds them from its config (engine/net_sync.hpp) and runs `spes-engine
// coordinator` (engine/cmd_coordinator.cpp).
//
// The pieces, each readable alone:
//   net/session      sockets: handshake, framing, out queues, the write pump
//   net/round        the round state machine (pure; every transition logged):
//                    waiting → collecting → merging → publishing → waiting
//   net/streaming_merge, net/publication
//                    the merge as pushes stream in; θ_new − θ_old for the nodes
//   net/global_state θ, round, step, hash and their persistence (before publishing)
//   net/finite_guard nothing non-finite is applied, persisted, published or loaded
//   net/coordinator  the glue wiring them on one Asio thread
//   net/run_status, net/status_server
//                    what the status page shows, served on a thread of its own
// One CSV row per round goes to the csv stream.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <iosfwd>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/layout.hpp"
#include "model/owned_space.hpp"
#include "net/address.hpp"
#include "net/codec.hpp"
#include "net/outer_optimizer.hpp"
#include "net/tls_files.hpp"
#include "net/update_bound.hpp"

namespace spes::net {

// One node of the run, by node id.
struct CoordinatorNode {
  uint64_t fingerprint = 0;  // model_fingerprint of its ownership: its Hello must match
  OwnedSpace space;          // the parameters it trains and pushes
};

// Expert-merging warm-up (model/expert_merge.hpp):
// α = alpha·(1 − min(step/decay_steps, 1)) at rounds whose step is a multiple of
// interval; top-k donors per expert.
struct MergeWarmup {
  double alpha = 0;  // 0 = off
  int64_t topk = 4;
  int64_t interval = 0;
  int64_t decay_steps = 0;
};

struct CoordinatorParams {
  std::string run_id;
  int n_nodes = 1;
  int64_t min_nodes = 1;                    // quorum once round_timeout_s has passed (clamped to 1..n_nodes)
  Codec codec = Codec::fp32;
  std::string secret;                       // the shared secret itself ("" = none: loopback only)
  bool allow_insecure = false;              // no secret, no TLS and a non-loopback bind
  TlsFiles tls;                             // TLS 1.3: the run's CA, the coordinator's certificate and key (off: empty)
  std::string address = "127.0.0.1:29500";  // "host:port" to bind
  std::string status_address;               // "host:port" of the status page (net/status_server); "" = none
  double round_timeout_s = 600;
  std::string state_dir;                    // coordinator_state.bin lives here
  int64_t sync_steps = 0;                   // optimizer steps per round (≥ 1): round r's step is r·sync_steps
  MergeWarmup merge;
  OuterOptimizer outer;                     // after the mean, before the warm-up (net/outer_optimizer)
  UpdateBoundRules update_bound;            // each pushed chunk's size against its history (net/update_bound)
  int keep_rounds = 2;                      // published rounds kept in state_dir/rounds (net/round_archive)
  ParamLayout layout;
  int64_t n_experts = 0;
  std::vector<CoordinatorNode> nodes;       // n_nodes entries, by node id
  // A fresh run's θ (layout.total floats): the engine passes initial_theta (the
  // seeded init, or the [train] init checkpoint's parameters).
  std::function<void(float* theta)> init_theta;
  uint64_t seed = 0;                        // only logged ...
  std::string init_source;                  // ... unless this says what init_theta loads instead
  // Called on the server thread after each round is merged and persisted, before it
  // is published (the engine's --dump-state HF exports). Exceptions are logged.
  std::function<void(std::span<const float> theta, int64_t round)> on_round;
};

struct CoordinatorOptions {
  int port = -1;                      // -1 = the port of params.address; 0 = any free port
  int64_t chunk_elems = 1 << 20;      // payload grid (multiple of kInt8Block, ≤ kMaxChunkElems)
  std::ostream* csv = nullptr;        // one row per round
  bool log = true;                    // transitions and refusals on stderr
  double handshake_timeout_s = 5.0;  // a connection that does not authenticate by then is dropped
  int max_pending = 16;               // unauthenticated connections (the oldest makes way for a newcomer)
  double heartbeat_timeout_s = 3.0;   // a node silent this long is dropped and its node id freed
  double io_timeout_s = 60.0;         // a frame must be read / written within this, or the peer is dropped
  bool handle_signals = false;        // SIGINT/SIGTERM: the run stops at the next round, then the server
  double stop_grace_s = 30.0;         // signalled, no node left: how long to wait for the nodes that missed
                                      // the round that ended the run (they come back for its snapshot)
  bool fresh = false;                 // a new run: θ from init_theta, persisted at once as round 0 (it
                                      // replaces a state in state_dir); without it the state must load
  int64_t rollback_to = -1;           // ≥ 0: restart from this kept round (net/round_archive)
};

struct CoordinatorStats {
  int64_t round = 0;                  // rounds completed
  int64_t step = 0;
  uint64_t state_hash = 0;
  int64_t connections = 0;            // accepted
  int64_t live_sessions = 0;
  int64_t refused = 0;                // connections ended by an Error frame or a bad frame
  int64_t busy = 0;                   // of which refused for the connection budget
  int64_t dropped = 0;                // sessions closed by a deadline (heartbeat, read, write)
  int64_t late_pushes = 0;            // pushes refused as "stale round"
  int64_t snapshots = 0;
  int64_t bytes_in = 0, bytes_out = 0;
  std::string csv_rows;               // every round row written so far
  // Pushes refused, by reason: update_bound, non_finite, bad_push, codec, stale_round.
  std::map<std::string, int64_t> push_refusals;
  double max_update_ratio = 0;        // the largest size / bound of an accepted push (net/update_bound)
  std::vector<std::string> bad_round_reports;  // "round R: node N: reason", as nodes reported them
};

class Coordinator {
 public:
  // Loads the persisted state from params.state_dir (same run id and fingerprint,
  // finite), or with opt.fresh initialises θ with params.init_theta and persists it.
  // Binds the listening socket here, so port() is valid before run(). Throws
  // NetError (a missing or unreadable state without fresh, naming the file).
  explicit Coordinator(CoordinatorParams params, CoordinatorOptions opt = {});
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  uint16_t port() const;
  uint16_t status_port() const;  // 0 without a status page
  void run();   // serves in the calling thread until stop()
  void stop();  // thread-safe; every published round is on disk already
  CoordinatorStats stats() const;  // thread-safe
  // The rounds CSV's header line, and its columns as a markdown table (net/README.md,
  // "Coordinator CSV"; printed by `spes-engine reference rounds-csv`).
  static std::string csv_header();
  static std::string csv_reference_markdown();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spes::net
