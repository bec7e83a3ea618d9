// The outer optimizer's step at round close (see outer_optimizer.hpp).
#include "net/outer_optimizer.hpp"

#include <algorithm>
#include <cmath>

#include "engine/base/error.hpp"

namespace spes::net {

const char* outer_kind_name(OuterKind k) { return name_of(kOuterKindNames, k); }

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

bool outer_step_chunk(const OuterOptimizer& o, int64_t n, const float* theta, float* target, float* momentum) {
  if (o.has_momentum() && !momentum) throw NetError("internal: nesterov outer step without a momentum buffer");
  static const float kZero = 0.0f;
  auto m_at = [&](int64_t i) -> const float& { return momentum ? momentum[i] : kZero; };
  // Checked before anything changes: a hostile push must not stop the coordinator
  // nor reach θ (net/finite_guard).
  for (int64_t i = 0; i < n; ++i) {
    const Stepped s = step_one(o, theta[i], target[i], m_at(i));
    if (!std::isfinite(s.theta) || !std::isfinite(s.m)) {
      std::copy(theta, theta + n, target);
      return false;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const Stepped s = step_one(o, theta[i], target[i], m_at(i));
    target[i] = s.theta;
    if (momentum) momentum[i] = s.m;
  }
  return true;
}

}  // namespace spes::net
