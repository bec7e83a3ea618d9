#include "model/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "engine/base/atomic_file.hpp"
#include "engine/base/error.hpp"

namespace spes {

static_assert(std::endian::native == std::endian::little, "safetensors is little-endian");

namespace {

// The reference implementation refuses headers above 100 MB; so do we, before
// reading one.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

[[noreturn]] void fail_at(const std::string& path, const std::string& what) {
  throw CheckpointError("safetensors " + path + ": " + what);
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Product of dims, or -1 on a negative dim or overflow past `limit`.
int64_t checked_numel(const std::vector<int64_t>& shape, int64_t limit) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > limit / d) {
      // Still fine if another dim is 0; otherwise too big.
      if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
      return -1;
    }
    n *= d;
  }
  return n;
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;  // signed zero
  } else {
    // Subnormal half: normalise.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3FFu) << 13);
  }
  return std::bit_cast<float>(bits);
}

}  // namespace

uint16_t float_to_bf16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

float bf16_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

size_t safetensors_dtype_size(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2},
      {"F16", 2},  {"BF16", 2}, {"I32", 4}, {"U32", 4},     {"F32", 4},     {"F64", 8}, {"I64", 8},
      {"U64", 8},
  };
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

const SafeTensor* SafeTensorsFile::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

// ---- writing -----------------------------------------------------------------

void write_safetensors(const std::string& path, std::span<const SafeTensorView> tensors,
                       const std::map<std::string, std::string>& metadata) {
  // Largest elements first keeps every tensor aligned to its element size.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return safetensors_dtype_size(tensors[a].dtype) > safetensors_dtype_size(tensors[b].dtype);
  });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = meta;
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (size_t i : order) {
    const SafeTensorView& t = tensors[i];
    if (t.dtype != "F32" && t.dtype != "BF16")
      fail_at(path, "cannot write tensor '" + t.name + "' as " + t.dtype + " (F32 or BF16 only)");
    if (t.name.empty() || t.name == "__metadata__") fail_at(path, "invalid tensor name '" + t.name + "'");
    if (!names.insert(t.name).second) fail_at(path, "duplicate tensor name '" + t.name + "'");
    const int64_t numel = checked_numel(t.shape, std::numeric_limits<int64_t>::max() / 8);
    if (numel < 0) fail_at(path, "tensor '" + t.name + "' has invalid shape " + shape_str(t.shape));
    if (numel > 0 && t.data == nullptr) fail_at(path, "tensor '" + t.name + "' has no data");
    const uint64_t bytes = static_cast<uint64_t>(numel) * safetensors_dtype_size(t.dtype);
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string json = header.dump();
  json.append((8 - (8 + json.size()) % 8) % 8, ' ');  // data starts 8-byte aligned

  write_file_atomic(path, [&](FileWriter& w) {
    const uint64_t n = json.size();
    w.write(&n, 8);
    w.write(json);
    std::vector<uint16_t> buf;
    for (size_t i : order) {
      const SafeTensorView& t = tensors[i];
      const size_t numel = static_cast<size_t>(checked_numel(t.shape, std::numeric_limits<int64_t>::max() / 8));
      if (t.dtype == "F32") {
        w.write(t.data, numel * sizeof(float));
        continue;
      }
      constexpr size_t kChunk = size_t{1} << 20;  // convert in chunks: bounded extra memory
      buf.resize(std::min(numel, kChunk));
      for (size_t at = 0; at < numel; at += kChunk) {
        const size_t n_here = std::min(kChunk, numel - at);
        for (size_t j = 0; j < n_here; ++j) buf[j] = float_to_bf16(t.data[at + j]);
        w.write(buf.data(), n_here * sizeof(uint16_t));
      }
    }
  });
}

void write_safetensors(const std::string& path, const std::vector<SafeTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafeTensorView> views;
  views.reserve(tensors.size());
  for (const auto& t : tensors) {
    const int64_t numel = checked_numel(t.shape, std::numeric_limits<int64_t>::max() / 8);
    if (numel < 0 || static_cast<uint64_t>(numel) != t.data.size())
      fail_at(path, "tensor '" + t.name + "' has shape " + shape_str(t.shape) + " but " +
                        std::to_string(t.data.size()) + " values");
    views.push_back({t.name, t.dtype, t.shape, t.data.data()});
  }
  write_safetensors(path, std::span<const SafeTensorView>(views), metadata);
}

// ---- reading -----------------------------------------------------------------

void SafeTensorsReader::fail(const std::string& what) const { fail_at(path_, what); }

SafeTensorsReader::SafeTensorsReader(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(std::string("cannot open: ") + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    fail(std::string("cannot stat: ") + std::strerror(err));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail("truncated: " + std::to_string(size) + " bytes, less than the 8-byte header length");
  }
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);
  if (m == MAP_FAILED) fail(std::string("cannot map: ") + std::strerror(err));
  map_ = static_cast<const unsigned char*>(m);
  map_bytes_ = size;
  try {
    uint64_t n;
    std::memcpy(&n, map_, 8);
    if (n > kMaxHeaderBytes)
      fail("header length " + std::to_string(n) + " exceeds the 100 MB limit (not a safetensors file?)");
    if (n > size - 8)
      fail("header length " + std::to_string(n) + " runs past the end of the " + std::to_string(size) +
           "-byte file");
    if (n == 0 || map_[8] != '{') fail("header does not start with '{' (not a safetensors file?)");
    data_ = map_ + 8 + n;
    const uint64_t data_bytes = size - 8 - n;

    // Duplicate names are disallowed by the format, but a JSON object silently
    // keeps the last one: catch them while parsing.
    std::string duplicate;
    std::set<std::string> seen;
    nlohmann::json::parser_callback_t cb = [&](int depth, nlohmann::json::parse_event_t event,
                                               nlohmann::json& parsed) {
      if (event == nlohmann::json::parse_event_t::key && depth == 1 && parsed.is_string()) {
        if (!seen.insert(parsed.get<std::string>()).second && duplicate.empty()) duplicate = parsed.get<std::string>();
      }
      return true;
    };
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(map_ + 8, map_ + 8 + n, cb);
    } catch (const nlohmann::json::exception& e) {
      std::string why = e.what();
      if (auto p = why.find("] "); p != std::string::npos) why = why.substr(p + 2);
      fail("header is not valid JSON: " + why);
    }
    if (!duplicate.empty()) fail("duplicate tensor name '" + duplicate + "' in header");
    if (!header.is_object()) fail("header is not a JSON object");

    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string& name = it.key();
      const nlohmann::json& v = it.value();
      if (name == "__metadata__") {
        if (!v.is_object()) fail("__metadata__ is not an object");
        for (auto m2 = v.begin(); m2 != v.end(); ++m2) {
          if (!m2.value().is_string()) fail("__metadata__ value of '" + m2.key() + "' is not a string");
          metadata_[m2.key()] = m2.value().get<std::string>();
        }
        continue;
      }
      const std::string where = "tensor '" + name + "'";
      if (!v.is_object()) fail(where + " is not a JSON object");
      for (auto k = v.begin(); k != v.end(); ++k)
        if (k.key() != "dtype" && k.key() != "shape" && k.key() != "data_offsets")
          fail(where + " has unknown field '" + k.key() + "'");
      if (!v.contains("dtype") || !v["dtype"].is_string()) fail(where + " has no string dtype");
      if (!v.contains("shape") || !v["shape"].is_array()) fail(where + " has no shape array");
      if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
        fail(where + " has no [begin, end] data_offsets");
      Entry e;
      e.name = name;
      e.dtype = v["dtype"].get<std::string>();
      const size_t elem = safetensors_dtype_size(e.dtype);
      if (elem == 0) fail(where + " has unknown dtype '" + e.dtype + "'");
      for (const auto& d : v["shape"]) {
        if (!d.is_number_integer() || d.get<int64_t>() < 0) fail(where + " has a shape entry that is not a size");
        e.shape.push_back(d.get<int64_t>());
      }
      for (const auto& o : v["data_offsets"])
        if (!o.is_number_unsigned()) fail(where + " has a data offset that is not a non-negative integer");
      e.begin = v["data_offsets"][0].get<uint64_t>();
      e.end = v["data_offsets"][1].get<uint64_t>();
      if (e.begin > e.end || e.end > data_bytes)
        fail(where + " data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
             "] out of bounds of the " + std::to_string(data_bytes) + "-byte data buffer");
      e.numel = checked_numel(e.shape, static_cast<int64_t>(data_bytes));
      if (e.numel < 0 || static_cast<uint64_t>(e.numel) * elem != e.end - e.begin)
        fail(where + " is " + e.dtype + " " + shape_str(e.shape) + " but spans " + std::to_string(e.end - e.begin) +
             " bytes");
      entries_.push_back(std::move(e));
    }
    std::sort(entries_.begin(), entries_.end(), [](const Entry& a, const Entry& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    // The format wants the buffer indexed entirely: no overlaps, no holes.
    uint64_t at = 0;
    for (const auto& e : entries_) {
      if (e.begin < at) fail("tensor '" + e.name + "' overlaps the tensor before it");
      if (e.begin > at) fail("hole in the data buffer before tensor '" + e.name + "'");
      at = e.end;
    }
    if (at != data_bytes)
      fail(std::to_string(data_bytes - at) + " bytes at the end of the data buffer belong to no tensor");
    for (size_t i = 0; i < entries_.size(); ++i) index_[entries_[i].name] = i;
  } catch (...) {
    ::munmap(const_cast<unsigned char*>(map_), map_bytes_);
    map_ = nullptr;
    throw;
  }
}

SafeTensorsReader::~SafeTensorsReader() {
  if (map_) ::munmap(const_cast<unsigned char*>(map_), map_bytes_);
}

const SafeTensorsReader::Entry* SafeTensorsReader::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

void SafeTensorsReader::read(const Entry& e, float* dst) const {
  const unsigned char* src = data_ + e.begin;
  const size_t n = static_cast<size_t>(e.numel);
  if (e.dtype == "F32") {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (e.dtype == "BF16" || e.dtype == "F16") {
    const bool bf = e.dtype == "BF16";
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      dst[i] = bf ? bf16_to_float(h) : f16_to_float(h);
    }
  } else {
    fail("tensor '" + e.name + "' has dtype " + e.dtype + "; only F32, BF16 and F16 convert to fp32");
  }
}

std::vector<float> SafeTensorsReader::read(const Entry& e) const {
  std::vector<float> out(static_cast<size_t>(e.numel));
  read(e, out.data());
  return out;
}

SafeTensorsFile read_safetensors(const std::string& path) {
  SafeTensorsReader r(path);
  SafeTensorsFile f;
  f.metadata = r.metadata();
  f.tensors.reserve(r.entries().size());
  for (const auto& e : r.entries()) f.tensors.push_back({e.name, e.dtype, e.shape, r.read(e)});
  return f;
}

}  // namespace spes
