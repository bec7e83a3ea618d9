// Small helpers for CPU tests: temp folders and synthetic token data.
#pragma once
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>
#include <unistd.h>

namespace spes::test {

// A fresh, empty folder under the system temp dir (removed at the next call with
// the same name, so failed runs can be inspected).
inline std::filesystem::path temp_dir(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() / ("spes-test-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
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

}  // namespace spes::test
