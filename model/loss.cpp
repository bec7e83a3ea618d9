#include "model/loss.hpp"

#include <algorithm>
#include <cmath>

namespace spes {

double expert_load_cv(const std::vector<int64_t>& counts, int64_t n_layers, int64_t n_experts) {
  double sum_cv = 0;
  for (int64_t l = 0; l < n_layers; ++l) {
    double mean = 0, var = 0;
    for (int64_t e = 0; e < n_experts; ++e) mean += double(counts[l * n_experts + e]);
    mean /= double(n_experts);
    for (int64_t e = 0; e < n_experts; ++e) {
      const double d = double(counts[l * n_experts + e]) - mean;
      var += d * d;
    }
    var /= double(n_experts);
    sum_cv += mean > 0 ? std::sqrt(var) / mean : 0.0;
  }
  return sum_cv / double(n_layers);
}

float aux_loss_factor(const LossConfig& c, int64_t step, int64_t total_steps) {
  if (!c.decayed_aux_loss) return 1.0f;
  const double ramp = 0.2 * double(total_steps);
  const double frac = ramp > 0 ? std::min(double(step) / ramp, 1.0) : 1.0;
  return static_cast<float>(0.7 + 0.3 * frac);
}

}  // namespace spes
