// One round's result as it goes to every node that pushed (every node receives the
// new global θ): the grid chunks that changed, as θ_new − θ_old.
// Building it writes the next round's θ (and download residual) into its state file:
// the coordinator keeps no model-sized θ in memory (net/state_file).
// Lossy codecs: each chunk's payload is encoded once, spilled to an unlinked file
// and read back for every recipient; θ takes the *decoded* update, which is exactly
// what every node computes. fp32: θ takes the new values and the frames are read
// from the committed state file as they are sent (it holds exactly those values
// until the next round closes).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "net/codec.hpp"
#include "net/grid.hpp"
#include "net/state_file.hpp"

namespace spes::net {

// An anonymous scratch file (unlinked from the start: nothing is left behind after
// a crash) in a folder; reads and writes at any offset, from any thread.
class SpillFile {
 public:
  explicit SpillFile(const std::string& dir);
  ~SpillFile();
  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;
  void write(int64_t at, const void* src, size_t n);
  void read(int64_t at, size_t n, void* dst) const;

 private:
  std::string dir_;
  int fd_ = -1;
  std::mutex write_mu_;  // one write at a time (see StateWriter)
};

struct Publication {
  int64_t round = 0, step = 0;
  uint64_t hash = 0;               // state hash of the new θ (set once its file is committed)
  int participants = 0;
  double alpha = 0;
  bool stop = false;               // the run ends at this round (RoundDone.stop)
  Codec codec = Codec::fp32;
  std::vector<int> chunks;         // grid chunks that changed, ascending
  std::vector<int> refused;        // chunks whose merged update was not finite: they keep their value
  // Lossy codecs: chunk k's payload lies at payload_at[k] in `payloads`, payload_bytes[k] long.
  std::shared_ptr<const SpillFile> payloads;
  std::vector<int64_t> payload_at, payload_bytes;
  int64_t bytes = 0;               // all frames of the result, RoundDone included (estimated framing)
  bool lossy() const { return payloads != nullptr; }
};

// Writes round `round`'s θ (and residual) into `next` from the merge result (target:
// θ_new per element, valid on the changed chunks) and the completed round's state
// `old` (unchanged chunks are copied), and builds its publication; lossy payloads
// spill into spill_dir. A chunk whose new θ would not be finite keeps its old value
// and is listed in `refused` instead of `chunks`: nothing non-finite is ever applied
// or published. The caller commits `next` and sets the hash.
std::shared_ptr<Publication> build_publication(Codec codec, const ChunkGrid& grid, const std::vector<bool>& changed,
                                               const float* target, const StateReader& old, StateWriter& next,
                                               const std::string& spill_dir, int64_t round, int64_t step,
                                               int participants, double alpha);

}  // namespace spes::net
