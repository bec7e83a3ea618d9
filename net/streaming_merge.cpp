#include "net/streaming_merge.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "engine/base/parallel.hpp"
#include "model/expert_merge.hpp"

namespace spes::net {

StreamingMerge::StreamingMerge(const ChunkGrid& grid, Codec codec, int threads, const std::vector<int>& owners)
    : grid_(grid),
      codec_(codec),
      threads_(threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency()))),
      acc_(size_t(grid.total)),
      wide_at_(grid.chunks.size(), -1),
      count_(grid.chunks.size(), 0),
      owners_(owners),
      void_(grid.chunks.size(), 0) {
  int64_t wide = 0;
  int narrow_max = 1;
  for (size_t c = 0; c < grid.chunks.size(); ++c) {
    if (owners.at(c) >= 3) {
      wide_at_[c] = wide;
      wide += grid.chunks[c].size();
    } else {
      narrow_max = std::max(narrow_max, owners[c]);
    }
  }
  wide_.resize(size_t(wide));
  while (sum_scale_ * float(narrow_max) > 1.0f) sum_scale_ *= 0.5f;
}

StreamingMerge::StreamingMerge(const ChunkGrid& grid, Codec codec, int threads, int max_contributors)
    : StreamingMerge(grid, codec, threads, std::vector<int>(grid.chunks.size(), max_contributors)) {}

void StreamingMerge::begin_round() {
  std::fill(count_.begin(), count_.end(), 0);
  std::fill(void_.begin(), void_.end(), 0);
}

void StreamingMerge::add(int c, const uint8_t* payload, const float* decoded) {
  if (void_[size_t(c)]) return;
  const GridChunk& ch = grid_.chunks[size_t(c)];
  const bool first = count_[c]++ == 0;
  // Sparse payloads touch only their entries (a dense add of zeros could turn a -0
  // sum into +0): only dense codecs take the decoded values.
  Codec codec = codec_;
  if (decoded && codec_ != Codec::sparse) payload = reinterpret_cast<const uint8_t*>(decoded), codec = Codec::fp32;
  if (wide_at_[c] >= 0) accumulate(codec, payload, ch.size(), wide_.data() + wide_at_[c], first, threads_);
  else accumulate(codec, payload, ch.size(), acc_.data() + ch.begin, first, threads_, sum_scale_);
}

void StreamingMerge::withdraw(const std::vector<int>& chunks) {
  for (int c : chunks) {
    count_[size_t(c)] = 0;  // as if nothing arrived: a solo chunk's next add starts it afresh
    if (owners_.at(size_t(c)) > 1) void_[size_t(c)] = 1;  // others' adds to it are dropped this round
  }
}

std::vector<bool> StreamingMerge::close(const StateReader& old, StateWriter& next, const ParamLayout& layout,
                                        double merge_alpha, int64_t topk, const OuterOptimizer& outer) {
  std::vector<char> changed_c(grid_.chunks.size(), 0);  // char, not vector<bool>: written by many threads
  const bool merging = merge_alpha > 0 && layout.experts.size() > 0 && !layout.experts[0].empty() &&
                       layout.experts[0].size() > 1;
  const bool deltas = codec_is_lossy(codec_);
  const bool momentum = next.has(Section::momentum);
  std::atomic<int64_t> skipped{0};
  parallel_for(int64_t(grid_.chunks.size()), [&](int64_t c) {
    const GridChunk& ch = grid_.chunks[size_t(c)];
    float* a = acc_.data() + ch.begin;
    const int64_t n = ch.size();
    const bool contributed = count_[c] > 0;
    const bool fill = !contributed && merging && ch.segment > 0;
    const bool stepped = contributed && !outer.identity();
    // θ_old of this chunk, read only when needed (a plain fp32 mean does not); the
    // momentum, when the state has one, for every chunk (it is carried to `next`).
    thread_local std::vector<float> t, m;
    if ((contributed && (deltas || stepped)) || fill) {
      t.resize(size_t(n));
      old.read(Section::theta, ch.begin, n, t.data());
    }
    if (momentum) {
      m.resize(size_t(n));
      old.read(Section::momentum, ch.begin, n, m.data());
    }
    if (contributed) {
      if (wide_at_[c] >= 0) {  // the double sum: one rounding, to fp32
        const double* w = wide_.data() + wide_at_[c];
        const double k = double(count_[c]);
        for (int64_t i = 0; i < n; ++i) a[i] = deltas ? float(double(t[size_t(i)]) + w[i] / k) : float(w[i] / k);
      } else {  // the mean = (scaled sum / k) · 2^s: the same bits as sum / k
        const float k = float(count_[c]), unscale = 1.0f / sum_scale_;
        for (int64_t i = 0; i < n; ++i) {
          const float mean = (count_[c] > 1 ? a[i] / k : a[i]) * unscale;
          a[i] = deltas ? t[size_t(i)] + mean : mean;
        }
      }
      changed_c[c] = 1;
    } else if (fill) {
      std::memcpy(a, t.data(), size_t(n) * 4);
      changed_c[c] = 1;
    }
    if (stepped && !outer_step_chunk(outer, n, t.data(), a, momentum ? m.data() : nullptr)) ++skipped;
    if (momentum) next.write(Section::momentum, ch.begin, n, m.data());
  });
  outer_skipped_ = skipped.load();
  if (merging) merge_experts_flat(acc_.data(), layout, merge_alpha, topk);
  return std::vector<bool>(changed_c.begin(), changed_c.end());
}

}  // namespace spes::net
