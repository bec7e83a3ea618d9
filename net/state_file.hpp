// The coordinator's persisted state (spes.state_dir/coordinator_state.bin): θ,
// round, step, fingerprint and run id, plus the download residual of a lossy codec
// and the outer optimizer's momentum, so a restarted coordinator resumes the run
// with no round lost.
//
// The file is also where the coordinator's θ lives between rounds (issue 14: a
// coordinator in ≤ 1.5× the model): it is read back in chunks (pread) to serve
// snapshots and to merge, so only the merge's accumulator is model-sized in memory.
// Hence the file is random-access: a 4 KiB header, then the sections θ, residual,
// momentum (n floats each, the last two only when present). A new round's file is
// written in any order under a temporary name (StateWriter), read back once to hash
// and check every section, then its header is written, fsynced, and it is renamed
// into place: a crash leaves the old file or the new one, never half of one. The
// header has its own CRC32C and a 64-bit hash of each section (θ's is the state
// hash), all checked on load; nothing non-finite is written or loaded.
// The temporary file is <file>.next, and a commit swaps it with the file
// (renameat2 RENAME_EXCHANGE, atomic): the previous state then lies in .next and is
// overwritten in place by the next round. Reusing its pages halves the cost of a
// persist on tmpfs (fresh pages are allocated, cleared and later freed by the kernel,
// and stall when two threads write them).
// The header names its format (3); a file of any other format is refused.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace spes::net {

struct PersistedState {
  std::string run_id;
  uint64_t fingerprint = 0;
  int64_t round = 0, step = 0;
  uint64_t state_hash = 0;     // of θ
  uint32_t codec = 0;
  bool has_residual = false;   // set by the reader and the writer
  bool has_momentum = false;
  uint64_t momentum_hash = 0;  // state_hash of the momentum (0 without one)
};

enum class Section { theta, residual, momentum };

// A verified state file open for reads at any offset (thread-safe). Valid until the
// second commit after it (which overwrites the file, renamed to .next by the first).
class StateReader {
 public:
  // Checks the format, the header, the size, every section's hash and that every
  // value is finite (one streaming pass, chunk-sized memory). Throws NetError naming
  // the file.
  static std::shared_ptr<const StateReader> open(const std::string& path, int64_t n_params);
  ~StateReader();
  StateReader(const StateReader&) = delete;
  StateReader& operator=(const StateReader&) = delete;

  const PersistedState& info() const { return info_; }
  int64_t size() const { return n_; }
  bool has(Section s) const;
  // n floats of section s from element `begin` into dst (any alignment). Throws NetError.
  void read(Section s, int64_t begin, int64_t n, void* dst) const;

 private:
  friend class StateWriter;
  StateReader(std::string path, int fd, PersistedState info, int64_t n);
  std::string path_;
  int fd_ = -1;
  PersistedState info_;
  int64_t n_ = 0;
};

// A new state file for `path`, written at any offsets from any threads, then
// committed. Every element of every section must be written (write, zero or copy):
// the file is reused, so what is not written holds an older round's bytes.
class StateWriter {
 public:
  // info: what the header says (its hashes are computed by commit()).
  StateWriter(std::string path, PersistedState info, int64_t n_params);
  ~StateWriter();
  StateWriter(const StateWriter&) = delete;
  StateWriter& operator=(const StateWriter&) = delete;

  bool has(Section s) const;
  void write(Section s, int64_t begin, int64_t n, const float* src);
  void zero(Section s);  // the whole section (a new residual or momentum starts at 0)
  // Copies [begin, begin + n) of section s from another state (the unchanged part of θ).
  void copy(const StateReader& from, Section s, int64_t begin, int64_t n);
  // Reads the file back: every section hashed and checked finite (a non-finite
  // value throws "refusing to persist" and leaves the old file in place); then the
  // header, fsync, rename over `path`, folder fsync. Returns the new file, open.
  std::shared_ptr<const StateReader> commit();

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  PersistedState info_;
  int64_t n_ = 0;
  // One write at a time: the kernel serialises writes to a file anyway (the inode
  // lock), and threads that meet there spin on it instead of sleeping.
  std::mutex write_mu_;
};

// Which format a state file is (0: not a state file). Throws NetError when unreadable.
uint32_t state_file_format(const std::string& path);

}  // namespace spes::net
