// Small helpers for CPU tests: temp folders and synthetic token data.
#pragma once
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>
#include <signal.h>
#include <unistd.h>

#include "engine/config.hpp"

namespace spes::test {

// A fresh folder under the system temp dir, removed at scope exit.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag = "tmp") {
    static std::atomic<int> counter{0};
    path = std::filesystem::temp_directory_path() /
           ("spes_test_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string str() const { return path.string(); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

// A file's whole text ("" when it cannot be read, as a file a process has yet to write).
inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A TCP port for a server in another process, which must be given one up front:
// below Linux's ephemeral range (32768+), so no live client connection holds it.
inline int pick_port() {
  static std::mt19937 g(std::random_device{}());
  return 20000 + int(g() % 12000);
}

// A fresh, empty folder under the system temp dir, left in place so that a failed
// run can be inspected. Folders of the same name left by earlier test processes that
// have exited are removed here, so repeated runs keep at most one per name while a
// concurrent run's folders (its process still alive) are left alone.
inline std::filesystem::path temp_dir(const std::string& name) {
  namespace fs = std::filesystem;
  const std::string prefix = "spes-test-" + name + "-";
  std::error_code ec;
  for (fs::directory_iterator it(fs::temp_directory_path(), ec), end; !ec && it != end; it.increment(ec)) {
    const fs::directory_entry& e = *it;
    const std::string file = e.path().filename().string();
    if (file.size() <= prefix.size() || file.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string pid = file.substr(prefix.size());
    if (pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::error_code ignored;  // a folder that will not go is left; the scan goes on
    if (::kill(static_cast<pid_t>(std::stol(pid)), 0) != 0 && errno == ESRCH) fs::remove_all(e.path(), ignored);
  }
  auto p = fs::temp_directory_path() / (prefix + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// Writes `n` uint16 tokens of a learnable pattern (a noisy repeating sequence) and a
// manifest; returns the manifest path.
inline std::string write_token_data(const std::filesystem::path& dir, int64_t n, int vocab, uint32_t seed = 3) {
  std::filesystem::create_directories(dir);
  std::mt19937 g(seed);
  std::vector<uint16_t> tokens(n);
  for (int64_t i = 0; i < n; ++i)
    tokens[i] = uint16_t((g() % 8 == 0) ? g() % vocab : (i * 7 + (i / 5)) % vocab);
  const auto bin = dir / "tokens.bin";
  std::ofstream(bin, std::ios::binary).write(reinterpret_cast<const char*>(tokens.data()), n * 2);
  const auto manifest = dir / "train.manifest";
  std::ofstream(manifest) << bin.string() << "\n";
  return manifest.string();
}

// A config from `toml` (ending in its [data] table, without `train`) on n tokens of
// write_token_data() in dir, checkpoints in dir/ckpt; `sets` override.
inline Config config_on_tokens(const std::filesystem::path& dir, std::string toml, int64_t n, int vocab,
                               const std::string& name, const std::vector<std::string>& sets) {
  toml += "train = \"" + write_token_data(dir, n, vocab) + "\"\n[checkpoint]\ndir = \"" + (dir / "ckpt").string() + "\"\n";
  return parse_config_text(toml, name, sets);
}

// A config small enough for a training step in milliseconds (GQA, 4 experts top-2),
// on the CPU (the oracle; GPU tests build their own, tests/gpu_train_util.hpp).
inline Config small_config(const std::filesystem::path& dir, const std::vector<std::string>& sets = {}) {
  return config_on_tokens(dir, R"([model]
vocab_size = 64
d_model = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
n_experts = 4
top_k = 2
expert_hidden = 24
seq_len = 16
[train]
device = "cpu"
steps = 6
micro_batch = 2
global_batch = 4
threads = 1
[optim]
lr = 1e-2
warmup_steps = 2
decay_steps = 6
[data]
)",
                          20000, 64, "small.toml", sets);
}

}  // namespace spes::test
