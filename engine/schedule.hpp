// Learning-rate schedule: linear warmup, then cosine decay to lr·lr_floor at
// decay_steps, flat after (OLMo's CosWithWarmup with alpha_f = lr_floor).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "engine/config.hpp"

namespace spes {

// Learning rate for optimizer step `step` (0-based: the first update is step 0).
inline double lr_at(const OptimConfig& o, int64_t step) {
  if (step < o.warmup_steps) return o.lr * double(step + 1) / double(o.warmup_steps);
  const double floor = o.lr * o.lr_floor;
  const int64_t span = std::max<int64_t>(o.decay_steps - o.warmup_steps, 1);
  const double progress = std::min(double(step - o.warmup_steps) / double(span), 1.0);
  return floor + (o.lr - floor) * 0.5 * (1.0 + std::cos(3.141592653589793 * progress));
}

}  // namespace spes
