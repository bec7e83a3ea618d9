#include "data/token_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <fstream>
#include <utility>

#include "engine/base/error.hpp"

namespace spes {

// Token files are little-endian on disk and read in place through the mapping.
static_assert(std::endian::native == std::endian::little,
              "token files are read in place; a big-endian host needs byte swapping here");

TokenDtype parse_token_dtype(std::string_view name) {
  if (const auto dtype = enum_from_name(kTokenDtypeNames, name)) return *dtype;
  throw DataError("token dtype '" + std::string(name) + "' is not supported (expected " +
                  join_names(kTokenDtypeNames, "", ", ", " or ") + ")");
}

const char* token_dtype_name(TokenDtype dtype) { return name_of(kTokenDtypeNames, dtype); }

// ---- TokenFile ---------------------------------------------------------------

TokenFile::TokenFile(std::string path, TokenDtype dtype) : path_(std::move(path)), dtype_(dtype) {
  int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) throw DataError("token file " + path_ + ": not found");
    throw DataError("token file " + path_ + ": cannot open (" + std::strerror(err) + ")");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw DataError("token file " + path_ + ": not a regular file");
  }
  const uint64_t bytes = static_cast<uint64_t>(st.st_size);
  const size_t width = token_width(dtype_);
  if (bytes % width != 0) {
    ::close(fd);
    throw DataError("token file " + path_ + ": size " + std::to_string(bytes) +
                    " bytes is not a multiple of " + std::to_string(width) + " (" +
                    token_dtype_name(dtype_) + " tokens); wrong dtype or a truncated file?");
  }
  n_tokens_ = bytes / width;
  if (bytes > 0) {
    void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      throw DataError("token file " + path_ + ": mmap failed (" + std::strerror(err) + ")");
    }
    data_ = static_cast<const unsigned char*>(p);
    map_bytes_ = bytes;
  }
  ::close(fd);  // the mapping keeps the file alive
  refuse_npy_header();
}

// The SPES reference names its raw memmaps `.npy`; a real NumPy file (np.save) starts
// with a header that would otherwise be read as tokens.
void TokenFile::refuse_npy_header() {
  static constexpr char kMagic[] = "\x93NUMPY";
  if (map_bytes_ < 6 || std::memcmp(data_, kMagic, 6) != 0) return;
  unmap();
  throw DataError("token file " + path_ + ": starts with a NumPy .npy header (written by np.save); token files are "
                  "raw arrays without one (np.memmap, as OLMo and the SPES reference write them): rewrite it with "
                  "np.load(path).tofile(path)");
}

TokenFile::~TokenFile() { unmap(); }

TokenFile::TokenFile(TokenFile&& other) noexcept
    : path_(std::move(other.path_)),
      dtype_(other.dtype_),
      data_(std::exchange(other.data_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      n_tokens_(std::exchange(other.n_tokens_, 0)) {}

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    dtype_ = other.dtype_;
    data_ = std::exchange(other.data_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    n_tokens_ = std::exchange(other.n_tokens_, 0);
  }
  return *this;
}

void TokenFile::unmap() noexcept {
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), map_bytes_);
  data_ = nullptr;
  map_bytes_ = 0;
}

void TokenFile::throw_bad_token(uint64_t offset, uint32_t id, int64_t vocab_size) const {
  throw DataError("token file " + path_ + ": token id " + std::to_string(id) + " at token offset " +
                  std::to_string(offset) + " (byte " + std::to_string(offset * token_width(dtype_)) +
                  ") is >= vocab_size " + std::to_string(vocab_size) +
                  "; wrong dtype, tokenizer or model.vocab_size?");
}

namespace {

// Loads go through memcpy (no aliasing questions); it compiles to a plain load.
template <typename T>
void copy_checked(const unsigned char* src, uint64_t count, uint32_t limit, int32_t* out,
                  uint64_t* bad_index) {
  for (uint64_t i = 0; i < count; ++i) {
    T v;
    std::memcpy(&v, src + i * sizeof(T), sizeof(T));
    if (v >= limit) {
      *bad_index = i;
      return;
    }
    out[i] = static_cast<int32_t>(v);
  }
  *bad_index = count;
}

template <typename T>
uint64_t find_bad(const unsigned char* src, uint64_t count, uint32_t limit) {
  for (uint64_t i = 0; i < count; ++i) {
    T v;
    std::memcpy(&v, src + i * sizeof(T), sizeof(T));
    if (v >= limit) return i;
  }
  return count;
}

uint32_t id_limit(int64_t vocab_size) {
  // Token ids become int32 model inputs: ids at or above 2^31 are rejected whatever
  // the vocab (TokenDataset refuses such a vocab_size up front).
  return static_cast<uint32_t>(std::clamp<int64_t>(vocab_size, 0, INT32_MAX));
}

uint32_t load_token(const unsigned char* data, TokenDtype dtype, uint64_t i) {
  if (dtype == TokenDtype::kUint16) {
    uint16_t v;
    std::memcpy(&v, data + i * 2, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, data + i * 4, 4);
  return v;
}

}  // namespace

void TokenFile::read(uint64_t begin, uint64_t count, int64_t vocab_size, int32_t* out) const {
  if (begin > n_tokens_ || count > n_tokens_ - begin) {
    throw DataError("token file " + path_ + ": read of tokens [" + std::to_string(begin) + ", " +
                    std::to_string(begin + count) + ") is past its end (" + std::to_string(n_tokens_) +
                    " tokens)");
  }
  if (count == 0) return;
  const uint32_t limit = id_limit(vocab_size);
  const unsigned char* src = data_ + begin * token_width(dtype_);
  uint64_t bad = 0;
  if (dtype_ == TokenDtype::kUint16) copy_checked<uint16_t>(src, count, limit, out, &bad);
  else copy_checked<uint32_t>(src, count, limit, out, &bad);
  if (bad < count) throw_bad_token(begin + bad, load_token(data_, dtype_, begin + bad), vocab_size);
}

void TokenFile::validate(int64_t vocab_size) const {
  if (n_tokens_ == 0) return;
  const uint32_t limit = id_limit(vocab_size);
  uint64_t bad = dtype_ == TokenDtype::kUint16 ? find_bad<uint16_t>(data_, n_tokens_, limit)
                                               : find_bad<uint32_t>(data_, n_tokens_, limit);
  if (bad < n_tokens_) throw_bad_token(bad, load_token(data_, dtype_, bad), vocab_size);
}

// ---- manifest ------------------------------------------------------------------

std::vector<std::string> read_manifest(const std::string& manifest_path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(manifest_path, ec)) throw DataError("manifest " + manifest_path + ": not found");
  if (fs::is_directory(manifest_path, ec)) {
    throw DataError("manifest " + manifest_path + ": is a folder, expected a file listing token files");
  }
  std::ifstream in(manifest_path);
  if (!in) throw DataError("manifest " + manifest_path + ": cannot be read");
  const fs::path base = fs::path(manifest_path).parent_path();
  std::vector<std::string> files;
  std::string line;
  while (std::getline(in, line)) {
    const auto first = line.find_first_not_of(" \t\r\n");
    if (first == std::string::npos || line[first] == '#') continue;
    const auto last = line.find_last_not_of(" \t\r\n");
    std::string entry = line.substr(first, last - first + 1);
    // "PATH<TAB>BYTES": the size tokenize wrote, checked here (a shard cut short by a
    // full disk or a copy would otherwise train on what is left, silently).
    std::optional<uintmax_t> bytes;
    if (const auto tab = entry.rfind('\t'); tab != std::string::npos && tab + 1 < entry.size() &&
                                             entry.size() - tab - 1 <= 18 &&
                                             entry.find_first_not_of("0123456789", tab + 1) == std::string::npos) {
      bytes = std::stoull(entry.substr(tab + 1));
      entry.erase(entry.find_last_not_of(" \t", tab) + 1);
    }
    fs::path p(entry);
    if (p.is_relative()) p = base / p;
    p = p.lexically_normal();
    if (const uintmax_t size = fs::file_size(p, ec); bytes && !ec && size != *bytes)
      throw DataError("token file " + p.string() + ": " + std::to_string(size) + " bytes, but manifest " +
                      manifest_path + " lists " + std::to_string(*bytes) + " (cut short or replaced since)");
    files.push_back(p.string());
  }
  if (in.bad()) throw DataError("manifest " + manifest_path + ": read error");
  if (files.empty()) throw DataError("manifest " + manifest_path + ": lists no token files");
  return files;
}

// ---- TokenDataset --------------------------------------------------------------

TokenDataset::TokenDataset(const std::string& manifest_path, const DatasetOptions& options)
    : source_("manifest " + manifest_path), options_(options) {
  open(read_manifest(manifest_path));
}

TokenDataset::TokenDataset(const std::vector<std::string>& files, const DatasetOptions& options,
                           std::string source)
    : source_(std::move(source)), options_(options) {
  if (files.empty()) throw DataError(source_ + ": no token files");
  open(files);
}

void TokenDataset::open(const std::vector<std::string>& paths) {
  if (options_.seq_len < 1) {
    throw DataError(source_ + ": seq_len " + std::to_string(options_.seq_len) + " must be >= 1");
  }
  if (options_.vocab_size < 1 || options_.vocab_size > INT32_MAX) {
    // Token ids become int32 model inputs.
    throw DataError(source_ + ": vocab_size " + std::to_string(options_.vocab_size) + " must be in [1, 2^31)");
  }
  const uint64_t per = static_cast<uint64_t>(instance_tokens());
  files_.reserve(paths.size());
  first_instance_.assign(1, 0);
  for (const auto& path : paths) {
    TokenFile f(path, options_.dtype);
    if (f.n_tokens() < per) {
      throw DataError("token file " + path + ": " + std::to_string(f.n_tokens()) +
                      " tokens is shorter than one instance (seq_len+1 = " + std::to_string(per) +
                      " tokens)");
    }
    if (f.n_tokens() * token_width(f.dtype()) <= options_.scan_at_load_bytes) {
      f.validate(options_.vocab_size);
    }
    n_instances_ += f.n_tokens() / per;
    first_instance_.push_back(n_instances_);
    files_.push_back(std::move(f));
  }
}

TokenDataset::Location TokenDataset::locate(uint64_t instance) const {
  if (instance >= n_instances_) {
    throw DataError(source_ + ": instance " + std::to_string(instance) + " out of range (" +
                    std::to_string(n_instances_) + " instances)");
  }
  // first_instance_ is sorted; the file is the last one starting at or before `instance`.
  auto it = std::upper_bound(first_instance_.begin(), first_instance_.end(), instance);
  const size_t file = static_cast<size_t>(it - first_instance_.begin()) - 1;
  return {file, (instance - first_instance_[file]) * static_cast<uint64_t>(instance_tokens())};
}

void TokenDataset::read_instance(uint64_t instance, int32_t* out) const {
  const Location loc = locate(instance);
  files_[loc.file].read(loc.token_offset, static_cast<uint64_t>(instance_tokens()),
                        options_.vocab_size, out);
}

uint64_t TokenDataset::fingerprint() const {
  // FNV-1a over 64-bit words: stable across platforms and builds.
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  };
  mix(static_cast<uint64_t>(options_.dtype));
  mix(static_cast<uint64_t>(options_.seq_len));
  mix(files_.size());
  for (const auto& f : files_) mix(f.n_tokens());
  return h;
}

}  // namespace spes
