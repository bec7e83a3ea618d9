#include "net/state_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "engine/base/error.hpp"
#include "net/digest.hpp"
#include "net/finite_guard.hpp"

namespace spes::net {

namespace {

constexpr char kMagic[8] = {'S', 'P', 'E', 'S', 'C', 'O', 'O', 'R'};
constexpr uint32_t kFormat = 2;  // 2: + the outer momentum (format 1 still loads)

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw NetError("coordinator state " + path + ": " + what);
}

// Little-endian scalars into a byte header.
struct Bytes {
  std::vector<uint8_t> b;
  template <class T>
  void put(T v) {
    uint8_t x[sizeof(T)];
    std::memcpy(x, &v, sizeof(T));
    b.insert(b.end(), x, x + sizeof(T));
  }
};

class Writer {
 public:
  Writer(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail(path, std::string("cannot create: ") + std::strerror(errno));
  }
  ~Writer() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write(const void* p, size_t n) {
    crc_ = crc32c(p, n, crc_);
    raw(p, n);
  }
  void raw(const void* p, size_t n) {
    const auto* c = static_cast<const uint8_t*>(p);
    while (n) {
      const ssize_t w = ::write(fd_, c, std::min<size_t>(n, size_t(1) << 26));
      if (w < 0) {
        if (errno == EINTR) continue;
        fail(path_, std::string("write failed: ") + std::strerror(errno));
      }
      c += w;
      n -= size_t(w);
    }
  }
  void finish() {
    const uint32_t c = crc_;
    raw(&c, 4);
    if (::fsync(fd_) != 0) fail(path_, std::string("fsync failed: ") + std::strerror(errno));
    if (::close(fd_) != 0) fail(path_, std::string("close failed: ") + std::strerror(errno));
    fd_ = -1;
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint32_t crc_ = 0;
};

class Reader {
 public:
  Reader(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  }
  ~Reader() {
    if (fd_ >= 0) ::close(fd_);
  }
  void read(void* p, size_t n) {
    raw(p, n);
    crc_ = crc32c(p, n, crc_);
  }
  void raw(void* p, size_t n) {
    auto* c = static_cast<uint8_t*>(p);
    while (n) {
      const ssize_t r = ::read(fd_, c, std::min<size_t>(n, size_t(1) << 26));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) fail(path_, "truncated");
      c += r;
      n -= size_t(r);
    }
  }
  template <class T>
  T get() {
    T v;
    read(&v, sizeof v);
    return v;
  }
  uint32_t crc() const { return crc_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint32_t crc_ = 0;
};

// Nothing non-finite is persisted or loaded (net/finite_guard.hpp).
void check_finite(const std::string& path, const char* what, const std::vector<float>& x, const char* verb) {
  const int64_t i = first_non_finite(x.data(), int64_t(x.size()));
  if (i >= 0)
    fail(path, std::string(verb) + " a non-finite " + what + " (" + std::to_string(x[size_t(i)]) + " at parameter " +
                   std::to_string(i) + ")");
}

}  // namespace

void save_state_file(const std::string& path, const PersistedState& s, const std::vector<float>& theta,
                     const std::vector<float>* residual, const std::vector<float>* momentum) {
  const std::filesystem::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  if (ec) fail(path, "cannot create its folder: " + ec.message());
  check_finite(path, "θ", theta, "refusing to persist");
  if (residual) check_finite(path, "download residual", *residual, "refusing to persist");
  if (momentum) check_finite(path, "outer momentum", *momentum, "refusing to persist");
  const std::string tmp = path + ".tmp";
  {
    Bytes h;
    h.b.insert(h.b.end(), kMagic, kMagic + 8);
    h.put<uint32_t>(kFormat);
    h.put<uint32_t>(s.codec);
    h.put<uint64_t>(s.fingerprint);
    h.put<int64_t>(s.round);
    h.put<int64_t>(s.step);
    h.put<int64_t>(int64_t(theta.size()));
    h.put<uint64_t>(s.state_hash);
    h.put<uint32_t>(residual ? 1u : 0u);
    h.put<uint32_t>(uint32_t(s.run_id.size()));
    h.b.insert(h.b.end(), s.run_id.begin(), s.run_id.end());
    h.put<uint32_t>(momentum ? 1u : 0u);
    h.put<uint64_t>(momentum ? state_hash(momentum->data(), int64_t(momentum->size())) : 0);
    Writer w(tmp);
    w.write(h.b.data(), h.b.size());
    w.write(theta.data(), theta.size() * 4);
    if (residual) w.write(residual->data(), residual->size() * 4);
    if (momentum) w.write(momentum->data(), momentum->size() * 4);
    w.finish();
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail(path, std::string("rename failed: ") + std::strerror(errno));
  const std::string dir = p.has_parent_path() ? p.parent_path().string() : ".";
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // some filesystems refuse folder fsync; the rename is atomic regardless
    ::close(dfd);
  }
}

PersistedState load_state_file(const std::string& path, std::vector<float>& theta, std::vector<float>* residual,
                               std::vector<float>* momentum) {
  Reader r(path);
  char magic[8];
  r.read(magic, 8);
  if (std::memcmp(magic, kMagic, 8) != 0) fail(path, "not a coordinator state file");
  const uint32_t format = r.get<uint32_t>();
  if (format < 1 || format > kFormat)
    fail(path, "format version " + std::to_string(format) + " is not one this build reads (1 to " +
                   std::to_string(kFormat) + "); written by a newer spes-engine?");
  PersistedState s;
  s.codec = r.get<uint32_t>();
  s.fingerprint = r.get<uint64_t>();
  s.round = r.get<int64_t>();
  s.step = r.get<int64_t>();
  const int64_t n = r.get<int64_t>();
  s.state_hash = r.get<uint64_t>();
  const uint32_t has_residual = r.get<uint32_t>();
  const uint32_t run_len = r.get<uint32_t>();
  if (run_len > 4096 || has_residual > 1) fail(path, "corrupt header");
  s.run_id.resize(run_len);
  r.read(s.run_id.data(), run_len);
  if (format >= 2) {
    const uint32_t has_momentum = r.get<uint32_t>();
    s.momentum_hash = r.get<uint64_t>();
    if (has_momentum > 1) fail(path, "corrupt header");
    s.has_momentum = has_momentum == 1;
  }
  if (n != int64_t(theta.size()))
    fail(path, "holds " + std::to_string(n) + " parameters, the model has " + std::to_string(theta.size()));
  r.read(theta.data(), theta.size() * 4);
  std::vector<float> res;
  if (has_residual) {
    res.resize(theta.size());
    r.read(res.data(), res.size() * 4);
  }
  std::vector<float> mom;
  if (s.has_momentum) {
    mom.resize(theta.size());
    r.read(mom.data(), mom.size() * 4);
  }
  const uint32_t expect = r.crc();
  uint32_t stored;
  r.raw(&stored, 4);
  if (stored != expect) fail(path, "checksum mismatch (corrupt file)");
  check_finite(path, "θ", theta, "holds");
  if (has_residual) check_finite(path, "download residual", res, "holds");
  if (s.has_momentum && state_hash(mom.data(), int64_t(mom.size())) != s.momentum_hash)
    fail(path, "the outer momentum does not match its hash");
  if (s.has_momentum) check_finite(path, "outer momentum", mom, "holds");
  if (residual && has_residual) *residual = std::move(res);
  if (momentum && s.has_momentum) *momentum = std::move(mom);
  return s;
}

}  // namespace spes::net
