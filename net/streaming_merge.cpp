#include "net/streaming_merge.hpp"

#include <algorithm>

#include "engine/base/parallel.hpp"
#include "model/expert_merge.hpp"

namespace spes::net {

StreamingMerge::StreamingMerge(const ChunkGrid& grid)
    : grid_(grid), acc_(size_t(grid.total)), count_(grid.chunks.size(), 0) {}

void StreamingMerge::begin_round() { std::fill(count_.begin(), count_.end(), 0); }

void StreamingMerge::add_values(int c, const float* v) {
  const GridChunk& ch = grid_.chunks[c];
  double* a = acc_.data() + ch.begin;
  const int64_t n = ch.size();
  if (count_[c]++ == 0)
    for (int64_t i = 0; i < n; ++i) a[i] = double(v[i]);
  else
    for (int64_t i = 0; i < n; ++i) a[i] += double(v[i]);
}

void StreamingMerge::add_delta(int c, const float* theta_old, const float* delta) {
  const GridChunk& ch = grid_.chunks[c];
  double* a = acc_.data() + ch.begin;
  const float* t = theta_old + ch.begin;
  const int64_t n = ch.size();
  if (count_[c]++ == 0)
    for (int64_t i = 0; i < n; ++i) a[i] = double(t[i]) + double(delta[i]);
  else
    for (int64_t i = 0; i < n; ++i) a[i] += double(t[i]) + double(delta[i]);
}

std::vector<bool> StreamingMerge::close(const float* theta, const ParamLayout& layout, double merge_alpha,
                                        int64_t topk, const OuterOptimizer& outer, float* momentum) {
  std::vector<char> changed_c(grid_.chunks.size(), 0);  // char, not vector<bool>: written by many threads
  const bool merging = merge_alpha > 0 && layout.experts.size() > 0 && !layout.experts[0].empty() &&
                       layout.experts[0].size() > 1;
  parallel_for(int64_t(grid_.chunks.size()), [&](int64_t c) {
    const GridChunk& ch = grid_.chunks[c];
    double* a = acc_.data() + ch.begin;
    const int64_t n = ch.size();
    if (count_[c] > 0) {
      // The mean, rounded to fp32 once (one contributor: its value, already exact).
      const double k = double(count_[c]);
      if (count_[c] > 1)
        for (int64_t i = 0; i < n; ++i) a[i] = double(float(a[i] / k));
      changed_c[c] = 1;
    } else if (merging && ch.segment > 0) {
      for (int64_t i = 0; i < n; ++i) a[i] = double(theta[ch.begin + i]);
      changed_c[c] = 1;
    }
  });
  std::vector<bool> changed(changed_c.begin(), changed_c.end());
  outer_step(outer, grid_, count_, theta, acc_.data(), momentum);
  if (merging) merge_experts_flat(acc_.data(), layout, merge_alpha, topk);
  return changed;
}

}  // namespace spes::net
