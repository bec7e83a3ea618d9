// Text generation: the KV-cache decoder against the training forward (greedy tokens
// are the argmax of eval's logits at every position), sampling rules, and the
// command's reproducibility for a seed.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <random>
#include <sstream>

#include "engine/checkpoint.hpp"
#include "engine/trainer.hpp"
#include "model/cpu/cpu_decoder.hpp"
#include "model/cpu/cpu_model.hpp"
#include "model/token_sampling.hpp"
#include "test_util.hpp"

using namespace spes;

namespace {

std::string run_capture(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int rc = pclose(p);
  CHECK_MESSAGE(rc == 0, cmd);
  return out;
}

}  // namespace

TEST_CASE("generate: the KV-cache decoder's greedy tokens are the argmax of the training forward's logits") {
  auto dir = test::temp_dir("generate-greedy");
  Config c = test::small_config(dir, {"train.steps=20", "optim.decay_steps=20"});
  Trainer t(c);
  std::ostringstream csv;
  t.run(csv, false);
  const std::vector<float> params = t.params();
  const int64_t T = c.model.seq_len, V = c.model.vocab_size;

  // Greedy: feed token 3, then each argmax, until the context is full.
  CpuDecoder dec(c.model, t.layout(), params.data(), T);
  std::vector<int32_t> seq = {3};
  std::vector<std::vector<float>> dec_logits;
  SamplingOptions greedy;
  greedy.temperature = 0;
  std::mt19937_64 rng(1);
  while (int64_t(seq.size()) < T + 1) {
    const auto lg = dec.step(seq.back());
    dec_logits.emplace_back(lg.begin(), lg.end());
    seq.push_back(sample_token(lg, greedy, rng));
  }
  // The training forward over the same T tokens (inputs seq[0..T), targets seq[1..T]).
  CpuModel model(c.model, t.layout(), t.ownership(), 1, T);
  model.forward(params.data(), seq.data(), seq.data() + 1, c.train.loss);
  double worst = 0;
  for (int64_t i = 0; i < T; ++i) {
    const float* ref = model.logits() + i * V;
    int64_t best = 0;
    for (int64_t v = 0; v < V; ++v) {
      worst = std::max(worst, double(std::fabs(dec_logits[i][v] - ref[v])));
      if (ref[v] > ref[best]) best = v;
    }
    // The generated token is eval's argmax, or ties with it within float rounding.
    CHECK_MESSAGE(ref[seq[i + 1]] >= ref[best] - 1e-4f, "position " << i);
  }
  MESSAGE("decoder vs training forward: worst |logit difference| " << worst << " (tol 1e-3)");
  CHECK(worst < 1e-3);
}

TEST_CASE("generate: sampling rules") {
  std::mt19937_64 rng(5);
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f};
  SamplingOptions o;
  o.temperature = 0;
  CHECK(sample_token(logits, o, rng) == 1);  // ties go to the lower id
  o.temperature = 1.0;
  o.top_k = 1;
  CHECK(sample_token(logits, o, rng) == 1);
  o.top_k = 0;
  o.top_p = 1e-6;  // the nucleus is the single most likely token
  CHECK(sample_token(logits, o, rng) == 1);
  // Temperature 1, no cuts: frequencies follow softmax(logits).
  o.top_p = 1.0;
  std::vector<int> count(logits.size(), 0);
  const int draws = 200000;
  for (int i = 0; i < draws; ++i) ++count[size_t(sample_token(logits, o, rng))];
  double z = 0;
  for (float l : logits) z += std::exp(double(l));
  for (size_t v = 0; v < logits.size(); ++v) {
    const double p = std::exp(double(logits[v])) / z, f = double(count[v]) / draws;
    CHECK_MESSAGE(std::fabs(f - p) < 5 * std::sqrt(p * (1 - p) / draws) + 1e-4, "token " << v << ": " << f << " vs " << p);
  }
  // top_k = 2 keeps only ids 1 and 3 (the two largest), equally likely.
  o.top_k = 2;
  std::fill(count.begin(), count.end(), 0);
  for (int i = 0; i < 20000; ++i) ++count[size_t(sample_token(logits, o, rng))];
  CHECK(count[0] + count[2] + count[4] == 0);
  CHECK(std::abs(count[1] - count[3]) < 800);
}

TEST_CASE("generate: the command gives the same text for the same seed, another for another") {
  auto dir = test::temp_dir("generate-cmd");
  Config c = test::small_config(dir, {"train.steps=4", "model.vocab_size=256"});
  {
    Trainer t(c);
    std::ostringstream csv;
    t.run(csv, false);
  }
  const std::string base = std::string(SPES_ENGINE_BIN) + " generate --checkpoint " + c.checkpoint.dir +
                           " --prompt ab --max-tokens 12 --temperature 1.0 2>/dev/null";
  const std::string a = run_capture(base + " --seed 11"), b = run_capture(base + " --seed 11");
  const std::string other = run_capture(base + " --seed 12");
  CHECK(a == b);
  CHECK(a.rfind("ab", 0) == 0);  // the prompt comes first
  CHECK(a != other);
}
