// The coordinator's persisted state (spes.state_dir/state.bin): θ, round, step,
// fingerprint and run id, plus the download residual of a lossy codec and the
// outer optimizer's momentum (with its own hash, checked on load), so a
// restarted coordinator resumes the run with no round lost. Written to a temp
// file, fsynced and renamed into place (a crash leaves the old or the new file,
// never half of one); a CRC32C over the whole file is checked on load.
// Format 2 added the momentum; format-1 files (written before outer optimizers,
// hence by a plain average, which has no momentum) still load, without one.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace spes::net {

struct PersistedState {
  std::string run_id;
  uint64_t fingerprint = 0;
  int64_t round = 0, step = 0;
  uint64_t state_hash = 0;
  uint32_t codec = 0;
  bool has_momentum = false;   // set by load_state_file
  uint64_t momentum_hash = 0;  // state_hash of the momentum (0 without one)
};

// momentum: the outer optimizer's, or null (none); its hash is computed here.
void save_state_file(const std::string& path, const PersistedState& s, const std::vector<float>& theta,
                     const std::vector<float>* residual, const std::vector<float>* momentum = nullptr);
// theta must already have the model's size (a different size is an error). The
// residual and the momentum are read when the file has them and the pointer is not
// null (the momentum's hash is checked). Throws NetError.
PersistedState load_state_file(const std::string& path, std::vector<float>& theta, std::vector<float>* residual,
                               std::vector<float>* momentum = nullptr);

}  // namespace spes::net
