// state.bin, format version 1 (all integers little-endian):
//
//   header   24 B   magic "SPESCKPT" | u32 version | u32 section count | u64 file size
//   section  32 B   name (16 B, NUL-padded ASCII) | u32 element size | u32 CRC32C of payload
//                   | u64 payload bytes
//            ...    payload (no padding: it is read with read(), never mapped)
//   ...             one section per entry of kSections, in that order, each exactly once
//   trailer  16 B   magic "SPESEND\0" | u32 CRC32C of header + every section header | u32 0
//
// The trailer CRC covers the section headers, which carry each payload's CRC, so
// it checksums the whole file without a second pass over gigabytes of payload.
// The reader checks magic, version, section count and the declared file size
// against the real one first, then every section's name, element size and length
// against the bytes that remain, before allocating anything.
#include "engine/checkpoint.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <utility>

#include "engine/base/atomic_file.hpp"
#include "engine/base/checksum.hpp"
#include "engine/base/error.hpp"
#include "engine/base/finite.hpp"

namespace spes {

static_assert(std::endian::native == std::endian::little, "checkpoints are written little-endian");

namespace {

namespace fs = std::filesystem;

constexpr char kMagic[8] = {'S', 'P', 'E', 'S', 'C', 'K', 'P', 'T'};
constexpr char kTrailerMagic[8] = {'S', 'P', 'E', 'S', 'E', 'N', 'D', '\0'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 24;
constexpr size_t kSectionHeaderBytes = 32;
constexpr size_t kTrailerBytes = 16;
constexpr size_t kNameBytes = 16;
constexpr const char* kStateFile = "state.bin";

struct SectionSpec {
  const char* name;
  uint32_t elem;  // bytes per element; the payload length must be a multiple
};
constexpr SectionSpec kSections[] = {
    {"meta", 8},         // u64 fingerprint, i64 node_id, i64 step, i64 sync_round
    {"config_toml", 1},  {"params", 4},    {"master", 4},        {"adam_m", 4},
    {"adam_v", 4},       {"data_state", 8}, {"rng_state", 8},    {"sync_base", 4},
    {"sync_residual", 4},
};
constexpr size_t kSectionCount = sizeof(kSections) / sizeof(kSections[0]);
constexpr size_t kMetaBytes = 32;

template <class T>
void put(unsigned char* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <class T>
T get(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

std::string step_folder_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

// The step of a folder named step-XXXXXXXX (at least 8 digits), or nullopt.
std::optional<int64_t> parse_step_folder(const std::string& name) {
  if (name.size() < 13 || name.size() > 5 + 18 || name.compare(0, 5, "step-") != 0) return std::nullopt;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

struct Payload {
  const void* data;
  uint64_t bytes;
};

void check_state(const CheckpointState& s, const std::string& where) {
  auto bad = [&](const std::string& what) { throw CheckpointError("checkpoint " + where + ": " + what); };
  if (s.step < 0) bad("negative step " + std::to_string(s.step));
  if (s.adam_m.size() != s.adam_v.size())
    bad("adam_m has " + std::to_string(s.adam_m.size()) + " values but adam_v has " +
        std::to_string(s.adam_v.size()));
  if (!s.master.empty() && s.master.size() != s.adam_m.size())
    bad("master has " + std::to_string(s.master.size()) + " values but the moments have " +
        std::to_string(s.adam_m.size()));
  // Never written and never taken back: a run resumed from a non-finite value would
  // train on garbage, or publish it at its next round.
  const std::pair<const char*, const std::vector<float>*> sections[] = {
      {"params", &s.params}, {"master", &s.master},       {"adam_m", &s.adam_m},
      {"adam_v", &s.adam_v}, {"sync_base", &s.sync_base}, {"sync_residual", &s.sync_residual}};
  for (const auto& [name, values] : sections)
    if (const std::string why = describe_non_finite(values->data(), int64_t(values->size())); !why.empty())
      bad(std::string(name) + " " + why + " (a checkpoint holds finite values only)");
}

// All the steps under root that are complete checkpoints, ascending.
std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    auto step = parse_step_folder(entry.path().filename().string());
    if (!step) continue;  // .step-XXXXXXXX.tmp and anything else are not checkpoints
    std::error_code ec2;
    if (!entry.is_directory(ec2) || !fs::is_regular_file(entry.path() / kStateFile, ec2)) continue;
    out.emplace_back(*step, entry.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

void write_state_file(const std::string& path, const CheckpointState& s) {
  unsigned char meta[kMetaBytes];
  put<uint64_t>(meta + 0, s.fingerprint);
  put<int64_t>(meta + 8, s.node_id);
  put<int64_t>(meta + 16, s.step);
  put<int64_t>(meta + 24, s.sync_round);
  auto f32 = [](const std::vector<float>& v) { return Payload{v.data(), v.size() * sizeof(float)}; };
  auto u64 = [](const std::vector<uint64_t>& v) { return Payload{v.data(), v.size() * sizeof(uint64_t)}; };
  const Payload payloads[kSectionCount] = {
      {meta, kMetaBytes},   {s.config_toml.data(), s.config_toml.size()},
      f32(s.params),        f32(s.master),
      f32(s.adam_m),        f32(s.adam_v),
      u64(s.data_state),    u64(s.rng_state),
      f32(s.sync_base),     f32(s.sync_residual),
  };

  uint64_t file_bytes = kHeaderBytes + kSectionCount * kSectionHeaderBytes + kTrailerBytes;
  for (const auto& p : payloads) file_bytes += p.bytes;

  unsigned char header[kHeaderBytes];
  std::memcpy(header, kMagic, 8);
  put<uint32_t>(header + 8, kVersion);
  put<uint32_t>(header + 12, static_cast<uint32_t>(kSectionCount));
  put<uint64_t>(header + 16, file_bytes);
  uint32_t meta_crc = crc32c(header, kHeaderBytes);

  FileWriter w(path);
  w.write(header, kHeaderBytes);
  for (size_t i = 0; i < kSectionCount; ++i) {
    unsigned char sh[kSectionHeaderBytes] = {};
    std::strncpy(reinterpret_cast<char*>(sh), kSections[i].name, kNameBytes);
    put<uint32_t>(sh + 16, kSections[i].elem);
    put<uint32_t>(sh + 20, crc32c(payloads[i].data, payloads[i].bytes));
    put<uint64_t>(sh + 24, payloads[i].bytes);
    meta_crc = crc32c(sh, kSectionHeaderBytes, meta_crc);
    w.write(sh, kSectionHeaderBytes);
    w.write(payloads[i].data, payloads[i].bytes);
  }
  unsigned char trailer[kTrailerBytes] = {};
  std::memcpy(trailer, kTrailerMagic, 8);
  put<uint32_t>(trailer + 8, meta_crc);
  w.write(trailer, kTrailerBytes);
  w.finish();
}

// Sequential reader over state.bin; every error names the file.
class StateReader {
 public:
  explicit StateReader(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) fail(std::string("cannot open: ") + std::strerror(errno));
    struct stat st;
    if (::fstat(fd_, &st) != 0) fail(std::string("cannot stat: ") + std::strerror(errno));
    size_ = static_cast<uint64_t>(st.st_size);
  }
  ~StateReader() {
    if (fd_ >= 0) ::close(fd_);
  }
  StateReader(const StateReader&) = delete;
  StateReader& operator=(const StateReader&) = delete;

  [[noreturn]] void fail(const std::string& what) const {
    throw CheckpointError("checkpoint " + path_ + ": " + what);
  }
  uint64_t size() const { return size_; }
  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }

  void read(void* dst, uint64_t n, const char* what) {
    auto* p = static_cast<char*>(dst);
    while (n > 0) {
      ssize_t r = ::read(fd_, p, n < (uint64_t{1} << 30) ? n : (uint64_t{1} << 30));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) fail(std::string("read error in ") + what + ": " + std::strerror(errno));
      if (r == 0) fail(std::string("truncated inside ") + what + " (file shrank while reading?)");
      p += r;
      n -= static_cast<uint64_t>(r);
      pos_ += static_cast<uint64_t>(r);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  uint64_t pos_ = 0;
};

template <class T>
void read_array(StateReader& r, std::vector<T>& out, uint64_t bytes, const char* name) {
  out.resize(bytes / sizeof(T));
  r.read(out.data(), bytes, name);
}

CheckpointState read_state_file(const std::string& path) {
  StateReader r(path);
  const uint64_t size = r.size();
  if (size == 0) r.fail("empty file (0 bytes)");

  unsigned char header[kHeaderBytes] = {};
  const uint64_t head = std::min<uint64_t>(size, kHeaderBytes);
  r.read(header, head, "header");
  if (std::memcmp(header, kMagic, std::min<uint64_t>(head, 8)) != 0) r.fail("not a spes checkpoint (bad magic)");
  if (size < kHeaderBytes + kTrailerBytes)
    r.fail("truncated: " + std::to_string(size) + " bytes is less than header and trailer");
  const uint32_t version = get<uint32_t>(header + 8);
  if (version != kVersion)
    r.fail("unsupported format version " + std::to_string(version) + " (this build reads " +
           std::to_string(kVersion) + ")");
  const uint32_t count = get<uint32_t>(header + 12);
  if (count != kSectionCount)
    r.fail("has " + std::to_string(count) + " sections, format version 1 has " + std::to_string(kSectionCount));
  const uint64_t declared = get<uint64_t>(header + 16);
  if (declared != size)
    r.fail((size < declared ? "truncated: header says " : "wrong size: header says ") + std::to_string(declared) +
           " bytes, file has " + std::to_string(size));
  uint32_t meta_crc = crc32c(header, kHeaderBytes);

  CheckpointState s;
  unsigned char meta[kMetaBytes] = {};
  for (size_t i = 0; i < kSectionCount; ++i) {
    const SectionSpec& spec = kSections[i];
    if (r.remaining() < kSectionHeaderBytes + kTrailerBytes)
      r.fail(std::string("truncated before section '") + spec.name + "'");
    unsigned char sh[kSectionHeaderBytes];
    r.read(sh, kSectionHeaderBytes, "section header");
    meta_crc = crc32c(sh, kSectionHeaderBytes, meta_crc);
    char name[kNameBytes + 1] = {};
    std::memcpy(name, sh, kNameBytes);
    if (std::strncmp(name, spec.name, kNameBytes) != 0) {
      std::string shown;
      for (char c : std::string(name)) shown += (c >= 32 && c < 127) ? c : '?';
      r.fail("section " + std::to_string(i) + " is '" + shown + "', expected '" + spec.name + "'");
    }
    const uint32_t elem = get<uint32_t>(sh + 16);
    const uint32_t stored_crc = get<uint32_t>(sh + 20);
    const uint64_t bytes = get<uint64_t>(sh + 24);
    if (elem != spec.elem)
      r.fail(std::string("section '") + spec.name + "' has element size " + std::to_string(elem) + ", expected " +
             std::to_string(spec.elem));
    // Checked before allocating: a corrupt length must not become a huge allocation.
    if (bytes > r.remaining() - kTrailerBytes)
      r.fail(std::string("section '") + spec.name + "' claims " + std::to_string(bytes) + " bytes but only " +
             std::to_string(r.remaining() - kTrailerBytes) + " remain");
    if (bytes % elem != 0)
      r.fail(std::string("section '") + spec.name + "' length " + std::to_string(bytes) +
             " is not a multiple of its element size " + std::to_string(elem));
    const void* data = nullptr;
    switch (i) {
      case 0:
        if (bytes != kMetaBytes)
          r.fail("section 'meta' has " + std::to_string(bytes) + " bytes, expected " + std::to_string(kMetaBytes));
        r.read(meta, bytes, spec.name);
        data = meta;
        break;
      case 1:
        s.config_toml.resize(bytes);
        r.read(s.config_toml.data(), bytes, spec.name);
        data = s.config_toml.data();
        break;
      case 2: read_array(r, s.params, bytes, spec.name), data = s.params.data(); break;
      case 3: read_array(r, s.master, bytes, spec.name), data = s.master.data(); break;
      case 4: read_array(r, s.adam_m, bytes, spec.name), data = s.adam_m.data(); break;
      case 5: read_array(r, s.adam_v, bytes, spec.name), data = s.adam_v.data(); break;
      case 6: read_array(r, s.data_state, bytes, spec.name), data = s.data_state.data(); break;
      case 7: read_array(r, s.rng_state, bytes, spec.name), data = s.rng_state.data(); break;
      case 8: read_array(r, s.sync_base, bytes, spec.name), data = s.sync_base.data(); break;
      case 9: read_array(r, s.sync_residual, bytes, spec.name), data = s.sync_residual.data(); break;
    }
    const uint32_t crc = crc32c(data, bytes);
    if (crc != stored_crc)
      r.fail(std::string("section '") + spec.name + "' is corrupt (CRC32C " + hex32(crc) + ", stored " +
             hex32(stored_crc) + ")");
  }
  if (r.remaining() != kTrailerBytes)
    r.fail(std::to_string(r.remaining() - kTrailerBytes) + " unexpected bytes after the last section");
  unsigned char trailer[kTrailerBytes];
  r.read(trailer, kTrailerBytes, "trailer");
  if (std::memcmp(trailer, kTrailerMagic, 8) != 0 || get<uint32_t>(trailer + 12) != 0)
    r.fail("bad trailer (file not completely written?)");
  if (get<uint32_t>(trailer + 8) != meta_crc)
    r.fail("header checksum mismatch (CRC32C " + hex32(meta_crc) + ", stored " + hex32(get<uint32_t>(trailer + 8)) +
           ")");

  s.fingerprint = get<uint64_t>(meta + 0);
  s.node_id = get<int64_t>(meta + 8);
  s.step = get<int64_t>(meta + 16);
  s.sync_round = get<int64_t>(meta + 24);
  check_state(s, path);
  return s;
}

[[noreturn]] void fs_fail(const std::string& path, const std::string& what, const std::error_code& ec) {
  throw CheckpointError("checkpoint " + path + ": " + what + ": " + ec.message());
}

}  // namespace

std::string save_checkpoint(const std::string& root, const CheckpointState& s, int64_t keep) {
  const fs::path root_path(root);
  const std::string name = step_folder_name(s.step);
  const fs::path final_dir = root_path / name;
  check_state(s, final_dir.string());

  std::error_code ec;
  fs::create_directories(root_path, ec);
  if (ec) fs_fail(root, "cannot create folder", ec);
  // A crash mid-save leaves this temp folder behind; it is never taken for a
  // checkpoint (latest_checkpoint only looks at step-XXXXXXXX) and is reused here.
  const fs::path tmp_dir = root_path / ("." + name + ".tmp");
  fs::remove_all(tmp_dir, ec);
  if (ec) fs_fail(tmp_dir.string(), "cannot remove stale temp folder", ec);
  fs::create_directory(tmp_dir, ec);
  if (ec) fs_fail(tmp_dir.string(), "cannot create temp folder", ec);

  try {
    write_state_file((tmp_dir / kStateFile).string(), s);
    FileWriter cfg((tmp_dir / "config.toml").string());
    cfg.write(s.config_toml);
    cfg.finish();
    fsync_dir(tmp_dir.string());

    if (fs::exists(final_dir)) {
      // Saving the same step again (e.g. a resumed run that stops where it
      // started): swap atomically, then drop the old copy now under the temp name.
      if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0)
        throw CheckpointError("checkpoint " + final_dir.string() + ": cannot replace: " + std::strerror(errno));
      fs::remove_all(tmp_dir, ec);
    } else if (::rename(tmp_dir.c_str(), final_dir.c_str()) != 0) {
      throw CheckpointError("checkpoint " + final_dir.string() + ": cannot rename temp folder into place: " +
                            std::strerror(errno));
    }
    fsync_dir(root_path.string());
  } catch (...) {
    fs::remove_all(tmp_dir, ec);
    throw;
  }

  // Keep the newest `keep` (keep <= 0: keep all), never the folder just written.
  if (keep > 0) {
    auto all = list_checkpoints(root_path);
    const int64_t extra = static_cast<int64_t>(all.size()) - keep;
    for (int64_t i = 0; i < extra; ++i) {
      if (all[i].first == s.step) continue;
      fs::remove_all(all[i].second, ec);
      if (ec) fs_fail(all[i].second.string(), "cannot prune old checkpoint", ec);
    }
  }
  return final_dir.string();
}

std::string latest_checkpoint(const std::string& root) {
  auto all = list_checkpoints(fs::path(root));
  return all.empty() ? std::string() : all.back().second.string();
}

CheckpointState load_checkpoint(const std::string& path) {
  std::error_code ec;
  const fs::path p(path);
  if (!fs::exists(p, ec)) throw CheckpointError("checkpoint " + path + ": no such file or folder");
  fs::path file;
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / kStateFile, ec)) {
      file = p / kStateFile;
    } else {
      const std::string latest = latest_checkpoint(path);
      if (latest.empty())
        throw CheckpointError("checkpoint " + path + ": holds neither state.bin nor a step-XXXXXXXX checkpoint folder");
      file = fs::path(latest) / kStateFile;
    }
  } else {
    file = p;  // state.bin named directly
  }
  CheckpointState s = read_state_file(file.string());
  if (auto folder_step = parse_step_folder(file.parent_path().filename().string());
      folder_step && *folder_step != s.step)
    throw CheckpointError("checkpoint " + file.string() + ": holds step " + std::to_string(s.step) +
                          " but its folder is named for step " + std::to_string(*folder_step));
  return s;
}

}  // namespace spes
