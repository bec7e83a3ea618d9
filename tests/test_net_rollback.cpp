// A bad round never costs the run (issue 33, point 2): a round poisoned past the
// update bound (here: the bound off) makes the honest nodes' next step non-finite.
// Each keeps a checkpoint of its state from before that round, reports the round to
// the coordinator (which names the nodes that pushed to it) and stops naming it; the
// coordinator restarted with --rollback-to the round before serves that kept round,
// the nodes resume from their checkpoints in sync with it, and the run goes on
// without the hostile node: hashes agree every round, the loss falls.
#include <doctest/doctest.h>

#include <algorithm>
#include <sstream>
#include <thread>

#include "engine/base/error.hpp"
#include "engine/checkpoint.hpp"
#include "engine/net_sync.hpp"
#include "engine/trainer.hpp"
#include "net/coordinator.hpp"
#include "net/digest.hpp"
#include "net_test_util.hpp"
#include "test_util.hpp"

using namespace spes;

namespace {

std::vector<std::string> rollback_sets(const std::filesystem::path& dir, uint16_t port) {
  return {"model.n_experts=3", "spes.n_nodes=3", "spes.ownership=\"partitioned\"", "spes.experts_per_node=1", "spes.codec=\"bf16\"",
          "spes.sync_steps=2", "spes.run_id=\"rollback-test\"", "spes.round_timeout_s=1.5", "spes.min_nodes=2",
          "spes.update_bound=0", "spes.state_dir=\"" + (dir / "coordinator").string() + "\"",
          "spes.coordinator=\"127.0.0.1:" + std::to_string(port) + "\"", "train.steps=12", "checkpoint.every=2"};
}

Config node_config(const std::filesystem::path& dir, uint16_t port, int node) {
  auto sets = rollback_sets(dir, port);
  sets.push_back("spes.node_id=" + std::to_string(node));
  sets.push_back("checkpoint.dir=\"" + (dir / "checkpoints").string() + "\"");
  return test::small_config(dir / ("n" + std::to_string(node)), sets);
}

struct Server {
  std::unique_ptr<net::Coordinator> c;
  std::thread t;
  Server(const Config& cfg, bool fresh, int64_t rollback_to) {
    net::CoordinatorParams p = coordinator_params(cfg);
    p.secret = "";
    net::CoordinatorOptions o;
    o.port = -1;  // the config's: the nodes' checkpoints remember it
    o.log = std::getenv("SPES_NET_TEST_LOG") != nullptr;
    o.fresh = fresh;
    o.rollback_to = rollback_to;
    c = std::make_unique<net::Coordinator>(std::move(p), o);
    t = std::thread([this] { c->run(); });
  }
  ~Server() {
    c->stop();
    t.join();
  }
};

// The (step, loss, sync_round, state_hash) rows of a node's CSV.
struct Row {
  int64_t step = 0, round = 0;
  double loss = 0;
  std::string hash;
};
std::vector<Row> csv_rows(const std::string& csv) {
  std::istringstream is(csv);
  std::string line;
  std::vector<Row> out;
  std::vector<std::string> header;
  auto fields = [](const std::string& l) {
    std::vector<std::string> f;
    std::istringstream s(l);
    for (std::string x; std::getline(s, x, ',');) f.push_back(x);
    if (!l.empty() && l.back() == ',') f.push_back("");  // an empty last field
    return f;
  };
  while (std::getline(is, line)) {
    if (line.rfind("step,", 0) == 0) {
      header = fields(line);
      continue;
    }
    const auto f = fields(line);
    auto col = [&](const char* n) { return f.at(size_t(std::find(header.begin(), header.end(), n) - header.begin())); };
    out.push_back({std::stoll(col("step")), std::stoll(col("sync_round")), std::stod(col("loss")), col("state_hash")});
  }
  return out;
}

}  // namespace

TEST_CASE("rollback: a poisoned round is reported, the coordinator rolls back, the run goes on without the culprit") {
  const auto dir = test::temp_dir("net-rollback");
  const uint16_t port = net::testing::free_loopback_port();
  const Config c0 = node_config(dir, port, 0);
  std::vector<std::string> errors(2);
  std::vector<std::ostringstream> csv1(2);
  {
    Server server(c0, true, -1);
    // Node 2 turns hostile: honest rounds 1 and 2, then a huge finite Δ (3e38, as bf16 0x7F7F) into the
    // shared block in round 3 (bf16, θ + Δ finite: the finite guard lets it through).
    Config c2 = node_config(dir, port, 2);
    std::thread hostile([&] {
      net::testing::TestNode n(c2, 2, "127.0.0.1:" + std::to_string(port), {}, "");
      for (int r = 1; r <= 3; ++r) {
        n.train(2);
        if (r == 3)
          for (int64_t i = 0; i < n.layout.shared_count; ++i) n.params[size_t(i)] += 3.0e38f;
        try {
          n.sync();
        } catch (const std::exception&) {
        }
      }
    });
    std::vector<std::thread> ts;
    for (int p = 0; p < 2; ++p)
      ts.emplace_back([&, p] {
        const Config c = node_config(dir, port, p);
        Trainer t(c);
        t.set_sync_hook(make_net_sync_hook(c, t.layout(), t.ownership()));
        try {
          t.run(csv1[size_t(p)], false);
        } catch (const std::exception& e) {
          errors[size_t(p)] = e.what();
        }
      });
    for (auto& t : ts) t.join();
    hostile.join();
    for (int p = 0; p < 2; ++p) {
      INFO(errors[size_t(p)]);
      CHECK(errors[size_t(p)].find("step 6: ") == 0);  // 6 steps done: the 7th failed
      CHECK(errors[size_t(p)].find("at the first step after sync round 3: round 3 is bad") != std::string::npos);
      CHECK(errors[size_t(p)].find("--rollback-to 2") != std::string::npos);
    }
    REQUIRE(net::testing::wait_until([&] { return server.c->stats().bad_round_reports.size() == 2; }));
    for (const std::string& r : server.c->stats().bad_round_reports) CHECK(r.find("round 3: node ") == 0);
    CHECK(server.c->stats().round == 3);
  }
  // Each node's newest checkpoint is its state from before round 3 (step 6, round 2).
  for (int p = 0; p < 2; ++p) {
    const CheckpointState ck = load_checkpoint(node_checkpoint_root(node_config(dir, port, p)));
    CHECK(ck.step == 6);
    CHECK(ck.sync_round == 2);
    CHECK(std::all_of(ck.params.begin(), ck.params.end(), [](float x) { return std::fabs(x) < 1e3f; }));
  }
  // The operator revokes node 2 (here: it does not come back) and rolls back to round 2.
  std::vector<std::ostringstream> csv2(2);
  errors.assign(2, "");
  {
    Server server(c0, false, 2);
    CHECK(server.c->stats().round == 2);
    std::vector<std::thread> ts;
    for (int p = 0; p < 2; ++p)
      ts.emplace_back([&, p] {
        const Config c = node_config(dir, port, p);
        Trainer t(c);
        t.set_sync_hook(make_net_sync_hook(c, t.layout(), t.ownership()));
        try {
          t.run(csv2[size_t(p)], true);
        } catch (const std::exception& e) {
          errors[size_t(p)] = e.what();
        }
      });
    for (auto& t : ts) t.join();
    CHECK(errors[0] + errors[1] == "");
    CHECK(server.c->stats().round == 6);
    const std::vector<Row> a = csv_rows(csv2[0].str()), b = csv_rows(csv2[1].str());
    REQUIRE(a.size() == 6);  // steps 7..12
    REQUIRE(b.size() == 6);
    for (size_t i = 0; i < a.size(); ++i) {
      CHECK(a[i].step == b[i].step);
      CHECK(std::isfinite(a[i].loss));
      if (a[i].round > 0) CHECK(a[i].hash == b[i].hash);
    }
    CHECK(a.back().round == 6);
    const std::vector<Row> before = csv_rows(csv1[0].str());
    REQUIRE(!before.empty());
    CHECK(a.back().loss < before.front().loss);  // the run goes on learning
    MESSAGE("rollback: node 0's loss " << before.front().loss << " at step 1, " << before.back().loss
                                       << " at step 6 (before the bad round), " << a.back().loss << " at step 12");
  }
}

TEST_CASE("rollback: nodes ahead take the rolled-back θ; a round not kept is a clear error") {
  using namespace spes::net;
  using namespace spes::net::testing;
  const std::string dir = temp_dir("rollback-ahead");
  Config cfg = tiny_config(2, Codec::int8);
  cfg.spes.state_dir = dir;
  CoordinatorOptions opt;
  opt.log = std::getenv("SPES_NET_TEST_LOG") != nullptr;
  uint64_t hash1 = 0;
  std::vector<std::unique_ptr<TestNode>> nodes;
  {
    opt.fresh = true;
    CoordThread co(test_coordinator_params(cfg), opt);
    for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
    for (int r = 1; r <= 3; ++r) {
      const auto st = sync_all(nodes);
      if (r == 1) hash1 = st[0].state_hash;
    }
    CHECK(co.c->stats().round == 3);
    opt.port = co.port();  // the nodes dial it again
  }
  opt.fresh = false;
  opt.rollback_to = 0;  // kept: rounds 2 and 3 only (keep_rounds 2)
  CHECK_THROWS_WITH_AS(CoordThread(test_coordinator_params(cfg), opt),
                       doctest::Contains("--rollback-to 0: "), NetError);
  CHECK_THROWS_WITH_AS(CoordThread(test_coordinator_params(cfg), opt), doctest::Contains("kept rounds: 2, 3"),
                       NetError);
  opt.rollback_to = 2;
  CoordThread co(test_coordinator_params(cfg), opt);
  CHECK(co.c->stats().round == 2);
  CHECK(hash1 != co.c->stats().state_hash);
  // Both nodes hold round 3: they take round 2 from a snapshot, then train on.
  for (auto& n : nodes) n->client->disconnect();
  const auto st = sync_all(nodes);
  CHECK(st[0].resynced);
  CHECK(st[0].round == 2);
  const auto next = sync_all(nodes);
  CHECK(next[0].round == 3);
  CHECK(next[0].state_hash == next[1].state_hash);
  CHECK(next[1].state_hash == co.c->stats().state_hash);
  std::filesystem::remove_all(dir);
}
