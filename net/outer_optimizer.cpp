// The outer optimizer's step at round close (see outer_optimizer.hpp).
#include "net/outer_optimizer.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>

#include "engine/base/error.hpp"
#include "engine/base/parallel.hpp"

namespace spes::net {

OuterKind parse_outer_kind(const std::string& s) {
  if (s == "average") return OuterKind::average;
  if (s == "nesterov") return OuterKind::nesterov;
  throw NetError("unknown outer optimizer '" + s + "' (expected \"average\" or \"nesterov\")");
}

const char* outer_kind_name(OuterKind k) { return k == OuterKind::nesterov ? "nesterov" : "average"; }

namespace {

struct Stepped {
  float theta, m;
};

// One element: θ_old, the merged mean, the momentum before → θ_new, the momentum after.
Stepped step_one(const OuterOptimizer& o, float theta_old, double mean, float m) {
  const double g = mean - double(theta_old);
  if (o.kind == OuterKind::average) return {float(double(theta_old) + o.lr * g), m};
  const float m_new = float(o.momentum * double(m) + g);
  return {float(double(theta_old) + o.lr * (g + o.momentum * double(m_new))), m_new};
}

}  // namespace

int64_t outer_step(const OuterOptimizer& o, const ChunkGrid& grid, const std::vector<int>& contributors,
                   const float* theta, float* target, float* momentum) {
  if (o.identity()) return 0;
  if (o.has_momentum() && !momentum) throw NetError("internal: nesterov outer step without a momentum buffer");
  std::vector<int> chunks;
  for (size_t c = 0; c < grid.chunks.size(); ++c)
    if (contributors[c] > 0) chunks.push_back(int(c));
  static const float kZero = 0.0f;
  auto m_at = [&](int64_t i) -> const float& { return momentum ? momentum[i] : kZero; };
  // Chunk by chunk, all or nothing: a chunk whose step would not be finite keeps θ_old
  // and its momentum (a hostile push must not stop the coordinator; net/finite_guard).
  std::atomic<int64_t> skipped{0};
  parallel_for(int64_t(chunks.size()), [&](int64_t k) {
    const GridChunk& ch = grid.chunks[size_t(chunks[size_t(k)])];
    bool finite = true;
    for (int64_t i = ch.begin; i < ch.end && finite; ++i) {
      const Stepped s = step_one(o, theta[i], target[i], m_at(i));
      finite = std::isfinite(s.theta) && std::isfinite(s.m);
    }
    if (!finite) {
      std::copy(theta + ch.begin, theta + ch.end, target + ch.begin);
      ++skipped;
      return;
    }
    for (int64_t i = ch.begin; i < ch.end; ++i) {
      const Stepped s = step_one(o, theta[i], target[i], m_at(i));
      target[i] = s.theta;
      if (momentum) momentum[i] = s.m;
    }
  });
  return skipped.load();
}

}  // namespace spes::net
