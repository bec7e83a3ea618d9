// The merge coordinator (`spes-engine coordinator CONFIG`): holds the global θ in
// fp32 and runs sync rounds (DESIGN §1) over the protocol of net/protocol.fbs.
//
// A round is an explicit state machine, each transition logged on stderr:
//   waiting    no push yet for round r = completed + 1
//   collecting first push arrived; the round timer (round_timeout_s) runs; pushes
//              are decoded and accumulated chunk by chunk (StreamingMerge)
//   merging    every node pushed, or the timer fired with ≥ min_nodes done:
//              mean merge, expert-merging warm-up, encode θ_new − θ_old, apply the
//              *decoded* update to θ (so θ equals what nodes will compute), hash,
//              persist
//   publishing the result is queued to every node that pushed; then waiting again
// One CSV row per round goes to the csv stream (stdout in coordinator_main).
#pragma once
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/config.hpp"
#include "net/address.hpp"

namespace spes::net {

struct CoordinatorOptions {
  std::string bind_host;              // "" = host of [spes] coordinator (loopback without a secret)
  int port = -1;                      // -1 = port of [spes] coordinator; 0 = any free port
  int64_t chunk_elems = 1 << 20;      // payload grid (multiple of kInt8Block, ≤ kMaxChunkElems)
  std::ostream* csv = nullptr;        // one row per round
  bool log = true;                    // transitions and refusals on stderr
  std::optional<std::string> secret;  // overrides secret_file / SPES_SECRET (tests)
  std::string dump_dir;               // HF export of θ every dump_every rounds
  int64_t dump_every = 0;
  double hello_timeout_s = 10.0;      // a connection that does not authenticate by then is dropped
  int max_connections = 0;            // 0 = 4·n_nodes + 16
  bool handle_signals = false;        // SIGINT/SIGTERM stop the server (persisting θ first)
  bool fresh = false;                 // ignore a persisted state: start from the seed (overwritten at
                                      // the first persist); for a new run reusing a state_dir
};

struct CoordinatorStats {
  int64_t round = 0;                  // rounds completed
  int64_t step = 0;
  uint64_t state_hash = 0;
  int64_t connections = 0;            // accepted
  int64_t live_sessions = 0;
  int64_t refused = 0;                // connections ended by an Error frame or a bad frame
  int64_t late_pushes = 0;            // pushes refused as "stale round"
  int64_t snapshots = 0;
  int64_t bytes_in = 0, bytes_out = 0;
  std::string csv_rows;               // every round row written so far (tests, `local`)
};

class Coordinator {
 public:
  // Loads the persisted state from spes.state_dir when there is one (same run id
  // and fingerprint), else initialises θ with init_parameters(train.seed). Binds
  // the listening socket here, so port() is valid before run().
  Coordinator(const Config& cfg, CoordinatorOptions opt = {});
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  uint16_t port() const;
  std::string bind_address() const;  // the address actually bound ("127.0.0.1" without a secret)
  void run();   // serves in the calling thread until stop()
  void stop();  // thread-safe; persists θ if the last round is not persisted yet
  CoordinatorStats stats() const;  // thread-safe
  static const char* csv_header();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// `spes-engine coordinator CONFIG [--fresh] [--dump-state DIR [--dump-every N]] [--port P]`: args
// are the ones after the config path. --dump-state writes θ as an HF export
// (config.json + model.safetensors) to DIR/round-NNNNNNNN every N rounds (default 1).
// --fresh starts from the seed even when state_dir holds a persisted state.
// Serves until SIGINT/SIGTERM.
int coordinator_main(const Config& cfg, const std::vector<std::string>& args);

}  // namespace spes::net
