#include "model/expert_merge.hpp"

#include "engine/base/parallel.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace spes {

double merge_alpha_at(double alpha0, int64_t interval, int64_t decay_steps, int64_t step) {
  if (alpha0 <= 0 || interval <= 0 || step <= 0 || step % interval != 0) return 0.0;
  const double frac = decay_steps > 0 ? std::min(double(step) / double(decay_steps), 1.0) : 0.0;
  return alpha0 * (1.0 - frac);
}

namespace {
constexpr int64_t kTile = 256;  // positions per gather tile
}

template <class T>
std::vector<std::vector<int>> merge_donors(const std::vector<ExpertWeights<T>>& experts, int64_t topk) {
  const int E = int(experts.size());
  std::vector<std::vector<int>> donors(E);
  const int64_t k = std::min<int64_t>(topk, E - 1);
  if (k <= 0) return donors;
  const int64_t n = experts[0].gate_n;
  // Gram matrix of the gate weights, accumulated tile by tile in double.
  std::vector<double> gram(size_t(E) * E, 0.0), tile(size_t(E) * kTile);
  for (int64_t k0 = 0; k0 < n; k0 += kTile) {
    const int64_t m = std::min(kTile, n - k0);
    for (int e = 0; e < E; ++e)
      for (int64_t i = 0; i < m; ++i) tile[size_t(e) * kTile + i] = double(experts[e].gate[k0 + i]);
    for (int a = 0; a < E; ++a)
      for (int b = a; b < E; ++b) {
        const double* x = &tile[size_t(a) * kTile];
        const double* y = &tile[size_t(b) * kTile];
        double s = 0;
        for (int64_t i = 0; i < m; ++i) s += x[i] * y[i];
        gram[size_t(a) * E + b] += s;
      }
  }
  for (int e = 0; e < E; ++e) {
    std::vector<std::pair<double, int>> sims;
    for (int j = 0; j < E; ++j) {
      if (j == e) continue;
      const double dot = gram[size_t(std::min(e, j)) * E + std::max(e, j)];
      const double nn = std::sqrt(gram[size_t(e) * E + e]) * std::sqrt(gram[size_t(j) * E + j]);
      sims.push_back({nn > 0 ? dot / nn : 0.0, j});
    }
    std::stable_sort(sims.begin(), sims.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
    for (int64_t i = 0; i < k; ++i) donors[e].push_back(sims[i].second);
    std::sort(donors[e].begin(), donors[e].end());
  }
  return donors;
}

namespace {

// θ_e ← θ_e + α·mean_{j∈D(e)}(θ_j − θ_e) for one tensor kind (gate, up or down),
// position by position: every output reads only pre-merge values at its position.
template <class T>
void merge_tensor(const std::vector<T*>& w, int64_t n, const std::vector<std::vector<int>>& donors,
                  double alpha) {
  const int E = int(w.size());
  constexpr int64_t kTilesPerTask = 64;
  const int64_t tiles = (n + kTile - 1) / kTile;
  parallel_for((tiles + kTilesPerTask - 1) / kTilesPerTask, [&](int64_t task) {
  std::vector<double> in(size_t(E) * kTile);
  const int64_t k_end = std::min(n, (task + 1) * kTilesPerTask * kTile);
  for (int64_t k0 = task * kTilesPerTask * kTile; k0 < k_end; k0 += kTile) {
    const int64_t m = std::min(kTile, n - k0);
    for (int e = 0; e < E; ++e)
      for (int64_t i = 0; i < m; ++i) in[size_t(e) * kTile + i] = double(w[e][k0 + i]);
    for (int e = 0; e < E; ++e) {
      if (donors[e].empty()) continue;
      const double* self = &in[size_t(e) * kTile];
      const double k = double(donors[e].size());
      for (int64_t i = 0; i < m; ++i) {
        double s = 0;
        for (int j : donors[e]) s += in[size_t(j) * kTile + i] - self[i];
        w[e][k0 + i] = T(self[i] + alpha * (s / k));
      }
    }
  }
  });
}

}  // namespace

template <class T>
void merge_layer(const std::vector<ExpertWeights<T>>& experts, double alpha, int64_t topk) {
  if (experts.size() < 2 || alpha == 0.0) return;
  const auto donors = merge_donors(experts, topk);
  std::vector<T*> g, u, d;
  for (const auto& x : experts) g.push_back(x.gate), u.push_back(x.up), d.push_back(x.down);
  merge_tensor(g, experts[0].gate_n, donors, alpha);
  merge_tensor(u, experts[0].up_n, donors, alpha);
  merge_tensor(d, experts[0].down_n, donors, alpha);
}

template <class T>
void merge_experts_flat(T* params, const ParamLayout& layout, double alpha, int64_t topk) {
  for (const auto& layer : layout.experts) {
    std::vector<ExpertWeights<T>> xs;
    for (const auto& o : layer) {
      ExpertWeights<T> x;
      x.gate = params + o.gate, x.up = params + o.up, x.down = params + o.down;
      x.gate_n = o.up - o.gate;  // gate and up are [hidden, d_model], down [d_model, hidden]
      x.up_n = x.gate_n;
      x.down_n = x.gate_n;
      xs.push_back(x);
    }
    merge_layer(xs, alpha, topk);
  }
}

template std::vector<std::vector<int>> merge_donors(const std::vector<ExpertWeights<float>>&, int64_t);
template std::vector<std::vector<int>> merge_donors(const std::vector<ExpertWeights<double>>&, int64_t);
template void merge_layer(const std::vector<ExpertWeights<float>>&, double, int64_t);
template void merge_layer(const std::vector<ExpertWeights<double>>&, double, int64_t);
template void merge_experts_flat(float*, const ParamLayout&, double, int64_t);
template void merge_experts_flat(double*, const ParamLayout&, double, int64_t);

}  // namespace spes
