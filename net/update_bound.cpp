#include "net/update_bound.hpp"

#include <algorithm>
#include <cmath>

namespace spes::net {

double rms(const float* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(x[i]) * double(x[i]);
  return n > 0 ? std::sqrt(s / double(n)) : 0.0;
}

double rms_diff(const float* x, const float* base, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = double(x[i]) - double(base[i]);
    s += d * d;
  }
  return n > 0 ? std::sqrt(s / double(n)) : 0.0;
}

UpdateBound::UpdateBound(const ChunkGrid& grid, UpdateBoundRules rules) : rules_(rules) {
  rules_.rounds = std::max(1, rules_.rounds);
  int n_shared = 0, in_segment = 0, segment = -1;
  for (const GridChunk& ch : grid.chunks)
    if (ch.segment == 0) ++n_shared;
  int n_classes = n_shared;
  for (size_t c = 0; c < grid.chunks.size(); ++c) {
    const GridChunk& ch = grid.chunks[c];
    if (ch.segment == 0) {
      class_.push_back(int(c));  // shared chunks come first, one class each
      continue;
    }
    in_segment = ch.segment == segment ? in_segment + 1 : 0;
    segment = ch.segment;
    class_.push_back(n_shared + in_segment);
    n_classes = std::max(n_classes, n_shared + in_segment + 1);
  }
  hist_.assign(size_t(n_classes), std::vector<std::vector<float>>(size_t(rules_.rounds)));
  median_.assign(size_t(n_classes), -1.0);
}

double UpdateBound::bound(int c, double theta_rms) const {
  const double m = median_[size_t(class_[size_t(c)])];
  return m > 0 ? rules_.kappa * m : rules_.first * theta_rms;
}

void UpdateBound::accept(int node, int c, double size, double bound) {
  pending_.push_back({node, class_[size_t(c)], float(size), bound > 0 ? size / bound : 0.0});
}

void UpdateBound::withdraw(int node) {
  std::erase_if(pending_, [node](const Pending& p) { return p.node == node; });
}

void UpdateBound::close_round() {
  const size_t slot = size_t(closed_++ % rules_.rounds);
  for (auto& h : hist_) h[slot].clear();
  for (const Pending& p : pending_) {
    hist_[size_t(p.cls)][slot].push_back(p.size);
    max_ratio_ = std::max(max_ratio_, p.ratio);
  }
  pending_.clear();
  std::vector<float> all;
  for (size_t k = 0; k < hist_.size(); ++k) {
    all.clear();
    for (const auto& round : hist_[k]) all.insert(all.end(), round.begin(), round.end());
    if (all.empty()) continue;  // no history yet (or none in the window): keep the last median
    const auto mid = all.begin() + (all.size() - 1) / 2;  // the lower median
    std::nth_element(all.begin(), mid, all.end());
    median_[k] = *mid;
  }
}

}  // namespace spes::net
