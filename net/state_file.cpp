#include "net/state_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "engine/base/atomic_file.hpp"
#include "engine/base/error.hpp"
#include "engine/base/parallel.hpp"
#include "net/digest.hpp"
#include "net/file_io.hpp"
#include "net/finite_guard.hpp"

namespace spes::net {

namespace {

constexpr char kMagic[8] = {'S', 'P', 'E', 'S', 'C', 'O', 'O', 'R'};
constexpr uint32_t kFormat = 3;
constexpr int64_t kHeaderSize = 4096;     // the sections start here
constexpr size_t kMaxRunId = 1024;
constexpr int64_t kBlockElems = 1 << 20;  // streaming passes read 4 MiB at a time

// What the state file's errors name.
std::string label(const std::string& path) { return "coordinator state " + path; }

[[noreturn]] void fail(const std::string& path, const std::string& what) { throw NetError(label(path) + ": " + what); }

std::string errno_text() { return std::strerror(errno); }

const char* section_name(Section s) {
  switch (s) {
    case Section::theta: return "θ";
    case Section::residual: return "download residual";
    case Section::momentum: return "outer momentum";
  }
  return "?";
}

std::vector<Section> sections_of(const PersistedState& s) {
  std::vector<Section> v{Section::theta};
  if (s.has_residual) v.push_back(Section::residual);
  if (s.has_momentum) v.push_back(Section::momentum);
  return v;
}

// Where section s starts: θ first, then the residual and the momentum when present.
int64_t section_offset(const PersistedState& info, int64_t n, Section s) {
  int64_t k = 0;
  for (Section x : sections_of(info)) {
    if (x == s) return kHeaderSize + k * n * 4;
    ++k;
  }
  throw NetError(std::string("internal: the state file has no ") + section_name(s));
}

bool holds(const PersistedState& info, Section s) {
  return s == Section::theta || (s == Section::residual ? info.has_residual : info.has_momentum);
}

// ---- header -----------------------------------------------------------------

struct SectionHashes {
  uint64_t theta = 0, residual = 0, momentum = 0;
};

struct HeaderOut {
  std::vector<uint8_t> b;
  template <class T>
  void put(T v) {
    uint8_t x[sizeof(T)];
    std::memcpy(x, &v, sizeof(T));
    b.insert(b.end(), x, x + sizeof(T));
  }
};

std::vector<uint8_t> encode_header(const PersistedState& s, int64_t n, const SectionHashes& h) {
  HeaderOut o;
  o.b.insert(o.b.end(), kMagic, kMagic + 8);
  o.put<uint32_t>(kFormat);
  o.put<uint32_t>(s.codec);
  o.put<uint64_t>(s.fingerprint);
  o.put<int64_t>(s.round);
  o.put<int64_t>(s.step);
  o.put<int64_t>(n);
  o.put<uint64_t>(h.theta);
  o.put<uint64_t>(h.residual);
  o.put<uint64_t>(h.momentum);
  o.put<uint32_t>(s.has_residual ? 1 : 0);
  o.put<uint32_t>(s.has_momentum ? 1 : 0);
  o.put<uint32_t>(uint32_t(s.run_id.size()));
  o.b.insert(o.b.end(), s.run_id.begin(), s.run_id.end());
  o.b.resize(size_t(kHeaderSize) - 4, 0);
  o.put<uint32_t>(crc32c(o.b.data(), o.b.size()));
  return o.b;
}

struct HeaderIn {
  const uint8_t* p;
  size_t at = 0;
  template <class T>
  T get() {
    T v;
    std::memcpy(&v, p + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
};

PersistedState decode_header(const std::string& path, const uint8_t* b, int64_t* n, SectionHashes* h) {
  uint32_t crc;
  std::memcpy(&crc, b + kHeaderSize - 4, 4);
  if (crc != crc32c(b, size_t(kHeaderSize) - 4)) fail(path, "header checksum mismatch (corrupt file)");
  HeaderIn in{b, 12};
  PersistedState s;
  s.codec = in.get<uint32_t>();
  s.fingerprint = in.get<uint64_t>();
  s.round = in.get<int64_t>();
  s.step = in.get<int64_t>();
  *n = in.get<int64_t>();
  h->theta = in.get<uint64_t>();
  h->residual = in.get<uint64_t>();
  h->momentum = in.get<uint64_t>();
  const uint32_t has_residual = in.get<uint32_t>(), has_momentum = in.get<uint32_t>();
  const uint32_t run_len = in.get<uint32_t>();
  if (has_residual > 1 || has_momentum > 1 || run_len > kMaxRunId || *n < 0) fail(path, "corrupt header");
  s.run_id.assign(reinterpret_cast<const char*>(b + in.at), run_len);
  s.has_residual = has_residual == 1;
  s.has_momentum = has_momentum == 1;
  s.state_hash = h->theta;
  s.momentum_hash = h->momentum;
  return s;
}

// One pass over every section: its hash, and the first non-finite value refused
// with `verb` ("holds" on load, "refusing to persist" before a commit).
SectionHashes hash_and_check(int fd, const std::string& path, const PersistedState& info, int64_t n,
                             const char* verb) {
  const std::vector<Section> sections = sections_of(info);
  std::vector<uint64_t> digest(sections.size());
  parallel_for(int64_t(sections.size()), [&](int64_t k) {  // one thread per section
    const Section s = sections[size_t(k)];
    std::vector<float> block(size_t(std::min(n, kBlockElems)));
    StateHasher hasher;
    const int64_t base = section_offset(info, n, s);
    for (int64_t i = 0; i < n; i += kBlockElems) {
      const int64_t m = std::min(kBlockElems, n - i);
      pread_exact(fd, label(path), block.data(), size_t(m) * 4, base + i * 4);
      const int64_t bad = first_non_finite(block.data(), m);
      if (bad >= 0)
        fail(path, std::string(verb) + " a non-finite " + section_name(s) + " (" + std::to_string(block[size_t(bad)]) +
                       " at parameter " + std::to_string(i + bad) + ")");
      hasher.update(block.data(), m);
    }
    digest[size_t(k)] = hasher.digest();
  });
  SectionHashes h;
  for (size_t k = 0; k < sections.size(); ++k)
    (sections[k] == Section::theta ? h.theta : sections[k] == Section::residual ? h.residual : h.momentum) = digest[k];
  return h;
}

// Refuses what is not a state file, or is a state file of another format.
void check_format(const std::string& path) {
  const uint32_t format = state_file_format(path);
  if (format == 0) fail(path, "not a coordinator state file");
  if (format != kFormat)
    fail(path, "format " + std::to_string(format) + ", but this build reads only format " + std::to_string(kFormat));
}

}  // namespace

// ---- StateReader --------------------------------------------------------------

StateReader::StateReader(std::string path, int fd, PersistedState info, int64_t n)
    : path_(std::move(path)), fd_(fd), info_(std::move(info)), n_(n) {}

StateReader::~StateReader() {
  if (fd_ >= 0) ::close(fd_);
}

bool StateReader::has(Section s) const { return holds(info_, s); }

std::shared_ptr<const StateReader> StateReader::open(const std::string& path, int64_t n_params) {
  check_format(path);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, "cannot open: " + errno_text());
  std::shared_ptr<StateReader> r(new StateReader(path, fd, {}, 0));  // owns fd from here
  std::vector<uint8_t> header(static_cast<size_t>(kHeaderSize));
  pread_exact(fd, label(path), header.data(), header.size(), 0);
  SectionHashes stored;
  int64_t n = 0;
  r->info_ = decode_header(path, header.data(), &n, &stored);
  if (n != n_params)
    fail(path, "holds " + std::to_string(n) + " parameters, the model has " + std::to_string(n_params));
  r->n_ = n;
  const int64_t expect = kHeaderSize + int64_t(sections_of(r->info_).size()) * n * 4;
  const off_t end = ::lseek(fd, 0, SEEK_END);
  if (end != off_t(expect))
    fail(path, "is " + std::to_string(end) + " bytes, its header says " + std::to_string(expect) + " (truncated?)");
  const SectionHashes h = hash_and_check(fd, path, r->info_, n, "holds");
  if (h.theta != stored.theta) fail(path, "checksum mismatch in θ: state hash does not match (corrupt file)");
  if (h.residual != stored.residual) fail(path, "checksum mismatch in the download residual (corrupt file)");
  if (h.momentum != stored.momentum) fail(path, "the outer momentum does not match its hash (corrupt file)");
  return r;
}

void StateReader::read(Section s, int64_t begin, int64_t n, void* dst) const {
  if (begin < 0 || n < 0 || begin + n > n_) fail(path_, "internal: read outside the model");
  pread_exact(fd_, label(path_), dst, size_t(n) * 4, section_offset(info_, n_, s) + begin * 4);
}

// ---- StateWriter --------------------------------------------------------------

StateWriter::StateWriter(std::string path, PersistedState info, int64_t n_params)
    : path_(std::move(path)), tmp_(path_ + ".next"), info_(std::move(info)), n_(n_params) {
  if (info_.run_id.size() > kMaxRunId) fail(path_, "run id longer than " + std::to_string(kMaxRunId) + " bytes");
  const std::filesystem::path p(path_);
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  if (ec) fail(path_, "cannot create its folder: " + ec.message());
  // Not truncated: the previous round's file is overwritten in place (see the header).
  fd_ = ::open(tmp_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(tmp_, "cannot create: " + errno_text());
  const int64_t bytes = kHeaderSize + int64_t(sections_of(info_).size()) * n_ * 4;
  if (::ftruncate(fd_, off_t(bytes)) != 0) {
    const std::string why = errno_text();
    ::close(fd_);
    fd_ = -1;
    fail(tmp_, "cannot size to " + std::to_string(bytes) + " bytes: " + why);
  }
}

StateWriter::~StateWriter() {
  if (fd_ >= 0) ::close(fd_);
}

bool StateWriter::has(Section s) const { return holds(info_, s); }

void StateWriter::write(Section s, int64_t begin, int64_t n, const float* src) {
  if (begin < 0 || n < 0 || begin + n > n_) fail(tmp_, "internal: write outside the model");
  std::lock_guard<std::mutex> lk(write_mu_);
  pwrite_exact(fd_, label(tmp_), src, size_t(n) * 4, section_offset(info_, n_, s) + begin * 4);
}

void StateWriter::zero(Section s) {
  const std::vector<float> zeros(size_t(std::min(n_, kBlockElems)), 0.0f);
  for (int64_t i = 0; i < n_; i += kBlockElems) write(s, i, std::min(kBlockElems, n_ - i), zeros.data());
}

void StateWriter::copy(const StateReader& from, Section s, int64_t begin, int64_t n) {
  thread_local std::vector<float> block;
  block.resize(size_t(std::min(n, kBlockElems)));
  for (int64_t i = 0; i < n; i += kBlockElems) {
    const int64_t m = std::min(kBlockElems, n - i);
    from.read(s, begin + i, m, block.data());
    write(s, begin + i, m, block.data());
  }
}

std::shared_ptr<const StateReader> StateWriter::commit() {
  const SectionHashes h = hash_and_check(fd_, tmp_, info_, n_, "refusing to persist");
  info_.state_hash = h.theta;
  info_.momentum_hash = h.momentum;
  const std::vector<uint8_t> header = encode_header(info_, n_, h);
  pwrite_exact(fd_, label(tmp_), header.data(), header.size(), 0);
  if (::fsync(fd_) != 0) fail(tmp_, "fsync failed: " + errno_text());
  // Swap the two files in one step: `path` is the new state, the old one becomes the
  // next round's scratch. The first state, or a filesystem without the exchange, renames.
  if (::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, path_.c_str(), RENAME_EXCHANGE) != 0 &&
      ::rename(tmp_.c_str(), path_.c_str()) != 0)
    fail(path_, "rename failed: " + errno_text());
  const std::filesystem::path p(path_);
  try {  // after the rename: on failure the new file may be in place, not yet durable
    fsync_dir(p.has_parent_path() ? p.parent_path().string() : ".");
  } catch (const std::exception& e) {
    fail(path_, std::string(e.what()) + " (after renaming the new state into place)");
  }
  std::shared_ptr<const StateReader> r(new StateReader(path_, fd_, info_, n_));
  fd_ = -1;  // the reader owns it now
  return r;
}

// ---- format -----------------------------------------------------------------

uint32_t state_file_format(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, "cannot open: " + errno_text());
  uint8_t head[12] = {};
  ssize_t got;
  do got = ::pread(fd, head, sizeof head, 0);
  while (got < 0 && errno == EINTR);
  ::close(fd);
  if (got != ssize_t(sizeof head) || std::memcmp(head, kMagic, 8) != 0) return 0;
  uint32_t format;
  std::memcpy(&format, head + 8, 4);
  return format;
}

}  // namespace spes::net
