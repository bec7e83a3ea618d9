#include "engine/base/finite.hpp"

#include <algorithm>
#include <bit>
#include <cmath>

namespace spes {

int64_t first_non_finite(const float* x, int64_t n) {
  // A float is non-finite when its exponent bits are all ones; OR-ing that test over a
  // block vectorises, and only a block that fails is searched element by element.
  constexpr int64_t kBlock = 4096;
  constexpr uint32_t kExponent = 0x7f800000u;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t end = std::min(n, b + kBlock);
    uint32_t any = 0;
    for (int64_t i = b; i < end; ++i) any |= uint32_t((std::bit_cast<uint32_t>(x[i]) & kExponent) == kExponent);
    if (any)
      for (int64_t i = b; i < end; ++i)
        if (!std::isfinite(x[i])) return i;
  }
  return -1;
}

std::string describe_non_finite(const float* x, int64_t n) {
  const int64_t i = first_non_finite(x, n);
  if (i < 0) return "";
  const char* what = std::isnan(x[i]) ? "nan" : x[i] > 0 ? "inf" : "-inf";
  return "element " + std::to_string(i) + " is " + what;
}

}  // namespace spes
