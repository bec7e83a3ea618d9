#include "net/finite_guard.hpp"

#include <cfloat>
#include <cmath>

namespace spes::net {

int64_t first_overflow(const float* theta_old, const float* delta, int64_t n) {
  // In double the sum is exact enough; the bound is the float range itself, so a
  // value that passes rounds to a finite float.
  for (int64_t i = 0; i < n; ++i)
    if (!(std::fabs(double(theta_old[i]) + double(delta[i])) <= double(FLT_MAX))) return i;
  return -1;
}

}  // namespace spes::net
