// Checkpoints: everything needed to continue a node's run bit-identically.
// Layout on disk: <checkpoint.dir>/step-00000100/ holding state.bin (sections with
// a CRC32C each and a whole-file checksum) and config.toml. Written into a temp
// folder and renamed into place, so a crash never leaves a half checkpoint; the
// newest `keep` are kept. The byte format is documented in checkpoint.cpp.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace spes {

struct CheckpointState {
  std::string config_toml;          // the run's config (config_to_toml), for eval/export
  uint64_t fingerprint = 0;         // model_fingerprint(): refuses a mismatched resume
  int64_t node_id = 0;
  int64_t step = 0;                 // optimizer steps done
  std::vector<float> params;        // full flat buffer (fp32; on CPU also the master weights)
  std::vector<float> master;        // owned-space fp32 master weights (empty on CPU: params are master)
  std::vector<float> adam_m;        // owned-space first moments
  std::vector<float> adam_v;        // owned-space second moments
  std::vector<uint64_t> data_state; // sampler position (data/sampler.hpp)
  std::vector<uint64_t> rng_state;  // any RNG the trainer carries
  std::vector<float> sync_base;     // owned-space θ at the last sync round (net; may be empty)
  std::vector<float> sync_residual; // codec error-feedback residual (net; may be empty)
  int64_t sync_round = 0;           // last completed sync round
};

// Writes <root>/step-XXXXXXXX atomically (via <root>/.step-XXXXXXXX.tmp, fsynced,
// renamed; an existing folder of the same step is swapped out atomically) and
// prunes to the newest `keep` by step (keep <= 0 keeps all; the folder just
// written is never pruned). Returns the folder written.
std::string save_checkpoint(const std::string& root, const CheckpointState& s, int64_t keep);
// `path` is a step folder, a root holding step folders (the newest is taken), or
// a state.bin. Verifies magic, version, every length, every CRC32C, exact section
// presence, and that the step matches the folder's name; throws CheckpointError
// naming the file and what is wrong.
CheckpointState load_checkpoint(const std::string& path);
// The newest complete step folder (step-XXXXXXXX holding state.bin) under root,
// or "" when there is none; temp folders of interrupted saves are ignored.
std::string latest_checkpoint(const std::string& root);

}  // namespace spes
