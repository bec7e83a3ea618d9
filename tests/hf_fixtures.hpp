// The Hugging Face fixtures of tests/oracles/hf/ (written by tests/oracles/hf_models.py):
// where they are and how their raw .bin arrays read back. Shared by the CPU import test
// and the GPU one; a GPU machine given only the check's bundle points SPES_HF_FIXTURES at
// its copy of the *_gpu fixtures (bench/gpu_check/bundle.sh).
#pragma once

#include <doctest/doctest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

namespace spes::testing {

inline std::filesystem::path hf_fixtures() {
  const char* dir = std::getenv("SPES_HF_FIXTURES");
  return dir && *dir ? std::filesystem::path(dir) : std::filesystem::path(SPES_SOURCE_DIR) / "tests" / "oracles" / "hf";
}

// A fixture's raw array (tokens.bin int32, logits.bin fp32), as the oracle wrote it.
template <class T>
std::vector<T> read_fixture_bin(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  REQUIRE_MESSAGE(f.good(), p.string() << " missing: run tests/oracles/hf_models.py write");
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<T> v(bytes.size() / sizeof(T));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(T));
  return v;
}

}  // namespace spes::testing
