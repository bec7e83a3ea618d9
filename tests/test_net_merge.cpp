// Merge rules: the expert-merging warm-up against a direct, independent
// computation written here from its definition (README, Architecture: Sync round),
// and the streaming mean merge.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "engine/base/error.hpp"
#include "model/hf_export.hpp"
#include "model/layout.hpp"
#include "net/grid.hpp"
#include "net/codec.hpp"
#include "net/streaming_merge.hpp"
#include "model/expert_merge.hpp"
#include "engine/commands.hpp"
#include "net_test_util.hpp"

using namespace spes;
using namespace spes::net;

namespace {

ModelConfig small_model(int experts) {
  ModelConfig m = testing::tiny_config(1).model;
  m.n_experts = experts;
  m.expert_hidden = 24;
  m.d_model = 16;
  m.n_heads = 2;
  m.n_kv_heads = 2;
  return m;
}

std::vector<float> random_theta(const ParamLayout& L, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<float> t(size_t(L.total));
  for (auto& x : t) x = d(g);
  return t;
}

// The definition, written out directly: per layer, cosine similarity of flattened gate
// weights; donors = top-k others (k ≤ E−1) by similarity; every weight of e moves
// by α·mean over donors of (θ_j − θ_e), all from the pre-merge θ.
std::vector<float> reference_merge(const std::vector<float>& pre, const ParamLayout& L, const ModelConfig& m,
                                   double alpha, int topk, std::vector<std::vector<std::vector<int>>>* donors_out) {
  std::vector<float> out = pre;
  const int E = int(m.n_experts);
  const int64_t gate_n = m.expert_hidden * m.d_model;
  for (int l = 0; l < int(m.n_layers); ++l) {
    auto gate = [&](int e, int64_t i) { return double(pre[size_t(L.experts[l][e].gate + i)]); };
    std::vector<std::vector<int>> donors(E);
    for (int e = 0; e < E; ++e) {
      std::vector<std::pair<double, int>> sim;
      for (int j = 0; j < E; ++j) {
        if (j == e) continue;
        double dot = 0, ne = 0, nj = 0;
        for (int64_t i = 0; i < gate_n; ++i) dot += gate(e, i) * gate(j, i), ne += gate(e, i) * gate(e, i), nj += gate(j, i) * gate(j, i);
        sim.push_back({dot / (std::sqrt(ne) * std::sqrt(nj)), j});
      }
      std::sort(sim.begin(), sim.end(), [](auto a, auto b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
      const int k = std::min(topk, E - 1);
      for (int i = 0; i < k; ++i) donors[e].push_back(sim[i].second);
      std::sort(donors[e].begin(), donors[e].end());
      for (int64_t off : {L.experts[l][e].gate, L.experts[l][e].up, L.experts[l][e].down})
        for (int64_t i = 0; i < gate_n; ++i) {
          const int64_t rel = off - L.experts[l][e].gate;
          double s = 0;
          for (int j : donors[e]) s += double(pre[size_t(L.experts[l][j].gate + rel + i)]) - double(pre[size_t(off + i)]);
          out[size_t(off + i)] = float(double(pre[size_t(off + i)]) + alpha * (s / double(donors[e].size())));
        }
    }
    if (donors_out) donors_out->push_back(donors);
  }
  return out;
}

}  // namespace

TEST_CASE("merge: α schedule") {
  CHECK(merge_alpha_at(0.5, 100, 1000, 100) == doctest::Approx(0.45));
  CHECK(merge_alpha_at(0.5, 100, 1000, 150) == 0.0);   // not a merge step
  CHECK(merge_alpha_at(0.5, 100, 1000, 1000) == 0.0);  // decayed to 0
  CHECK(merge_alpha_at(0.5, 100, 1000, 2000) == 0.0);
  CHECK(merge_alpha_at(0.0, 100, 1000, 100) == 0.0);
  CHECK(merge_alpha_at(0.5, 0, 1000, 100) == 0.0);     // interval 0 = off
}

TEST_CASE("merge: warm-up equals the direct computation (donors, values)") {
  for (int E : {2, 4, 6}) {
    for (int topk : {1, 3, 8}) {
      CAPTURE(E);
      CAPTURE(topk);
      const ModelConfig m = small_model(E);
      const ParamLayout L = make_layout(m);
      auto theta = random_theta(L, uint64_t(E * 10 + topk));
      // Make experts 0 and 1 near-duplicates so similarity is not noise only.
      for (int l = 0; l < int(m.n_layers); ++l)
        for (int64_t i = 0; i < m.expert_hidden * m.d_model; ++i)
          theta[size_t(L.experts[l][1].gate + i)] = theta[size_t(L.experts[l][0].gate + i)] * 0.9f + 0.001f;
      std::vector<std::vector<std::vector<int>>> ref_donors;
      const auto expect = reference_merge(theta, L, m, 0.3, topk, &ref_donors);
      auto got = theta;
      merge_experts_flat(got.data(), L, 0.3, topk);
      double worst = 0;
      for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, double(std::fabs(got[i] - expect[i])));
      CHECK(worst == 0.0);  // same formula, same order: bit for bit
      for (int l = 0; l < int(m.n_layers); ++l) {
        std::vector<ExpertWeights<float>> xs;
        for (int e = 0; e < E; ++e) {
          ExpertWeights<float> x;
          x.gate = theta.data() + L.experts[l][e].gate;
          x.gate_n = m.expert_hidden * m.d_model;
          xs.push_back(x);
        }
        CHECK(merge_donors(xs, topk) == ref_donors[size_t(l)]);
      }
      if (E > 2) {
        for (int l = 0; l < int(m.n_layers); ++l) {
          CHECK(std::find(ref_donors[l][0].begin(), ref_donors[l][0].end(), 1) != ref_donors[l][0].end());
        }
      }
      // Shared params are never touched.
      CHECK(std::equal(got.begin(), got.begin() + L.shared_count, theta.begin()));
    }
  }
}

TEST_CASE("merge: α = 0 or a single expert leaves θ unchanged") {
  const ModelConfig m = small_model(4);
  const ParamLayout L = make_layout(m);
  const auto theta = random_theta(L, 9);
  auto a = theta;
  merge_experts_flat(a.data(), L, 0.0, 4);
  CHECK(a == theta);
  const ModelConfig m1 = small_model(1);
  const ParamLayout L1 = make_layout(m1);
  const auto t1 = random_theta(L1, 10);
  auto b = t1;
  merge_experts_flat(b.data(), L1, 0.5, 4);
  CHECK(b == t1);
}

namespace {
const uint8_t* bytes_of(const float* v) { return reinterpret_cast<const uint8_t*>(v); }

// A 4-expert model on a grid of 256-element chunks, its θ_old, and `nodes` random
// pushes (seeds seed0, seed0 + 1, ...) for the streaming-merge tests.
struct StreamingCase {
  ModelConfig m = small_model(4);
  ParamLayout L = make_layout(m);
  ChunkGrid g = make_grid(L, m.n_experts, 256);
  std::vector<float> theta = random_theta(L, 1);
  std::vector<std::vector<float>> v;
  StreamingCase(int nodes, uint64_t seed0) {
    for (int p = 0; p < nodes; ++p) v.push_back(random_theta(L, seed0 + uint64_t(p)));
  }
};
// close() as the coordinator calls it, with θ_old in a state file.
std::vector<bool> close_on(StreamingMerge& sm, const std::vector<float>& theta, const ParamLayout& L) {
  testing::RoundFiles files(theta, nullptr);
  return sm.close(*files.old, *files.next, L, 0.0, 4);
}
}  // namespace

TEST_CASE("merge: streaming fp32 mean: exact for one contributor, commutative for two, close for five") {
  const StreamingCase sc(5, 100);
  const auto& [m, L, g, theta, v] = sc;
  const int c_shared = 0, c_pair = 1, c_solo = int(g.chunks.size()) - 1, c_none = int(g.chunks.size()) - 2;
  auto run = [&](std::vector<int> order) {
    StreamingMerge sm(g, Codec::fp32, 2, 5);
    sm.begin_round();
    for (int p : order) sm.add(c_shared, bytes_of(v[p].data() + g.chunks[c_shared].begin));
    for (int p : {order[0] % 2, 1 - order[0] % 2}) sm.add(c_pair, bytes_of(v[p].data() + g.chunks[c_pair].begin));
    sm.add(c_solo, bytes_of(v[3].data() + g.chunks[c_solo].begin));
    const auto changed = close_on(sm, theta, L);
    CHECK(changed[c_shared]);
    CHECK(changed[c_solo]);
    CHECK_FALSE(changed[c_none]);
    return std::vector<float>(sm.target(), sm.target() + L.total);
  };
  const auto a = run({0, 1, 2, 3, 4});
  const auto b = run({4, 2, 0, 3, 1});
  const GridChunk& pr = g.chunks[c_pair];
  CHECK(std::equal(a.begin() + pr.begin, a.begin() + pr.end, b.begin() + pr.begin));  // a + b = b + a
  // Five possible contributors: the chunk sums in double, so the order does not matter
  // either, and the mean is within a few ulps of the exact one.
  const GridChunk& s = g.chunks[c_shared];
  CHECK(std::equal(a.begin() + s.begin, a.begin() + s.end, b.begin() + s.begin));
  double worst_ulps = 0;
  for (int64_t i = s.begin; i < s.end; ++i) {
    double sum = 0, mag = 0;
    for (int p = 0; p < 5; ++p) sum += double(v[p][i]), mag += std::fabs(double(v[p][i]));
    const double ulp = mag / 5 * std::ldexp(1.0, -23);  // rounding grows with the magnitudes added
    worst_ulps = std::max({worst_ulps, std::fabs(a[i] - sum / 5) / ulp, std::fabs(b[i] - sum / 5) / ulp});
  }
  MESSAGE("five-contributor mean: worst error " << worst_ulps << " ulps of the mean magnitude (bound 4)");
  CHECK(worst_ulps <= 4);
  const GridChunk& o = g.chunks[c_solo];
  CHECK(std::equal(a.begin() + o.begin, a.begin() + o.end, v[3].begin() + o.begin));  // bitwise its value
  // Lossy codecs accumulate deltas: θ_old + Δ for one contributor, θ_old + mean Δ for two.
  StreamingMerge sm(g, Codec::bf16, 1, 5);
  sm.begin_round();
  std::vector<uint8_t> half(size_t(s.size()) * 2, 0), quarter(size_t(s.size()) * 2, 0);
  for (int64_t i = 0; i < s.size(); ++i) half[size_t(2 * i + 1)] = 0x3F, quarter[size_t(2 * i + 1)] = 0x3E;  // 0.5, 0.125
  sm.add(c_shared, half.data());
  sm.add(c_pair, half.data());
  sm.add(c_pair, quarter.data());
  close_on(sm, theta, L);
  CHECK(sm.target()[5] == theta[5] + 0.5f);
  CHECK(sm.target()[pr.begin + 3] == theta[size_t(pr.begin + 3)] + (0.5f + 0.125f) / 2);
}

TEST_CASE("merge-experts: the command on an HF safetensors export equals the direct computation") {
  const ModelConfig m = small_model(5);
  const ParamLayout L = make_layout(m);
  const auto theta = random_theta(L, 77);
  const std::string dir = testing::temp_dir("merge-cli");
  write_hf_safetensors(dir + "/a.safetensors", L, theta.data());
  REQUIRE(merge_experts_command({"--in", dir + "/a.safetensors", "--out", dir + "/b.safetensors", "--alpha", "0.4",
                              "--topk", "2"}) == 0);
  const std::vector<float> got = read_hf_safetensors(dir + "/b.safetensors", L);
  const auto expect = reference_merge(theta, L, m, 0.4, 2, nullptr);
  CHECK(got == expect);
  CHECK_THROWS_WITH_AS(merge_experts_command({"--in", dir + "/a.safetensors", "--out", dir + "/c.safetensors"}),
                       doctest::Contains("--alpha"), Error);
  CHECK_THROWS_AS(merge_experts_command({"--in", dir + "/missing.safetensors", "--out", dir + "/c.safetensors",
                                      "--alpha", "0.1"}),
                  Error);
  // A NaN in one expert would spread to the merges it donates to: refused, naming the
  // tensor, and nothing written.
  auto bad = theta;
  const ParamTensor& gate = *L.find("model.layers.0.mlp.experts.1.gate_proj.weight");
  bad[size_t(gate.offset + 3)] = std::numeric_limits<float>::quiet_NaN();
  write_hf_safetensors(dir + "/nan.safetensors", L, bad.data());
  CHECK_THROWS_WITH_AS(merge_experts_command({"--in", dir + "/nan.safetensors", "--out", dir + "/d.safetensors",
                                              "--alpha", "0.4"}),
                       doctest::Contains("nan.safetensors: input tensor 'model.layers.0.mlp.experts.1.gate_proj.weight' "
                                         "element 3 is nan; nothing written"),
                       Error);
  CHECK_FALSE(std::filesystem::exists(dir + "/d.safetensors"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("merge: a withdrawn push leaves no trace: its own chunks as never pushed, shared ones voided") {
  const StreamingCase sc(3, 200);
  const auto& [m, L, g, theta, v] = sc;
  const int n = int(g.chunks.size());
  const int c_shared = 0, c_pair = 1, c_solo_bad = n - 1, c_solo_good = n - 2;
  std::vector<int> owners(size_t(n), 1);
  owners[c_shared] = 3, owners[c_pair] = 2;
  auto at = [&](int p, int c) { return bytes_of(v[size_t(p)].data() + g.chunks[size_t(c)].begin); };
  // Node 0 is refused after pushing its solo chunk and the shared one; nodes 1 and 2
  // push before and after the refusal.
  StreamingMerge sm(g, Codec::fp32, 1, owners);
  sm.begin_round();
  sm.add(c_shared, at(1, c_shared));
  sm.add(c_solo_bad, at(0, c_solo_bad));
  sm.add(c_shared, at(0, c_shared));
  sm.add(c_pair, at(0, c_pair));
  sm.withdraw({c_shared, c_pair, c_solo_bad});
  sm.add(c_shared, at(2, c_shared));  // ignored: the chunk is void this round
  sm.add(c_pair, at(1, c_pair));
  sm.add(c_solo_good, at(1, c_solo_good));
  const auto changed = close_on(sm, theta, L);
  CHECK_FALSE(changed[c_shared]);  // keep θ_old: nothing of node 0, at the price of nodes 1 and 2
  CHECK_FALSE(changed[c_pair]);
  CHECK_FALSE(changed[c_solo_bad]);
  REQUIRE(changed[c_solo_good]);
  const GridChunk& o = g.chunks[c_solo_good];
  CHECK(std::equal(sm.target() + o.begin, sm.target() + o.end, v[1].begin() + o.begin));
  // A solo chunk withdrawn and then pushed again (the same node, next round's
  // retry in a test) sums afresh: bitwise the value, nothing of the first push.
  // The next round takes the shared chunk again: begin_round cleared its void.
  sm.begin_round();
  sm.add(c_solo_bad, at(0, c_solo_bad));
  sm.withdraw({c_solo_bad});
  sm.add(c_solo_bad, at(2, c_solo_bad));
  sm.add(c_shared, at(1, c_shared));
  const auto changed2 = close_on(sm, theta, L);
  REQUIRE(changed2[c_solo_bad]);
  const GridChunk& b = g.chunks[c_solo_bad];
  CHECK(std::equal(sm.target() + b.begin, sm.target() + b.end, v[2].begin() + b.begin));
  CHECK(changed2[c_shared]);
}

TEST_CASE("grid: the chunks tile the model; an expert count that does not match the layout is refused") {
  const ModelConfig m = small_model(4);
  const ParamLayout L = make_layout(m);
  const ChunkGrid g = make_grid(L, m.n_experts, 256);
  int64_t at = 0;
  for (const GridChunk& c : g.chunks) CHECK(c.begin == std::exchange(at, c.end));
  CHECK(at == L.total);
  CHECK_THROWS_WITH_AS(make_grid(L, m.n_experts - 1, 256), doctest::Contains("n_experts 3 does not match"), NetError);
}
