#include "net/streaming_merge.hpp"

#include <algorithm>
#include <cstring>
#include <thread>

#include "engine/base/parallel.hpp"
#include "model/expert_merge.hpp"

namespace spes::net {

StreamingMerge::StreamingMerge(const ChunkGrid& grid, Codec codec, int threads, int max_contributors)
    : grid_(grid),
      codec_(codec),
      threads_(threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency()))),
      acc_(size_t(grid.total)),
      count_(grid.chunks.size(), 0) {
  while (sum_scale_ * float(max_contributors) > 1.0f) sum_scale_ *= 0.5f;
}

void StreamingMerge::begin_round() { std::fill(count_.begin(), count_.end(), 0); }

void StreamingMerge::add(int c, const uint8_t* payload) {
  const GridChunk& ch = grid_.chunks[size_t(c)];
  accumulate(codec_, payload, ch.size(), acc_.data() + ch.begin, count_[c]++ == 0, threads_, sum_scale_);
}

std::vector<bool> StreamingMerge::close(const float* theta, const ParamLayout& layout, double merge_alpha,
                                        int64_t topk, const OuterOptimizer& outer, float* momentum) {
  std::vector<char> changed_c(grid_.chunks.size(), 0);  // char, not vector<bool>: written by many threads
  const bool merging = merge_alpha > 0 && layout.experts.size() > 0 && !layout.experts[0].empty() &&
                       layout.experts[0].size() > 1;
  const bool deltas = codec_is_lossy(codec_);
  parallel_for(int64_t(grid_.chunks.size()), [&](int64_t c) {
    const GridChunk& ch = grid_.chunks[size_t(c)];
    float* a = acc_.data() + ch.begin;
    const float* t = theta + ch.begin;
    const int64_t n = ch.size();
    if (count_[c] > 0) {
      // The mean = (scaled sum / k) · 2^s: the same bits as sum / k (see the header).
      const float k = float(count_[c]), unscale = 1.0f / sum_scale_;
      for (int64_t i = 0; i < n; ++i) {
        const float mean = (count_[c] > 1 ? a[i] / k : a[i]) * unscale;
        a[i] = deltas ? t[i] + mean : mean;
      }
      changed_c[c] = 1;
    } else if (merging && ch.segment > 0) {
      std::memcpy(a, t, size_t(n) * 4);
      changed_c[c] = 1;
    }
  });
  std::vector<bool> changed(changed_c.begin(), changed_c.end());
  outer_skipped_ = outer_step(outer, grid_, count_, theta, acc_.data(), momentum);
  if (merging) merge_experts_flat(acc_.data(), layout, merge_alpha, topk);
  return changed;
}

}  // namespace spes::net
