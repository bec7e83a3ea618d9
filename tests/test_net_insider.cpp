// A hostile insider (issue 33): a node with valid credentials pushes, into its own
// experts or into the shared block, (a) one round of huge finite deltas, (b) a
// delta doubling every round, (c) a sign-flipped delta scaled 100×. Each is refused
// by the update bound (net/update_bound), naming the node; θ stays bounded; the
// honest nodes agree on every round's hash and their loss keeps falling. Honest
// runs record no refusal.
//
// The nodes' "training" is a synthetic Adam-like descent on a quadratic: each step
// moves every owned parameter by about lr (a normalised gradient with noise) towards
// a target, lr warmed up and decayed like the trainer's schedule, so update sizes
// move over rounds as real ones do. Loss: mean squared distance to the target over
// the node's owned parameters.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>

#include "net/finite_guard.hpp"
#include "net/grid.hpp"
#include "net/update_bound.hpp"
#include "net_test_util.hpp"

using namespace spes;
using namespace spes::net;
using namespace spes::net::testing;

namespace {

constexpr double kLr = 3e-3;
constexpr int64_t kWarmup = 20, kDecaySteps = 5000;

float target_of(int64_t i) { return 0.5f * noise(4242, 0, uint64_t(i)); }

double lr_at(int64_t step) {
  const double warm = std::min(1.0, double(step + 1) / double(kWarmup));
  const double decay = 1.0 - 0.9 * std::min(1.0, double(step) / double(kDecaySteps));
  return kLr * warm * decay;
}

// sync_steps (5) steps of the synthetic descent over the node's owned parameters.
void descend(TestNode& n) {
  for (int64_t s = 0; s < n.cfg.spes.sync_steps; ++s, ++n.step) {
    const double lr = lr_at(n.step);
    for (const Range& r : n.own.space.ranges())
      for (int64_t i = r.begin; i < r.end; ++i) {
        const double g = double(n.params[size_t(i)]) - target_of(i) + 0.02 * noise(n.own.node_id, uint64_t(n.step), uint64_t(i));
        n.params[size_t(i)] -= float(lr * g / (std::fabs(g) + 0.01));
      }
  }
}

double loss_of(const TestNode& n) {
  double s = 0;
  int64_t k = 0;
  for (const Range& r : n.own.space.ranges())
    for (int64_t i = r.begin; i < r.end; ++i, ++k) {
      const double d = double(n.params[size_t(i)]) - target_of(i);
      s += d * d;
    }
  return s / double(k);
}

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float v : x) m = std::max(m, double(std::fabs(v)));
  return m;
}

enum class Attack { huge, escalating, flipped };
enum class Target { experts, shared };
const char* attack_name(Attack a) {
  return a == Attack::huge ? "huge" : a == Attack::escalating ? "escalating ×2/round" : "sign-flipped ×100";
}

// The ranges a hostile node 0 poisons: its own expert block(s), or the shared block.
std::vector<Range> poisoned_ranges(const TestNode& n, Target t) {
  std::vector<Range> out;
  for (const Range& r : n.own.space.ranges()) {
    if (t == Target::shared && r.begin < n.layout.shared_count) out.push_back({r.begin, n.layout.shared_count});
    if (t == Target::experts && r.end > n.layout.shared_count)
      out.push_back({std::max(r.begin, n.layout.shared_count), r.end});
  }
  return out;
}

// Node 0 trains, then turns its update Δ over `ranges` into the attack's (round k
// of the attack, from 1).
void hostile_descend(TestNode& n, Attack a, const std::vector<Range>& ranges, int k) {
  const std::vector<float> before = n.params;  // θ of the last round
  const Codec c = n.cfg.spes.codec;
  const float huge = c == Codec::sparse ? 5.0e36f : c == Codec::int8 ? 1.0e38f : 3.0e38f;
  descend(n);
  for (const Range& r : ranges)
    for (int64_t i = r.begin; i < r.end; ++i) {
      const float d = n.params[size_t(i)] - before[size_t(i)];
      float& x = n.params[size_t(i)];
      // The largest each codec carries: bf16 0x7F7F ≈ 3.39e38; int8 127 × a block scale near 1e36; the sparse
      // codec's scales stop at 1e36 (7 × 1e36)
      if (a == Attack::huge) x = before[size_t(i)] + huge;
      if (a == Attack::escalating) x = before[size_t(i)] + d * std::ldexp(1.0f, k);
      if (a == Attack::flipped) x = before[size_t(i)] - 100.0f * d;
    }
}

struct AttackResult {
  int refused_round = 0;
  double loss_before = 0, loss_after = 0;  // the honest nodes' mean, the round before the attack and at the end
};

constexpr int kAttackFrom = 4;  // rounds 1..3 are honest: the bound has a history

// Three nodes, node 0 hostile from round kAttackFrom; after its refusal node 0 is
// replaced by an honest process (it resyncs from a snapshot) and the run goes on.
AttackResult run_attack(Codec codec, Attack attack, Target target) {
  Config cfg = tiny_config(3, codec);
  cfg.spes.round_timeout_s = 1;  // the refused round closes without node 0
  CoordinatorOptions opt;
  opt.log = std::getenv("SPES_NET_TEST_LOG") != nullptr;
  CoordThread co(cfg, opt);
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 3; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  const std::vector<Range> ranges = poisoned_ranges(*nodes[0], target);
  REQUIRE(!ranges.empty());
  AttackResult res;
  bool hostile = true;
  std::vector<double> honest_loss;
  for (int r = 1; r <= 20; ++r) {
    std::vector<RoundReport> st(3);
    std::vector<std::string> err(3);
    std::vector<std::thread> ts;
    for (int p = 0; p < 3; ++p)
      ts.emplace_back([&, p] {
        try {
          if (p == 0 && hostile && r >= kAttackFrom) hostile_descend(*nodes[0], attack, ranges, r - kAttackFrom + 1);
          else descend(*nodes[size_t(p)]);
          st[size_t(p)] = nodes[size_t(p)]->sync();
        } catch (const std::exception& e) {
          err[size_t(p)] = e.what();
        }
      });
    for (auto& t : ts) t.join();
    const std::string honest_errors = err[1] + err[2];
    REQUIRE_MESSAGE(honest_errors.empty(), honest_errors);
    REQUIRE(st[1].round == r);
    CHECK(st[1].state_hash == st[2].state_hash);
    CHECK(st[1].state_hash == co.c->stats().state_hash);
    CHECK(max_abs(nodes[1]->params) < 2.0);  // θ as the coordinator holds it (hash-checked): bounded
    honest_loss.push_back((loss_of(*nodes[1]) + loss_of(*nodes[2])) / 2);
    if (r == kAttackFrom - 1) res.loss_before = honest_loss.back();
    if (!err[0].empty()) {
      INFO(err[0]);
      REQUIRE(hostile);
      CHECK(err[0].find("node 0: push for round " + std::to_string(r) + " refused") != std::string::npos);
      CHECK(err[0].find("over the bound") != std::string::npos);
      res.refused_round = r;
      hostile = false;
      nodes[0] = std::make_unique<TestNode>(cfg, 0, co.address());  // the operator's honest replacement ...
      REQUIRE(nodes[0]->sync().resynced);  // ... takes θ of this round from a snapshot
    } else if (r < kAttackFrom || !hostile) {
      CHECK(st[0].state_hash == st[1].state_hash);
    }
    if (res.refused_round && r >= res.refused_round + 4) break;
  }
  REQUIRE(res.refused_round > 0);
  const CoordinatorStats stats = co.c->stats();
  std::string reasons;
  for (const auto& [why, n] : stats.push_refusals) reasons += why + "=" + std::to_string(n) + " ";
  INFO(reasons);
  CHECK(stats.push_refusals.at("update_bound") == 1);
  CHECK(stats.push_refusals.size() == 1);
  // The honest nodes' loss falls every round after the refusal (the refused round
  // itself may keep θ_old of a voided shared chunk).
  const size_t after = size_t(res.refused_round);  // honest_loss[after] is round refused_round + 1
  for (size_t i = after; i < honest_loss.size(); ++i) CHECK(honest_loss[i] < honest_loss[i - 1]);
  res.loss_after = honest_loss.back();
  CHECK(res.loss_after < res.loss_before);
  return res;
}

void attacks_for(Codec codec) {
  for (Target target : {Target::experts, Target::shared})
    for (Attack attack : {Attack::huge, Attack::escalating, Attack::flipped}) {
      const std::string what = std::string(codec_name(codec)) + ", " + attack_name(attack) + " into its " +
                               (target == Target::shared ? "shared block" : "experts");
      CAPTURE(what);
      const AttackResult r = run_attack(codec, attack, target);
      MESSAGE(what << ": refused at round "
                                << r.refused_round << " (attack from round " << kAttackFrom << "); honest loss "
                                << r.loss_before << " before, " << r.loss_after << " at round " << r.refused_round + 4);
      if (attack == Attack::escalating) {
        CHECK(r.refused_round >= kAttackFrom);
        CHECK(r.refused_round <= kAttackFrom + 5);  // 2^k crosses κ = 16 × the honest median
      } else {
        CHECK(r.refused_round == kAttackFrom);
      }
    }
}

}  // namespace

TEST_CASE("insider: fp32 huge, escalating and sign-flipped pushes are refused, naming the node; honest nodes go on") {
  attacks_for(Codec::fp32);
}
TEST_CASE("insider: bf16 huge, escalating and sign-flipped pushes are refused, naming the node; honest nodes go on") {
  attacks_for(Codec::bf16);
}
TEST_CASE("insider: int8 huge, escalating and sign-flipped pushes are refused, naming the node; honest nodes go on") {
  attacks_for(Codec::int8);
}
TEST_CASE("insider: sparse huge, escalating and sign-flipped pushes are refused, naming the node; honest nodes go on") {
  attacks_for(Codec::sparse);
}

TEST_CASE("insider: 1000 honest int8 rounds and 100 of each other codec (warm-up, decay) never trip the bound") {
  for (Codec codec : {Codec::fp32, Codec::bf16, Codec::int8, Codec::sparse}) {
    const std::string name = codec_name(codec);
    CAPTURE(name);
    Config cfg = tiny_config(3, codec);
    CoordinatorOptions opt;
    opt.log = std::getenv("SPES_NET_TEST_LOG") != nullptr;
    CoordThread co(cfg, opt);
    std::vector<std::unique_ptr<TestNode>> nodes;
    for (int p = 0; p < 3; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
    const int rounds = codec == Codec::int8 ? 1000 : 100;
    for (int r = 1; r <= rounds; ++r) {
      std::vector<RoundReport> st(3);
      std::vector<std::string> err(3);
      std::vector<std::thread> ts;
      for (int p = 0; p < 3; ++p)
        ts.emplace_back([&, p] {
          try {
            descend(*nodes[size_t(p)]);
            st[size_t(p)] = nodes[size_t(p)]->sync();
          } catch (const std::exception& e) {
            err[size_t(p)] = e.what();
          }
        });
      for (auto& t : ts) t.join();
      const std::string errors = err[0] + err[1] + err[2];
      REQUIRE_MESSAGE(errors.empty(), "round " << r << ": " << errors);
      REQUIRE(st[0].state_hash == st[2].state_hash);
    }
    const CoordinatorStats stats = co.c->stats();
    CHECK(stats.round == rounds);
    CHECK(stats.push_refusals.empty());
    CHECK(stats.max_update_ratio > 0);
    CHECK(stats.max_update_ratio < 0.75);  // sparse, whose error feedback makes sizes vary most, reaches ~0.5
    MESSAGE(name << ": " << rounds << " honest rounds, largest update / bound "
                              << stats.max_update_ratio);
  }
}

TEST_CASE("update bound: θ-relative first, then κ × the lower median of a kind; hostile sizes do not drag it") {
  ParamLayout layout;
  layout.shared_count = 2 * kInt8Block;
  layout.expert_block = 2 * kInt8Block;
  layout.total = layout.shared_count + 3 * layout.expert_block;
  const ChunkGrid grid = make_grid(layout, 3, kInt8Block);
  REQUIRE(grid.chunks.size() == 8);  // 2 shared, then 2 per expert
  UpdateBound b(grid, {4, 4, 0.5});
  CHECK(!b.has_history(0));
  CHECK(b.bound(0, 2.0) == 1.0);  // first × RMS(θ)
  // Round 1: chunk 2 (expert 0, position 0) and chunk 4 (expert 1, position 0) share a kind.
  b.accept(0, 2, 1.0, 1.0);
  b.accept(1, 4, 3.0, 1.0);
  b.accept(2, 6, 2.0, 1.0);
  b.accept(1, 0, 5.0, 10.0);
  b.withdraw(1);  // node 1's push refused later in the round: none of its sizes count
  b.close_round();
  CHECK(b.has_history(4));          // expert 1's chunk gets its peers' history
  CHECK(b.bound(4, 0) == 4 * 1.0);  // lower median of {1, 2}
  CHECK(!b.has_history(3));         // position 1 of the experts: nothing yet
  CHECK(!b.has_history(0));         // the shared chunk: node 1's size was withdrawn
  CHECK(b.max_ratio() == 2.0);  // chunk 6: 2 against 1
  // A node doubling its update each round, accepted while under the bound, among two
  // honest experts of size 1: the median stays 1, so it is refused at 8 > 4.
  double hostile = 1;
  int refused_at = 0;
  for (int r = 2; r <= 10 && !refused_at; ++r) {
    hostile *= 2;
    if (hostile > b.bound(2, 0)) refused_at = r;
    else b.accept(0, 2, hostile, b.bound(2, 0));
    b.accept(1, 4, 1.0, 1);
    b.accept(2, 6, 1.0, 1);
    b.close_round();
  }
  CHECK(refused_at == 4);  // 2 and 4 accepted, 8 refused
  CHECK(b.bound(2, 0) == 4.0);
}
