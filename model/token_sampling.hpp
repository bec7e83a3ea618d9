// Choosing the next token from logits (spes-engine generate): greedy at temperature
// 0, else softmax(logits / T) restricted to the top-k tokens and then to the
// smallest set whose probability reaches top-p (nucleus), sampled with a seeded
// generator — the same seed gives the same text on the same build.
#pragma once
#include <cstdint>
#include <random>
#include <span>

namespace spes {

struct SamplingOptions {
  double temperature = 0.8;  // 0 = greedy (argmax, ties to the lower id)
  int64_t top_k = 0;         // 0 = every token
  double top_p = 1.0;        // 1 = no nucleus cut
};

int32_t sample_token(std::span<const float> logits, const SamplingOptions& o, std::mt19937_64& rng);

}  // namespace spes
