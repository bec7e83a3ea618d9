#include "net/node_overlap.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <cstring>

#include "engine/base/error.hpp"

namespace spes::net {

namespace {

// The stand-in of one element: θ_{k−1} + w·d + e·U_{k−1}.
struct Piece {
  Range flat;
  bool sole = false;  // owned by this node alone: untouched
  float w = 0, e = 0;
};

}  // namespace

struct EagerOverlap::Plan {
  std::vector<Piece> pieces;  // cover [0, total) in order
};

EagerOverlap::EagerOverlap(const OwnedSpace& space, std::vector<std::pair<Range, int>> owner_counts, int64_t total)
    : space_(space), counts_(std::move(owner_counts)), total_(total) {
  const char* m = std::getenv("SPES_OVERLAP_MODE");
  mode_ = m ? std::atoi(m) : 2;
  plan_ = std::make_unique<Plan>();
  auto count_at = [&](int64_t flat) {
    for (const auto& [r, c] : counts_)
      if (flat >= r.begin && flat < r.end) return c;
    return 1;
  };
  // Cut [0, total) at every owned-range and owner-count boundary.
  std::vector<int64_t> cuts = {0, total};
  for (const Range& r : space_.ranges()) cuts.push_back(r.begin), cuts.push_back(r.end);
  for (const auto& [r, c] : counts_) cuts.push_back(r.begin), cuts.push_back(r.end);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    Piece p;
    p.flat = {cuts[i], cuts[i + 1]};
    if (p.flat.begin >= total) break;
    const bool owned = space_.packed_index(p.flat.begin) >= 0;
    const int c = owned ? count_at(p.flat.begin) : 0;
    if (c < 0 || (owned && c == 0)) throw NetError("overlap: owner count " + std::to_string(c) + " for an owned range");
    p.sole = owned && (c == 1 || mode_ == 0);
    if (owned) {
      p.w = mode_ == 0 ? 1.0f : 1.0f / float(c);
      p.e = mode_ == 2 ? 1.0f - 1.0f / float(c) : 0.0f;
    } else {
      p.e = mode_ == 2 ? 1.0f : 0.0f;
    }
    plan_->pieces.push_back(p);
  }
}

EagerOverlap::~EagerOverlap() = default;

void EagerOverlap::start(float* params, const std::vector<float>& base) {
  previous_.assign(params, params + total_);
  space_.scatter(base.data(), previous_.data());  // θ_{k−1} over the owned ranges too
  standin_.resize(size_t(total_));
  const bool have_update = !update_.empty();
  for (const Piece& p : plan_->pieces) {
    for (int64_t i = p.flat.begin; i < p.flat.end; ++i) {
      const float prev = previous_[size_t(i)];
      float s = params[i];
      if (!p.sole) {
        const float u = have_update ? update_[size_t(i)] : 0.0f;
        // One fma, so that no compiler contraction changes the bits (the tests restate it).
        s = p.w == 0 && p.e * u == 0 ? prev : prev + std::fma(p.w, params[i] - prev, p.e * u);
      }
      standin_[size_t(i)] = s;
      params[i] = s;
    }
  }
}

void EagerOverlap::finish(float* params, const float* global, bool resynced) {
  if (resynced) {
    std::memcpy(params, global, size_t(total_) * 4);
    update_.clear();
    return;
  }
  update_.resize(size_t(total_));
  for (int64_t i = 0; i < total_; ++i) {
    const size_t k = size_t(i);
    const float x = params[i], s = standin_[k], g = global[i];
    // Exactness: an element at its stand-in becomes θ_k; one whose θ_k is its stand-in keeps its value.
    if (std::memcmp(&x, &s, 4) == 0) params[i] = g;
    else if (std::memcmp(&g, &s, 4) != 0) params[i] = g + (x - s);
    update_[k] = g - previous_[k];
  }
}

}  // namespace spes::net
