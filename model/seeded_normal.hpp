// Counter-based normal draws: the value for (key, index) depends on nothing else,
// so any node, the coordinator and any thread count draw the same numbers without
// sharing a generator's state. The seeded init (model/layout.hpp) and the
// upcycling noise (model/upcycle.hpp) both draw from here.
#pragma once
#include <cmath>
#include <cstdint>

namespace spes {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A stream of standard normals for element `index` of stream `key`: Box–Muller on
// splitmix64 states, one normal per next() (the sine half is not used, so a
// draw never depends on its neighbour).
class NormalDraws {
 public:
  NormalDraws(uint64_t key, uint64_t index) : state_(splitmix64(key ^ splitmix64(index))) {}
  double next() {
    state_ = splitmix64(state_);
    const double u1 = to_unit(state_);
    state_ = splitmix64(state_);
    const double u2 = to_unit(state_);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  // Uniform in (0, 1) from 53 random bits.
  static double to_unit(uint64_t bits) { return (double(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  uint64_t state_;
};

// N(0, 1) for (key, index).
inline double standard_normal(uint64_t key, uint64_t index) { return NormalDraws(key, index).next(); }

// N(0, 1) truncated to ±3 (redrawn, deterministically, until inside the cut).
inline float truncated_normal(uint64_t key, uint64_t index) {
  NormalDraws d(key, index);
  for (;;) {
    const double z = d.next();
    if (std::fabs(z) <= 3.0) return static_cast<float>(z);
  }
}

}  // namespace spes
