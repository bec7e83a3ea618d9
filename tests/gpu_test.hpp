// Shared helpers for CUDA-vs-CPU tests: skip without a GPU, fresh random inputs,
// NaN poisoning, relative error ‖out − ref‖ / ‖ref‖.
#pragma once
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/device_probe.hpp"
#include "engine/base/error.hpp"

// A test case that needs a GPU: it belongs to the test suite "gpu", which main()
// (tests/main.cpp) excludes when there is no usable GPU, so doctest reports it as
// skipped. The GPU is probed in main(), never here: test cases are registered during
// static initialization, before the CUDA runtime has registered the kernels of the
// libraries linked after the test objects (device_probe.cu's probe_kernel among them:
// their fatbinary constructors run later), so a probe here would find "no code for
// this GPU" and skip every GPU test on a GPU; and the CUDA programming guide makes
// any CUDA call before main() undefined behaviour.
#define GPU_TEST_CASE(name) TEST_CASE(name * doctest::test_suite("gpu"))

namespace spes::test {

// Fresh seed per run: the kernels must compute the same function on any input.
inline std::mt19937_64& rng() {
  static std::mt19937_64 g{std::random_device{}()};
  return g;
}

inline std::vector<float> random_vector(int64_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng());
  return v;
}

inline double rel_error(const float* out, const float* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(out[i])) return INFINITY;  // NaN never passes (poison left behind)
    double d = double(out[i]) - ref[i];
    num += d * d;
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1e-30));
}

// Checks and prints "OK" or the mismatch, llm.c style.
#define CHECK_REL(name, out, ref, n, tol)                                                     \
  do {                                                                                      \
    double err_ = ::spes::test::rel_error((out), (ref), (n));                               \
    MESSAGE(name << ": rel err " << err_ << " (tol " << (tol) << ")");                      \
    CHECK_MESSAGE(err_ <= (tol), name << ": rel err " << err_ << " > tol " << (tol));         \
  } while (0)

// Every value finite and at most `bound` in magnitude (outputs that must be zero up
// to rounding, where a relative error has no scale).
#define CHECK_MAX_ABS(name, out, n, bound)                                                  \
  do {                                                                                      \
    double max_ = 0;                                                                        \
    for (int64_t i_ = 0; i_ < (n); ++i_)                                                    \
      max_ = std::isfinite((out)[i_]) ? std::max(max_, std::fabs(double((out)[i_]))) : INFINITY; \
    MESSAGE(name << ": max |value| " << max_ << " (bound " << (bound) << ")");             \
    CHECK_MESSAGE(max_ <= (bound), name << ": max |value| " << max_ << " > " << (bound));   \
  } while (0)

// `call` throws spes::Error whose message contains `text` (launcher argument checks).
#define CHECK_THROWS_ERROR(call, text) CHECK_THROWS_WITH_AS(call, doctest::Contains(text), spes::Error)

}  // namespace spes::test
