// The coordinator's global state — θ in fp32, the lossy codecs' download residual,
// the outer optimizer's momentum, the completed round, its step and state hash —
// and its persistence in state_dir/coordinator_state.bin (format: net/state_file).
// θ, residual and momentum are not held in memory: they are read from the open
// state file as needed, and each round writes the next file, so the coordinator
// needs about 1.5× the model's memory. Write-ahead: every round is durably persisted before it is
// published, so a crash at any instant loses no round a node has seen. The state is
// the run's: at start it is loaded (run id, model fingerprint, state hash and
// finiteness checked) and its absence is an error; only an explicit `fresh` start
// initialises θ, and persists it at once as round 0.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "net/codec.hpp"
#include "net/line_log.hpp"
#include "net/state_file.hpp"

namespace spes::net {

// The coordinator's state file in state_dir.
constexpr const char* kCoordinatorStateFile = "coordinator_state.bin";

struct GlobalState {
  // θ, and for a lossy codec the download residual (what the download has not carried
  // yet), for the nesterov outer optimizer its momentum: the completed round's file.
  std::shared_ptr<const StateReader> file;
  int64_t round = 0, step = 0;       // the completed round and its step
  uint64_t hash = 0;                 // state hash of θ
  // The round each grid chunk last changed in (changed-only snapshots). Not persisted:
  // after a restart every chunk counts as changed in the resumed round.
  std::vector<int64_t> chunk_round;
};

struct PersistRules {
  std::string state_dir;
  std::string run_id;
  uint64_t fingerprint = 0;  // stored in the file; a different model refuses to load
  Codec codec = Codec::fp32;
  int64_t n_params = 0;
  bool outer_momentum = false;  // the outer optimizer keeps a momentum (persisted with θ)
};

class StatePersistence {
 public:
  StatePersistence(PersistRules rules, const LineLog& log);

  // θ of this run: the persisted state; with `fresh`, init_theta(θ) (the initial θ;
  // init_source says what it is, for the log), persisted at once as round 0 (it
  // replaces any state in the folder). Throws NetError, naming the file, when the
  // file is missing, unreadable, another run's, or holds a non-finite value.
  GlobalState open(bool fresh, const std::function<void(float*)>& init_theta,
                   const std::string& init_source);
  // The state file of round `round` (step `step`), to be filled by the round's close.
  std::unique_ptr<StateWriter> next(int64_t round, int64_t step) const;
  // The round was merged and is about to be published: its file is checked, fsynced
  // (file and folder) and renamed into place before this returns; s takes its round,
  // step, hash and file. Throws NetError on failure: the old file stays, or (a failed
  // folder fsync after the rename) the new one is in place but this round is not
  // published; either way a restart loses no published round.
  void commit(StateWriter& w, GlobalState& s);
  const std::string& path() const { return path_; }
  std::string folder() const;  // where the state file lives (scratch files go there too)

 private:
  PersistedState header(int64_t round, int64_t step) const;
  void check_identity(const PersistedState& ps) const;  // this run's, this model's
  void adopt_old_name();
  PersistRules rules_;
  const LineLog& log_;
  std::string path_;
};

}  // namespace spes::net
