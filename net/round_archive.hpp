// The coordinator's last K published rounds (issue 33: a bad round never costs the
// run). The bound (net/update_bound) keeps a hostile push from ruining θ in one
// round; what gets past it (a bound set too loose, or off) is undone here: after
// each round is committed, coordinator_state.bin is copied to
// state_dir/rounds/round-XXXXXXXX.bin (a temp file fsynced and renamed: a copy is
// whole or absent), and the oldest beyond K is removed. `spes-engine coordinator
// CONFIG --rollback-to ROUND` makes one of them the state again (roll_back), so an
// operator can revoke a hostile node and resume the run from before its round:
// nodes resuming from their checkpoints of that round are in sync, and the others
// resync from a snapshot. Costs K state files on disk and a copy per round.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "net/line_log.hpp"

namespace spes::net {

class RoundArchive {
 public:
  // keep ≥ 2 (the round before a bad one survives the bad one's copy).
  RoundArchive(std::string state_dir, int keep, const LineLog& log);
  // Round `round` was committed to `state_path`: keep a copy, drop the oldest beyond K.
  void keep(int64_t round, const std::string& state_path);
  std::vector<int64_t> rounds() const;  // kept, ascending
  std::string path(int64_t round) const;

 private:
  std::string dir_;
  int keep_;
  const LineLog& log_;
};

// Makes the kept round `round` the state at `state_path` (verified first: format,
// hashes, finite values), removes the kept rounds after it, and records the
// rollback in state_dir/rollback (read by rolled_back_to). Throws NetError naming
// the round and the rounds kept when it is not there.
void roll_back(const std::string& state_dir, const std::string& state_path, int64_t round, int64_t n_params,
               const LineLog& log);
// The round the run was last rolled back to, or -1.
int64_t rolled_back_to(const std::string& state_dir);

}  // namespace spes::net
