// The coordinator's persisted state (spes.state_dir/state.bin): θ, round, step,
// fingerprint and run id, plus the download residual of a lossy codec, so a
// restarted coordinator resumes the run with no round lost. Written to a temp
// file, fsynced and renamed into place (a crash leaves the old or the new file,
// never half of one); a CRC32C over the whole file is checked on load.
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
};

void save_state_file(const std::string& path, const PersistedState& s, const std::vector<float>& theta,
                     const std::vector<float>* residual);
// theta must already have the model's size (a different size is an error). The
// residual is read when the file has one and `residual` is not null. Throws NetError.
PersistedState load_state_file(const std::string& path, std::vector<float>& theta, std::vector<float>* residual);

}  // namespace spes::net
