// The trainer with the sync protocol in the loop (engine/net_sync): one node owning
// every expert equals plain local training bit for bit (fp32 codec), and SPES
// nodes end every round bit-identical to each other and to the coordinator.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "engine/checkpoint.hpp"
#include "engine/config.hpp"
#include "engine/net_sync.hpp"
#include "engine/trainer.hpp"
#include "net/coordinator.hpp"
#include "net/digest.hpp"
#include "test_util.hpp"

using namespace spes;

namespace {

Config trainer_config(const std::filesystem::path& dir, const std::vector<std::string>& extra) {
  std::vector<std::string> sets = {"spes.sync_steps=2", "spes.run_id=\"trainer-test\"", "spes.round_timeout_s=60",
                                   "spes.state_dir=\"" + (dir / "coordinator").string() + "\""};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return test::small_config(dir, sets);
}

struct Server {
  std::unique_ptr<net::Coordinator> c;
  std::thread t;
  explicit Server(const Config& cfg) {
    net::CoordinatorParams p = coordinator_params(cfg);
    p.secret = "";  // the nodes read no secret either: HMAC with the empty key, loopback only
    net::CoordinatorOptions o;
    o.port = 0;
    o.log = false;
    o.fresh = true;  // a new run
    c = std::make_unique<net::Coordinator>(std::move(p), o);
    t = std::thread([this] { c->run(); });
  }
  ~Server() {
    c->stop();
    t.join();
  }
  std::string address() const { return "spes.coordinator=\"127.0.0.1:" + std::to_string(c->port()) + "\""; }
};

// One trainer per csv stream (node id = its index) against `server`, each with the
// sync hook (and what `prepare` adds), run to the end on threads of their own
// (resume: from their newest checkpoints); returns the trainers.
std::vector<std::unique_ptr<Trainer>> run_synced_nodes(const Server& server, const std::filesystem::path& dir,
                                                       const std::vector<std::string>& spes,
                                                       std::vector<std::ostringstream>& csv, bool resume = false,
                                                       const std::function<void(Trainer&, size_t)>& prepare = {}) {
  std::vector<std::unique_ptr<Trainer>> nodes;
  for (size_t p = 0; p < csv.size(); ++p) {
    auto extra = spes;
    extra.push_back("spes.node_id=" + std::to_string(p));
    extra.push_back(server.address());
    const Config c = trainer_config(dir / ("n" + std::to_string(p)), extra);
    nodes.push_back(std::make_unique<Trainer>(c));
    nodes.back()->set_sync_hook(make_net_sync_hook(c, nodes.back()->layout(), nodes.back()->ownership()));
    if (prepare) prepare(*nodes.back(), p);
  }
  std::vector<std::thread> ts;
  for (size_t p = 0; p < csv.size(); ++p) ts.emplace_back([&, p] { nodes[p]->run(csv[p], resume); });
  for (auto& t : ts) t.join();
  return nodes;
}

// The fields of one CSV line (a trailing comma is an empty last field).
std::vector<std::string> csv_fields(const std::string& line) {
  std::vector<std::string> out;
  std::istringstream is(line);
  for (std::string f; std::getline(is, f, ',');) out.push_back(f);
  if (!line.empty() && line.back() == ',') out.push_back("");
  return out;
}

}  // namespace

TEST_CASE("trainer + coordinator: one node owning every expert equals local training (fp32, bitwise)") {
  const auto dir = test::temp_dir("net-trainer-1");
  const Config base = trainer_config(dir / "local", {"spes.codec=\"fp32\""});
  Trainer local(base);
  std::ostringstream local_csv;
  local.run(local_csv, false);

  Config cfg = trainer_config(dir / "synced", {"spes.codec=\"fp32\""});
  Server server(cfg);
  cfg = trainer_config(dir / "synced", {"spes.codec=\"fp32\"", server.address()});
  Trainer synced(cfg);
  synced.set_sync_hook(make_net_sync_hook(cfg, synced.layout(), synced.ownership()));
  std::ostringstream synced_csv;
  synced.run(synced_csv, false);

  CHECK(server.c->stats().round == 3);
  CHECK(synced.params() == local.params());
  CHECK(server.c->stats().state_hash == net::state_hash(synced.params().data(), int64_t(synced.params().size())));
}

TEST_CASE("trainer + coordinator: two SPES nodes end every round bit-identical (int8)") {
  const auto dir = test::temp_dir("net-trainer-2");
  const std::vector<std::string> spes = {"spes.codec=\"int8\"", "spes.n_nodes=2", "spes.ownership=\"partitioned\"",
                                         "spes.merge_alpha=0.3", "spes.merge_interval=2", "spes.merge_decay_steps=6"};
  Server server(trainer_config(dir / "c", spes));
  std::vector<std::ostringstream> csv(2);
  const auto nodes = run_synced_nodes(server, dir, spes, csv);
  CHECK(server.c->stats().round == 3);
  CHECK(nodes[0]->params() == nodes[1]->params());  // step 6 is a sync step
  CHECK(server.c->stats().state_hash == net::state_hash(nodes[0]->params().data(), int64_t(nodes[0]->params().size())));
  // The sync columns: a round on steps 2, 4, 6 with bytes both ways, and the same
  // state hash on both nodes after every round.
  std::vector<std::vector<std::string>> hashes(2);
  for (int p = 0; p < 2; ++p) {
    std::istringstream is(csv[p].str());
    std::string line;
    std::getline(is, line);
    const auto header = csv_fields(line);
    const auto col = [&](const char* name) { return size_t(std::find(header.begin(), header.end(), name) - header.begin()); };
    while (std::getline(is, line)) {
      const auto row = csv_fields(line);
      REQUIRE(row.size() == header.size());
      if (std::stoll(row[col("sync_round")]) == 0) continue;
      CHECK(std::stoll(row[col("bytes_up")]) > 0);
      CHECK(std::stoll(row[col("bytes_down")]) > 0);
      hashes[p].push_back(row[col("state_hash")]);
    }
  }
  CHECK(hashes[0].size() == 3);
  CHECK(hashes[0] == hashes[1]);
  char last[20];
  std::snprintf(last, sizeof last, "%016llx", (unsigned long long)server.c->stats().state_hash);
  CHECK(hashes[0].back() == last);
}

TEST_CASE("trainer + coordinator: sparse codec, a resumed node continues exactly (residual restored bitwise)") {
  const auto dir = test::temp_dir("net-trainer-sparse");
  const std::vector<std::string> spes = {"spes.codec=\"sparse\"", "train.steps=6", "checkpoint.every=2"};
  auto run_node = [&](const std::string& name, bool interrupt) {
    Server server(trainer_config(dir / name / "c", spes));
    auto extra = spes;
    extra.push_back(server.address());
    Config c = trainer_config(dir / name, extra);
    if (interrupt) c.train.max_steps_this_run = 4;
    std::ostringstream csv;
    {
      Trainer t(c);
      t.set_sync_hook(make_net_sync_hook(c, t.layout(), t.ownership()));
      t.run(csv, false);
      if (!interrupt) return std::make_pair(t.params(), server.c->stats().state_hash);
    }
    c.train.max_steps_this_run = 0;
    Trainer t(c);  // a new process, as far as the node knows: everything from the checkpoint
    t.set_sync_hook(make_net_sync_hook(c, t.layout(), t.ownership()));
    t.run(csv, true);
    CHECK(t.step() == 6);
    return std::make_pair(t.params(), server.c->stats().state_hash);
  };
  const auto straight = run_node("straight", false);
  const auto resumed = run_node("resumed", true);
  // The checkpoint at step 4 carries a residual that matters (most of Δ is not sent).
  const std::string root = node_checkpoint_root(trainer_config(dir / "resumed", spes));
  const CheckpointState ck = load_checkpoint(root + "/step-00000004");
  double res_norm = 0;
  for (float r : ck.sync_residual) res_norm += double(r) * r;
  CHECK(res_norm > 0);
  CHECK(resumed.first == straight.first);  // bitwise
  CHECK(resumed.second == straight.second);
}

// Stopping a synced run: a signal reaches node 0 alone, before its first step. It
// asks the run to stop in its first push; that round's result ends the run for both
// nodes, which stop at one step with a checkpoint of the round (node 1 told by the
// round, not by a signal). Resumed, both end bit for bit as an uninterrupted run.
// Overlapped, the round is applied a step after its push, and the stop with it.
TEST_CASE("trainer + coordinator: a signal to one node stops every node at one round; resumed, bit for bit") {
  for (const bool overlap : {false, true}) {
    CAPTURE(overlap);
    const auto dir = test::temp_dir(overlap ? "net-trainer-stop-overlap" : "net-trainer-stop");
    std::vector<std::string> spes = {"spes.codec=\"int8\"", "spes.n_nodes=2", "spes.ownership=\"partitioned\"",
                                     "checkpoint.every=0"};
    if (overlap) spes.insert(spes.end(), {"spes.overlap=true", "spes.overlap_steps=1"});
    auto run_pair = [&](const std::string& name, bool stop) {
      Server server(trainer_config(dir / name / "c", spes));
      std::atomic<int> signal_0{stop ? SIGTERM : 0}, none{0};
      std::vector<std::ostringstream> csv(2);
      auto first = run_synced_nodes(server, dir / name, spes, csv, false,
                                    [&](Trainer& t, size_t p) { t.stop_on_signal(p == 0 ? &signal_0 : &none); });
      if (!stop) return first[0]->params();
      const int64_t at = overlap ? 3 : 2;  // the first round's step (2), or where it is applied
      for (int p = 0; p < 2; ++p) {
        CAPTURE(p);
        CHECK(first[size_t(p)]->step() == at);
        const CheckpointState ck =
            load_checkpoint(latest_checkpoint(node_checkpoint_root(first[size_t(p)]->config())));
        CHECK(ck.step == at);
        CHECK(ck.sync_round == 1);
      }
      CHECK(!first[0]->stopped_by_run());  // it asked
      CHECK(first[1]->stopped_by_run());   // the round told it
      CHECK(server.c->stats().round == 1);
      first.clear();  // the stopped processes exit: their connections close
      std::vector<std::ostringstream> resumed_csv(2);
      const auto resumed = run_synced_nodes(server, dir / name, spes, resumed_csv, true);
      CHECK(resumed[0]->step() == 6);
      CHECK(resumed[0]->params() == resumed[1]->params());
      return resumed[0]->params();
    };
    const std::vector<float> straight = run_pair("straight", false), stopped = run_pair("stopped", true);
    CHECK(stopped == straight);  // bitwise
  }
}

// A coordinator signalled while no node had joined exits at once; a node signalled
// too (SLURM signals every task) that then cannot reach it must not wait for it (it
// would retry for retry_for_s, an hour): it stops before its first step.
TEST_CASE("trainer + coordinator: a signalled node that cannot reach its coordinator at its start stops at once") {
  const auto dir = test::temp_dir("net-trainer-stop-unreachable");
  const Config c = trainer_config(dir, {"spes.n_nodes=2", "spes.ownership=\"partitioned\"", "spes.node_id=0",
                                        "spes.coordinator=\"127.0.0.1:" + std::to_string(test::pick_port()) + "\""});
  Trainer t(c);
  t.set_sync_hook(make_net_sync_hook(c, t.layout(), t.ownership()));
  std::atomic<int> signal{SIGTERM};
  t.stop_on_signal(&signal);
  std::ostringstream csv;
  const auto t0 = std::chrono::steady_clock::now();
  t.run(csv, false);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
  CHECK(t.step() == 0);
  CHECK(csv.str().empty());
  CHECK(latest_checkpoint(node_checkpoint_root(c)).empty());  // nothing trained: nothing to keep
}

// The rows a node's CSV reports rounds in: sync_round → (step, bytes_up, state_hash).
struct RoundRow {
  int64_t step, bytes_up;
  std::string state_hash;
};
std::map<int64_t, RoundRow> round_rows(const std::string& csv) {
  std::istringstream is(csv);
  std::string line;
  std::getline(is, line);
  const auto header = csv_fields(line);
  const auto col = [&](const char* name) { return size_t(std::find(header.begin(), header.end(), name) - header.begin()); };
  REQUIRE(col("sync_wait_ms") < header.size());
  std::map<int64_t, RoundRow> out;
  while (std::getline(is, line)) {
    const auto row = csv_fields(line);
    REQUIRE(row.size() == header.size());
    const int64_t r = std::stoll(row[col("sync_round")]);
    if (r == 0) continue;
    CHECK(std::stod(row[col("sync_inflight_ms")]) > 0);
    out[r] = {std::stoll(row[col("step")]), std::stoll(row[col("bytes_up")]), row[col("state_hash")]};
  }
  return out;
}

TEST_CASE("trainer + coordinator: 4 SPES nodes with overlapped rounds: every round in the CSV, hashes agree") {
  // overlap_steps 0: a round applied at the next round's step; 1: one step after its
  // push. A checkpoint, and the run's end, apply the round in flight at once. Rounds
  // are pushed at steps 2, 4, ..., 12; `applied` maps each round the CSV names to its
  // step, and `folded` a round applied at the same step as the next (its row names
  // the later round and carries both rounds' bytes).
  struct Case {
    int tau, checkpoint_every;
    std::map<int64_t, int64_t> applied;
    std::set<int64_t> folded;
  };
  const Case cases[] = {
      {0, 0, {{1, 4}, {2, 6}, {3, 8}, {4, 10}, {6, 12}}, {5}},
      {1, 0, {{1, 3}, {2, 5}, {3, 7}, {4, 9}, {5, 11}, {6, 12}}, {}},
      {0, 3, {{1, 3}, {3, 6}, {4, 9}, {6, 12}}, {2, 5}},
  };
  for (const Case& k : cases) {
    CAPTURE(k.tau);
    CAPTURE(k.checkpoint_every);
    const auto dir =
        test::temp_dir("net-trainer-overlap-" + std::to_string(k.tau) + "-" + std::to_string(k.checkpoint_every));
    const std::vector<std::string> spes = {"spes.codec=\"int8\"", "spes.n_nodes=4", "spes.ownership=\"partitioned\"",
                                           "spes.overlap=true", "train.steps=12",
                                           "spes.overlap_steps=" + std::to_string(k.tau),
                                           "checkpoint.every=" + std::to_string(k.checkpoint_every)};
    Server server(trainer_config(dir / "c", spes));
    std::vector<std::ostringstream> csv(4);
    const auto nodes = run_synced_nodes(server, dir, spes, csv);
    CHECK(server.c->stats().round == 6);
    std::vector<std::map<int64_t, RoundRow>> rows(4);
    for (int p = 0; p < 4; ++p) {
      rows[p] = round_rows(csv[p].str());
      REQUIRE(rows[p].size() == k.applied.size());
      // The int8 codec sends about the same bytes every round (the push's figures vary a little).
      const double one_round = double(rows[p].at(4).bytes_up);
      CHECK(one_round > 0);
      for (const auto& [r, row] : rows[p]) {
        CAPTURE(r);
        CHECK(row.step == k.applied.at(r));
        CHECK(double(row.bytes_up) == doctest::Approx((k.folded.count(r - 1) ? 2 : 1) * one_round).epsilon(0.02));
        CHECK(row.state_hash == rows[0][r].state_hash);
      }
      // The run ends on the last round's θ, which the last row names.
      CHECK(std::stoull(rows[p].at(6).state_hash, nullptr, 16) == server.c->stats().state_hash);
      CHECK(net::state_hash(nodes[p]->params().data(), int64_t(nodes[p]->params().size())) ==
            server.c->stats().state_hash);
    }
  }
}
