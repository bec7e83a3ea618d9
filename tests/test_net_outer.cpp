// The coordinator's outer optimizer (net/outer_optimizer): `average` with lr 1 is
// the plain merge bit for bit; `nesterov` equals a direct computation written here
// from net/README.md's formula over 3 rounds with a missing expert and a coordinator
// restart after each round (the momentum is persisted); a chunk whose step is not
// finite keeps its value and momentum; the state file keeps the momentum and still reads format-1 files.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <iterator>

#include "engine/base/error.hpp"
#include "net/outer_optimizer.hpp"
#include "net/state_file.hpp"
#include "net/streaming_merge.hpp"
#include "net_test_util.hpp"

using namespace spes;
using namespace spes::net;
using namespace spes::net::testing;

namespace {

// The merge rules with an outer optimizer, element by element: mean over the
// participants that own i (double sum, rounded to fp32 once) — today's merge,
// θ_new = mean — then g = mean − θ; average: θ + lr·g; nesterov: m = μ·m + g,
// θ + lr·(g + μ·m). Elements nobody pushed keep θ and m.
void expected_round(const std::vector<std::unique_ptr<TestNode>>& nodes, const std::vector<int>& participants,
                    const OuterOptimizer& o, std::vector<float>& theta, std::vector<float>& m) {
  std::vector<double> sum(theta.size(), 0.0);
  std::vector<int> count(theta.size(), 0);
  for (int p : participants)
    for (const Range& r : nodes[p]->own.space.ranges())
      for (int64_t i = r.begin; i < r.end; ++i) sum[i] += double(nodes[p]->params[i]), ++count[i];
  for (size_t i = 0; i < theta.size(); ++i) {
    if (!count[i]) continue;
    if (o.identity()) {
      theta[i] = float(sum[i] / count[i]);
      continue;
    }
    const double g = double(float(sum[i] / count[i])) - double(theta[i]);
    if (o.kind == OuterKind::average) {
      theta[i] = float(double(theta[i]) + o.lr * g);
    } else {
      m[i] = float(o.momentum * double(m[i]) + g);
      theta[i] = float(double(theta[i]) + o.lr * (g + o.momentum * double(m[i])));
    }
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

void check_nodes_hold(const std::vector<std::unique_ptr<TestNode>>& nodes, const std::vector<float>& theta,
                      const CoordThread& co) {
  for (const auto& n : nodes) CHECK(same_bits(n->params, theta));
  CHECK(co.c->stats().state_hash == state_hash(theta.data(), int64_t(theta.size())));
}

}  // namespace

TEST_CASE("outer: average with lr 1 is today's merge bit for bit; lr 0.5 is half the step") {
  for (double lr : {1.0, 0.5}) {
    CAPTURE(lr);
    // Two nodes: the coordinator's fp32 sum of two values equals the double sum
    // rounded once, so the reference below holds bit for bit (with more contributors
    // the sum rounds in arrival order: net/streaming_merge.hpp).
    Config cfg = tiny_config(2, Codec::fp32);
    cfg.spes.outer_optimizer = OuterKind::average;
    cfg.spes.outer_lr = lr;
    CoordThread co(cfg);
    std::vector<std::unique_ptr<TestNode>> nodes;
    for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
    std::vector<float> theta = nodes[0]->params, m;
    for (int r = 1; r <= 2; ++r) {
      for (auto& n : nodes) n->train();
      std::vector<float> plain_mean = theta;
      expected_round(nodes, {0, 1}, {}, plain_mean, m);
      expected_round(nodes, {0, 1}, {OuterKind::average, lr, 0}, theta, m);
      sync_all(nodes, false);
      check_nodes_hold(nodes, theta, co);  // lr 1: the plain mean, bit for bit
      CHECK(same_bits(theta, plain_mean) == (lr == 1.0));
    }
  }
}

TEST_CASE("outer: nesterov over 3 rounds, an expert missing and coordinator restarts, equals the direct computation") {
  Config cfg = tiny_config(2, Codec::fp32);
  cfg.spes.outer_optimizer = OuterKind::nesterov;
  cfg.spes.outer_lr = 0.7;
  cfg.spes.outer_momentum = 0.9;
  cfg.spes.min_nodes = 1;
  cfg.spes.state_dir = temp_dir("outer");
  const OuterOptimizer o{OuterKind::nesterov, 0.7, 0.9};
  CoordinatorOptions first;
  first.fresh = true;  // a new run in this state_dir
  auto co = std::make_unique<CoordThread>(cfg, first);
  CoordinatorOptions opt;
  opt.port = co->port();
  // Restarts the coordinator from its coordinator_state.bin (round timeout for the next round),
  // after checking that the file holds exactly the expected θ and momentum.
  auto restart = [&](const std::vector<float>& theta, const std::vector<float>& m, int64_t round, double timeout_s) {
    co.reset();
    std::vector<float> t(theta.size()), mom;
    const PersistedState ps = load_state_file(cfg.spes.state_dir + "/coordinator_state.bin", t, nullptr, &mom);
    CHECK(ps.has_momentum);
    CHECK(ps.round == round);
    CHECK(same_bits(t, theta));
    CHECK(same_bits(mom, m));
    Config c = cfg;
    c.spes.round_timeout_s = timeout_s;
    co = std::make_unique<CoordThread>(c, opt);
    CHECK(co->c->stats().round == round);
  };
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co->address()));
  std::vector<float> theta = nodes[0]->params, m(theta.size(), 0.0f);

  // Round 1: both nodes.
  for (auto& n : nodes) n->train();
  expected_round(nodes, {0, 1}, o, theta, m);
  sync_all(nodes, false);
  check_nodes_hold(nodes, theta, *co);
  restart(theta, m, 1, 0.3);

  // Round 2: node 1 misses it (closed by the timeout): its experts keep their value
  // and their momentum; the shared weights step on node 0's delta alone.
  nodes[0]->train();
  const std::vector<float> before = theta, m_before = m;
  expected_round(nodes, {0}, o, theta, m);
  const RoundReport a = nodes[0]->sync();
  CHECK(a.participants == 1);
  CHECK(same_bits(nodes[0]->params, theta));
  const Range e1 = nodes[1]->own.space.ranges().back();  // one of node 1's experts
  CHECK(std::equal(theta.begin() + e1.begin, theta.begin() + e1.end, before.begin() + e1.begin));
  CHECK(std::equal(m.begin() + e1.begin, m.begin() + e1.end, m_before.begin() + e1.begin));
  const RoundReport b = nodes[1]->sync();  // its late push is refused; it resyncs
  CHECK(b.resynced);
  check_nodes_hold(nodes, theta, *co);
  restart(theta, m, 2, 30);

  // Round 3: both again; node 1's experts step with the momentum of round 1.
  for (auto& n : nodes) n->train();
  std::vector<float> no_momentum = theta, zero(theta.size(), 0.0f);
  expected_round(nodes, {0, 1}, o, theta, m);
  expected_round(nodes, {0, 1}, o, no_momentum, zero);
  const auto st = sync_all(nodes, false);
  CHECK(st[0].round == 3);
  CHECK_FALSE(st[0].resynced);
  check_nodes_hold(nodes, theta, *co);
  CHECK_FALSE(same_bits(theta, no_momentum));  // the momentum did matter
  co.reset();
  std::filesystem::remove_all(cfg.spes.state_dir);
}

TEST_CASE("outer: a chunk whose step is not finite keeps θ_old and its momentum") {
  ModelConfig mc = tiny_config(1).model;
  const ParamLayout L = make_layout(mc);
  const ChunkGrid g = make_grid(L, mc.n_experts, 256);
  std::vector<float> theta(size_t(L.total), 1.0f), m(size_t(L.total), 0.25f);
  std::vector<float> pushed(size_t(L.total), 2.0f);
  // Chunk 0 overflows (θ −3e38 pulled to +3e38 with lr 5), the others step normally,
  // chunk 1 had no contributor. Through the merge's close, reading and writing the
  // state files as the coordinator does.
  const GridChunk& c0 = g.chunks[0];
  for (int64_t i = c0.begin; i < c0.end; ++i) theta[size_t(i)] = -3e38f, pushed[size_t(i)] = 3e38f;
  RoundFiles files(theta, nullptr, &m);
  StreamingMerge sm(g, Codec::fp32, 1, 1);
  sm.begin_round();
  for (size_t c = 0; c < g.chunks.size(); ++c)
    if (c != 1) sm.add(int(c), reinterpret_cast<const uint8_t*>(pushed.data() + g.chunks[c].begin));
  const std::vector<bool> changed = sm.close(*files.old, *files.next, L, 0.0, 4, {OuterKind::nesterov, 5.0, 0.9});
  CHECK(sm.outer_skipped() == 1);
  CHECK_FALSE(changed[1]);
  files.commit();
  const std::vector<float> m_after = files.read(Section::momentum);
  const float* target = sm.target();
  for (int64_t i = c0.begin; i < c0.end; ++i) {
    CHECK(target[i] == -3e38f);
    CHECK(m_after[size_t(i)] == m[size_t(i)]);
  }
  CHECK(m_after[size_t(g.chunks[1].begin)] == 0.25f);
  const size_t j = size_t(g.chunks[2].begin);
  CHECK(m_after[j] == float(0.9 * 0.25 + 1.0));
  CHECK(target[j] == float(1.0 + 5.0 * (1.0 + 0.9 * double(m_after[j]))));
}

TEST_CASE("outer: state file keeps the momentum; another format is refused in one line naming it") {
  const std::string dir = temp_dir("outer-state");
  const std::string path = dir + "/coordinator_state.bin";
  std::vector<float> theta(100), mom(100);
  for (size_t i = 0; i < theta.size(); ++i) theta[i] = float(i), mom[i] = -0.5f * float(i);
  PersistedState ps;
  ps.run_id = "r";
  ps.round = 3;
  ps.state_hash = state_hash(theta.data(), 100);
  save_state_file(path, ps, theta, nullptr, &mom);
  std::vector<float> t2(100), m2;
  PersistedState back = load_state_file(path, t2, nullptr, &m2);
  CHECK(back.has_momentum);
  CHECK(back.momentum_hash == state_hash(mom.data(), 100));
  CHECK(same_bits(m2, mom));

  // Formats 1 and 2 (before this one) and a newer one are refused.
  for (uint32_t format : {1u, 2u, 9u}) {
    set_state_file_format(path, format);
    const std::string want = "coordinator state " + path + ": format " + std::to_string(format) +
                             ", but this build reads only format 3";
    CHECK_THROWS_WITH_AS(load_state_file(path, t2, nullptr, &m2), want.c_str(), NetError);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("outer: config keys, DiLoCo defaults and one-line errors") {
  const std::string base = "[data]\ntrain = \"t\"\n[spes]\n";
  Config c = parse_config_text(base, "cfg.toml");
  CHECK(c.spes.outer_optimizer == OuterKind::average);
  CHECK(c.spes.outer_lr == 1.0);
  CHECK(c.spes.outer_momentum == 0.0);
  c = parse_config_text(base + "outer_optimizer = \"nesterov\"\n", "cfg.toml");
  CHECK(c.spes.outer_optimizer == OuterKind::nesterov);
  CHECK(c.spes.outer_lr == 0.7);
  CHECK(c.spes.outer_momentum == 0.9);
  c = parse_config_text(base, "cfg.toml", {"spes.outer_optimizer=nesterov", "spes.outer_lr=0.5"});
  CHECK(c.spes.outer_lr == 0.5);
  CHECK(c.spes.outer_momentum == 0.9);
  CHECK(parse_config_text(config_to_toml(c), "back.toml").spes.outer_lr == 0.5);
  auto error_of = [&](const std::string& extra) -> std::string {
    try {
      parse_config_text(base + extra, "cfg.toml");
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  CHECK(error_of("outer_optimizer = \"adam\"\n").find("[spes] outer_optimizer") != std::string::npos);
  CHECK(error_of("outer_optimizer = \"nesterov\"\nouter_lr = 0\n").find("[spes] outer_lr = 0") != std::string::npos);
  CHECK(error_of("outer_optimizer = \"nesterov\"\nouter_momentum = 1\n").find("[0, 1)") != std::string::npos);
  const std::string avg = error_of("outer_momentum = 0.9\n");
  CHECK(avg.find("outer_momentum = 0.9 needs outer_optimizer = \"nesterov\"") != std::string::npos);
  CHECK(avg.find('\n') == std::string::npos);
}
