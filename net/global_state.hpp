// The coordinator's global state — θ in fp32, the lossy codecs' download residual,
// the outer optimizer's momentum, the completed round, its step and state hash —
// and its persistence in state_dir/state.bin (format: net/state_file). DESIGN §3: the coordinator
// persists a round before publishing it, so a restart never loses a round a node
// has seen. Loaded at start when the file belongs to this run (run id, model
// fingerprint and state hash checked), else θ comes from the seed.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "net/codec.hpp"
#include "net/line_log.hpp"

namespace spes::net {

struct GlobalState {
  std::vector<float> theta;
  std::vector<float> down_residual;  // lossy codecs: what the download has not carried yet
  std::vector<float> outer_momentum; // nesterov outer optimizer (net/outer_optimizer); else empty
  int64_t round = 0, step = 0;       // the completed round and its step
  uint64_t hash = 0;                 // state hash of θ
};

struct PersistRules {
  std::string state_dir;
  std::string run_id;
  uint64_t fingerprint = 0;  // stored in the file; a different model refuses to load
  Codec codec = Codec::fp32;
  int64_t persist_every = 1;  // rounds between persisted states; 0 = never
  bool outer_momentum = false;  // the outer optimizer keeps a momentum (persisted with θ)
};

class StatePersistence {
 public:
  StatePersistence(PersistRules rules, const LineLog& log);

  // θ of this run: the persisted state, or init_theta(θ) (the initial θ; init_source
  // says what it is, for the log) when there is none or `fresh` (then the file is
  // overwritten at the first persist). Throws NetError when the file is another
  // run's or corrupt.
  GlobalState open(int64_t n_params, bool fresh, const std::function<void(float*)>& init_theta,
                   const std::string& init_source);
  // A round was merged and is about to be published: persisted when due.
  void round_closed(const GlobalState& s);
  // Stopping: persists the last round if it is not on disk yet (best effort, logged).
  void on_stop(const GlobalState& s);
  const std::string& path() const { return path_; }

 private:
  void persist(const GlobalState& s);

  PersistRules rules_;
  const LineLog& log_;
  std::string path_;
  int64_t persisted_round_ = -1;
};

}  // namespace spes::net
