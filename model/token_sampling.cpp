#include "model/token_sampling.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace spes {

namespace {

int32_t argmax(std::span<const float> x) {
  int64_t best = 0;
  for (int64_t i = 1; i < int64_t(x.size()); ++i)
    if (x[i] > x[best]) best = i;
  return int32_t(best);
}

// Uniform in [0, 1) from 53 bits: the same draw on every standard library
// (std::uniform_real_distribution is allowed to differ between implementations).
double uniform(std::mt19937_64& rng) { return double(rng() >> 11) * (1.0 / 9007199254740992.0); }

}  // namespace

int32_t sample_token(std::span<const float> logits, const SamplingOptions& o, std::mt19937_64& rng) {
  if (o.temperature <= 0) return argmax(logits);
  const int64_t V = int64_t(logits.size());
  // Candidates by descending logit (ties to the lower id), cut to the top k.
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  const int64_t k = o.top_k > 0 ? std::min(o.top_k, V) : V;
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), by_logit);
  ids.resize(size_t(k));
  std::vector<double> p(ids.size());
  const double top = logits[ids[0]];
  double sum = 0;
  for (size_t i = 0; i < ids.size(); ++i) sum += (p[i] = std::exp((double(logits[ids[i]]) - top) / o.temperature));
  // Nucleus: the shortest prefix whose mass reaches top_p (at least one token).
  size_t keep = ids.size();
  if (o.top_p < 1.0) {
    double mass = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      mass += p[i] / sum;
      if (mass >= o.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += p[i];
  double r = uniform(rng) * kept;
  for (size_t i = 0; i < keep; ++i) {
    r -= p[i];
    if (r < 0) return ids[i];
  }
  return ids[keep - 1];
}

}  // namespace spes
