// Checkpoints: bitwise round trip, atomic replace, keep-K pruning, latest, and
// table-driven corruption (every way a file can be damaged gives one clear
// CheckpointError naming the file). Also the shared CRC32C.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine/base/checksum.hpp"
#include "engine/base/error.hpp"

#include "test_util.hpp"

namespace fs = std::filesystem;
using namespace spes;

namespace {

using test::TempDir;

// Random bit patterns, subnormals and signed zeros included: the round trip must
// preserve bits, not just values. Finite (an all-ones exponent loses its low bit):
// a checkpoint holds nothing else.
std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) {
    uint32_t bits = rng();
    if ((bits & 0x7f800000u) == 0x7f800000u) bits &= ~0x00800000u;
    std::memcpy(&x, &bits, 4);
  }
  return v;
}

CheckpointState sample_state(int64_t step) {
  CheckpointState s;
  s.config_toml = "[model]\nd_model = 16\n# step " + std::to_string(step) + "\n";
  s.fingerprint = 0xDEADBEEFCAFEF00DULL;
  s.node_id = 3;
  s.step = step;
  s.params = random_floats(1000, 1);
  s.master = random_floats(300, 2);
  s.adam_m = random_floats(300, 3);
  s.adam_v = random_floats(300, 4);
  s.data_state = {1, 2, 0xFFFFFFFFFFFFFFFFULL, 42};
  s.rng_state = {7, 8, 9};
  s.sync_base = random_floats(300, 5);
  s.sync_residual = {};
  s.sync_round = 17;
  return s;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

void check_equal(const CheckpointState& a, const CheckpointState& b) {
  CHECK(a.config_toml == b.config_toml);
  CHECK(a.fingerprint == b.fingerprint);
  CHECK(a.node_id == b.node_id);
  CHECK(a.step == b.step);
  CHECK(a.sync_round == b.sync_round);
  CHECK(same_bits(a.params, b.params));
  CHECK(same_bits(a.master, b.master));
  CHECK(same_bits(a.adam_m, b.adam_m));
  CHECK(same_bits(a.adam_v, b.adam_v));
  CHECK(same_bits(a.data_state, b.data_state));
  CHECK(same_bits(a.rng_state, b.rng_state));
  CHECK(same_bits(a.sync_base, b.sync_base));
  CHECK(same_bits(a.sync_residual, b.sync_residual));
}

std::vector<char> read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}
void write_bytes(const fs::path& p, const std::vector<char>& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(b.data(), static_cast<std::streamsize>(b.size()));
}

// Walks state.bin as the format documents it (engine/checkpoint.cpp): 24-byte
// header, then per section a 32-byte header (name, elem, crc, u64 length) and
// its payload, then a 16-byte trailer.
struct SectionAt {
  std::string name;
  size_t header, payload, bytes;
};
std::vector<SectionAt> walk_sections(const std::vector<char>& b) {
  std::vector<SectionAt> out;
  size_t pos = 24;
  uint32_t count;
  std::memcpy(&count, b.data() + 12, 4);
  for (uint32_t i = 0; i < count; ++i) {
    uint64_t len;
    std::memcpy(&len, b.data() + pos + 24, 8);
    out.push_back({std::string(b.data() + pos), pos, pos + 32, static_cast<size_t>(len)});
    pos += 32 + len;
  }
  return out;
}

std::string load_error(const std::string& path) {
  try {
    load_checkpoint(path);
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("crc32c: check value, chaining, hardware equals portable") {
  const char* check = "123456789";
  CHECK(crc32c(check, 9) == 0xE3069283u);
  CHECK(crc32c_portable(check, 9) == 0xE3069283u);
  CHECK(crc32c(nullptr, 0) == 0u);
  std::mt19937 rng(5);
  std::vector<unsigned char> buf(4099);
  for (auto& c : buf) c = static_cast<unsigned char>(rng());
  for (size_t off : {0, 1, 3, 7}) {
    for (size_t n : {0, 1, 7, 8, 9, 63, 64, 1000, 4090}) {
      CAPTURE(off);
      CAPTURE(n);
      CHECK(crc32c(buf.data() + off, n) == crc32c_portable(buf.data() + off, n));
      const size_t half = n / 3;
      CHECK(crc32c(buf.data() + off + half, n - half, crc32c(buf.data() + off, half)) ==
            crc32c(buf.data() + off, n));
    }
  }
}

TEST_CASE("checkpoint: round trip keeps every field bitwise") {
  TempDir dir;
  CheckpointState s = sample_state(100);
  const std::string folder = save_checkpoint(dir.str(), s, 3);
  CHECK(fs::path(folder).filename() == "step-00000100");
  CHECK(fs::is_regular_file(fs::path(folder) / "state.bin"));
  std::ifstream cfg(fs::path(folder) / "config.toml");
  CHECK(std::string(std::istreambuf_iterator<char>(cfg), {}) == s.config_toml);

  check_equal(load_checkpoint(folder), s);
  check_equal(load_checkpoint(dir.str()), s);                                   // a root: newest taken
  check_equal(load_checkpoint((fs::path(folder) / "state.bin").string()), s);  // the file itself

  SUBCASE("empty optional sections") {
    CheckpointState e;
    e.step = 0;
    check_equal(load_checkpoint(save_checkpoint(dir.str(), e, 3)), e);
  }
  SUBCASE("saving the same step again replaces it atomically") {
    CheckpointState s2 = sample_state(100);
    s2.params = random_floats(10, 99);
    s2.sync_round = 18;
    CHECK(save_checkpoint(dir.str(), s2, 3) == folder);
    check_equal(load_checkpoint(folder), s2);
    int entries = 0;
    for (const auto& e : fs::directory_iterator(dir.path)) entries += (void(e), 1);
    CHECK(entries == 1);  // no temp folder left behind
  }
}

TEST_CASE("checkpoint: a non-finite value is never saved, nor loaded from a file whose checksums hold") {
  TempDir dir;
  for (const char* section : {"params", "master", "adam_m", "adam_v", "sync_base", "sync_residual"}) {
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
      CAPTURE(section);
      CheckpointState s = sample_state(5);
      s.sync_residual = random_floats(300, 6);
      std::vector<float>& v = std::string(section) == "params"   ? s.params
                              : std::string(section) == "master" ? s.master
                              : std::string(section) == "adam_m" ? s.adam_m
                              : std::string(section) == "adam_v" ? s.adam_v
                              : std::string(section) == "sync_base" ? s.sync_base
                                                                    : s.sync_residual;
      v[123] = bad;
      const std::string expect = std::string(section) + " element 123 is " + (std::isnan(bad) ? "nan" : "-inf");
      CHECK_THROWS_WITH_AS(save_checkpoint(dir.str(), s, 0), doctest::Contains(expect.c_str()), CheckpointError);
      CHECK(latest_checkpoint(dir.str()).empty());  // nothing written, no temp folder taken for one
    }
  }
  // A file written by another build (or by hand) with a NaN and every checksum right:
  // refused on load, naming the section.
  const fs::path file = fs::path(save_checkpoint(dir.str(), sample_state(7), 0)) / "state.bin";
  std::vector<char> b = read_bytes(file);
  const auto sections = walk_sections(b);
  const SectionAt& params = sections[2];
  REQUIRE(params.name == "params");
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(b.data() + params.payload + 4 * 10, &nan, 4);
  const uint32_t crc = crc32c(b.data() + params.payload, params.bytes);
  std::memcpy(b.data() + params.header + 20, &crc, 4);
  uint32_t meta_crc = crc32c(b.data(), 24);
  for (const SectionAt& sec : sections) meta_crc = crc32c(b.data() + sec.header, 32, meta_crc);
  std::memcpy(b.data() + b.size() - 8, &meta_crc, 4);
  write_bytes(file, b);
  const std::string msg = load_error(dir.str());
  CHECK(msg.find(file.string()) != std::string::npos);
  CHECK(msg.find("params element 10 is nan") != std::string::npos);
}

TEST_CASE("checkpoint: keep-K pruning and latest_checkpoint") {
  TempDir dir;
  CHECK(latest_checkpoint(dir.str()) == "");
  CHECK(latest_checkpoint((dir.path / "missing").string()) == "");
  for (int64_t step : {10, 20, 30, 40, 50, 60}) save_checkpoint(dir.str(), sample_state(step), 3);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"step-00000040", "step-00000050", "step-00000060"});
  CHECK(fs::path(latest_checkpoint(dir.str())).filename() == "step-00000060");

  // A crash mid-save leaves a temp folder; an unrelated or incomplete folder may
  // sit there too. None of them is a checkpoint.
  fs::create_directories(dir.path / ".step-00000070.tmp");
  fs::copy_file(dir.path / "step-00000060" / "state.bin", dir.path / ".step-00000070.tmp" / "state.bin");
  fs::create_directories(dir.path / "step-00000080");  // no state.bin
  fs::create_directories(dir.path / "step-abc");
  { std::ofstream(dir.path / "step-00000090") << "a file, not a folder"; }
  CHECK(fs::path(latest_checkpoint(dir.str())).filename() == "step-00000060");
  CHECK(load_checkpoint(dir.str()).step == 60);

  // Step numbers sort numerically beyond 8 digits.
  save_checkpoint(dir.str(), sample_state(123456789), 0);
  CHECK(fs::path(latest_checkpoint(dir.str())).filename() == "step-123456789");

  // The folder just written survives pruning even when it is not the newest.
  save_checkpoint(dir.str(), sample_state(5), 1);
  CHECK(fs::exists(dir.path / "step-00000005"));
  CHECK(fs::exists(dir.path / "step-123456789"));
  CHECK_FALSE(fs::exists(dir.path / "step-00000060"));
}

TEST_CASE("checkpoint: damaged files give one clear error naming the file") {
  TempDir dir;
  const fs::path folder = save_checkpoint(dir.str(), sample_state(100), 3);
  const fs::path file = folder / "state.bin";
  const std::vector<char> good = read_bytes(file);
  const auto sections = walk_sections(good);
  REQUIRE(sections.size() == 10);
  REQUIRE(sections[2].name == "params");

  struct Case {
    std::string label;
    std::vector<char> bytes;
    std::string expect;  // substring of the message
  };
  std::vector<Case> cases;
  auto truncated = [&](size_t n) { return std::vector<char>(good.begin(), good.begin() + n); };
  cases.push_back({"empty file", {}, "empty file"});
  cases.push_back({"cut inside magic", truncated(5), "truncated"});
  cases.push_back({"cut inside header", truncated(20), "truncated"});
  cases.push_back({"cut after header", truncated(24), "truncated"});
  cases.push_back({"cut inside a section header", truncated(sections[1].header + 10), "truncated"});
  cases.push_back({"cut inside params", truncated(sections[2].payload + 100), "truncated"});
  cases.push_back({"cut inside trailer", truncated(good.size() - 3), "truncated"});
  cases.push_back({"trailer missing", truncated(good.size() - 16), "truncated"});
  {
    auto b = good;
    b.push_back('x');
    cases.push_back({"extra byte", b, "wrong size"});
  }
  {
    std::string text = "[model]\nd_model = 128\n this is a TOML file, not a checkpoint\n";
    cases.push_back({"foreign file", std::vector<char>(text.begin(), text.end()), "bad magic"});
  }
  {
    auto b = good;
    b[0] = 'X';
    cases.push_back({"wrong magic", b, "bad magic"});
  }
  {
    auto b = good;
    b[8] = 2;
    cases.push_back({"wrong version", b, "unsupported format version 2"});
  }
  {
    auto b = good;
    b[12] = 9;
    cases.push_back({"wrong section count", b, "has 9 sections"});
  }
  for (const auto& sec : sections) {
    if (sec.bytes > 0) {
      auto b = good;
      b[sec.payload + sec.bytes / 2] ^= 0x10;
      cases.push_back({"flip in payload of " + sec.name, b,
                       sec.name == "meta" ? "section 'meta' is corrupt" : "section '" + sec.name + "' is corrupt"});
    }
    {
      auto b = good;
      b[sec.header] ^= 0x01;  // the name
      cases.push_back({"flip in name of " + sec.name, b, "expected '" + sec.name + "'"});
    }
    {
      auto b = good;
      b[sec.header + 20] ^= 0x01;  // the stored CRC
      cases.push_back({"flip in CRC of " + sec.name, b, "section '" + sec.name + "' is corrupt"});
    }
    {
      auto b = good;
      b[sec.header + 24 + 6] ^= 0x40;  // length's high byte: a huge claim, refused before allocating
      cases.push_back({"huge length in " + sec.name, b, "claims"});
    }
  }
  {
    auto b = good;
    b[sections[4].header + 16] = 8;  // adam_m element size
    cases.push_back({"wrong element size", b, "element size 8"});
  }
  {
    auto b = good;
    b[good.size() - 10] ^= 0x01;
    cases.push_back({"flip in trailer magic", b, "bad trailer"});
  }
  {
    auto b = good;
    b[good.size() - 8] ^= 0x01;
    cases.push_back({"flip in trailer checksum", b, "header checksum mismatch"});
  }
  {
    auto b = good;
    b[16] ^= 0x01;  // declared file size
    cases.push_back({"flip in declared size", b, "bytes, file has"});
  }

  for (const auto& c : cases) {
    CAPTURE(c.label);
    write_bytes(file, c.bytes);
    const std::string msg = load_error(folder.string());
    CAPTURE(msg);
    CHECK(msg.find(file.string()) != std::string::npos);
    CHECK(msg.find(c.expect) != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
  }

  write_bytes(file, good);
  CHECK(load_checkpoint(folder.string()).step == 100);  // the table restored the good bytes last

  SUBCASE("missing folder and empty root") {
    const std::string missing = (dir.path / "nope").string();
    CHECK(load_error(missing).find(missing) != std::string::npos);
    fs::create_directories(dir.path / "empty_root");
    CHECK(load_error((dir.path / "empty_root").string()).find("empty_root") != std::string::npos);
  }
  SUBCASE("a state.bin moved into another step's folder") {
    fs::create_directories(dir.path / "step-00000200");
    fs::copy_file(file, dir.path / "step-00000200" / "state.bin");
    const std::string msg = load_error((dir.path / "step-00000200").string());
    CHECK(msg.find("named for step 200") != std::string::npos);
  }
}
