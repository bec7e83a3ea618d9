// Multi-process fault test: the coordinator runs as a separate process (this test
// binary re-executed on a hidden test case) and is SIGKILLed mid-round, more than
// once; it restarts from its persisted state and the nodes carry on by
// themselves. No round is lost: the round numbers in the CSV are contiguous, each
// appears once, and the nodes' and the persisted state hashes agree.
#include <doctest/doctest.h>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <fstream>
#include <iostream>
#include <random>

#include "net/state_file.hpp"
#include "net_test_util.hpp"


using namespace spes;
using namespace spes::net;
using namespace spes::net::testing;

namespace {

Config restart_config(const std::string& state_dir, uint16_t port, double round_timeout_s = 30) {
  Config cfg = tiny_config(2, Codec::int8);
  cfg.spes.state_dir = state_dir;
  cfg.spes.coordinator = "127.0.0.1:" + std::to_string(port);
  cfg.spes.round_timeout_s = round_timeout_s;
  return cfg;
}

// The coordinator process of a run (its state in state_dir), with the round timeout
// and stop grace it is given.
struct ChildCoordinator {
  std::string state_dir, csv;
  uint16_t port;
  bool fresh = false;
  double round_timeout_s = 30, stop_grace_s = 30;
};

pid_t spawn_coordinator(const ChildCoordinator& c) {
  return spawn_test_child("net child: coordinator process",
                          {"SPES_NET_CHILD_STATE=" + c.state_dir, "SPES_NET_CHILD_PORT=" + std::to_string(c.port),
                           "SPES_NET_CHILD_CSV=" + c.csv, std::string("SPES_NET_CHILD_FRESH=") + (c.fresh ? "1" : "0"),
                           "SPES_NET_CHILD_ROUND_TIMEOUT=" + std::to_string(c.round_timeout_s),
                           "SPES_NET_CHILD_STOP_GRACE=" + std::to_string(c.stop_grace_s)},
                          c.port);
}

pid_t spawn_coordinator(const std::string& state_dir, uint16_t port, const std::string& csv, bool fresh = false) {
  return spawn_coordinator(ChildCoordinator{state_dir, csv, port, fresh});
}

void kill9(pid_t pid) {
  ::kill(pid, SIGKILL);
  int st = 0;
  ::waitpid(pid, &st, 0);
}

// A fresh run's coordinator process (its round rows in csv) and two nodes of it.
struct ProcessRun {
  std::string dir, csv;
  uint16_t port;
  Config cfg;
  pid_t pid;
  std::vector<std::unique_ptr<TestNode>> nodes;
  explicit ProcessRun(const std::string& name, double round_timeout_s = 30, double stop_grace_s = 30)
      : dir(temp_dir(name)),
        csv(dir + "/rounds.csv"),
        port(free_loopback_port()),
        cfg(restart_config(dir + "/state", port, round_timeout_s)),
        pid(spawn_coordinator(ChildCoordinator{cfg.spes.state_dir, csv, port, true, round_timeout_s, stop_grace_s})) {
    SyncClientOptions opt;
    opt.retry_for_s = 60;  // a coordinator that never comes back fails the test in a minute, not an hour
    for (int p = 0; p < 2; ++p)
      nodes.push_back(std::make_unique<TestNode>(cfg, p, "127.0.0.1:" + std::to_string(port), opt));
  }
  ~ProcessRun() {  // a test that failed half way leaves no coordinator running
    if (::waitpid(pid, nullptr, WNOHANG) == 0) kill9(pid);
    std::filesystem::remove_all(dir);
  }
  // Whether the coordinator process exits within `seconds` (its wait status in *status).
  bool exited(double seconds, int* status) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    do {
      if (::waitpid(pid, status, WNOHANG) == pid) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } while (std::chrono::steady_clock::now() < deadline);
    return false;
  }
  // Round 1 with both nodes, then SIGTERM to the coordinator and round 2 with node 0
  // alone (it closes on the round timeout): the round that ends the run, which node 1,
  // still connected, misses. Returns node 0's report of it.
  RoundReport signal_then_round_without_node_1() {
    sync_all(nodes);
    ::kill(pid, SIGTERM);
    nodes[0]->train();
    return nodes[0]->sync();
  }
  int csv_rows() const {
    std::ifstream in(csv);
    std::string line;
    int rows = 0;
    while (std::getline(in, line)) rows += !line.empty();
    return rows;
  }
};

}  // namespace

TEST_CASE("net child: coordinator process" * doctest::skip()) {
  const char* dir = std::getenv("SPES_NET_CHILD_STATE");
  const char* port = std::getenv("SPES_NET_CHILD_PORT");
  const char* csv = std::getenv("SPES_NET_CHILD_CSV");
  if (!dir || !port || !csv) return;
  const char* round_timeout = std::getenv("SPES_NET_CHILD_ROUND_TIMEOUT");
  const char* stop_grace = std::getenv("SPES_NET_CHILD_STOP_GRACE");
  const Config cfg = restart_config(dir, uint16_t(std::atoi(port)), round_timeout ? std::atof(round_timeout) : 30);
  std::ofstream out(csv, std::ios::app);
  CoordinatorOptions opt;
  opt.chunk_elems = 1024;
  opt.csv = &out;
  opt.log = std::getenv("SPES_NET_TEST_LOG") != nullptr;
  opt.handle_signals = true;
  if (stop_grace) opt.stop_grace_s = std::atof(stop_grace);
  opt.fresh = std::getenv("SPES_NET_CHILD_FRESH") && std::string(std::getenv("SPES_NET_CHILD_FRESH")) == "1";
  Coordinator c(test_coordinator_params(cfg), opt);
  c.run();
}

TEST_CASE("faults: coordinator process SIGKILLed mid-round and restarted -> nodes continue, no round lost") {
  ProcessRun run("kill9");
  auto& [dir, csv, port, cfg, pid, nodes] = run;
  std::mt19937 g(3);
  const int kRounds = 6;
  for (int r = 1; r <= kRounds; ++r) {
    for (auto& n : nodes) n->train();
    std::vector<RoundReport> st(2);
    std::vector<std::string> err(2);
    // Node 1 is late, so the kill lands while node 0's push waits in an open round.
    std::vector<std::thread> ts;
    for (int p = 0; p < 2; ++p)
      ts.emplace_back([&, p] {
        try {
          if (p == 1) std::this_thread::sleep_for(std::chrono::milliseconds(150));
          st[p] = nodes[p]->sync();
        } catch (const std::exception& e) {
          err[p] = e.what();
        }
      });
    if (r == 3 || r == 5) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20 + g() % 100));
      kill9(pid);
      pid = spawn_coordinator(cfg.spes.state_dir, port, csv);
    }
    for (auto& t : ts) t.join();
    REQUIRE(err[0] == "");
    REQUIRE(err[1] == "");
    CHECK(st[0].round == r);
    CHECK(st[1].round == r);
    CHECK(st[0].state_hash == st[1].state_hash);
    CHECK(std::memcmp(nodes[0]->params.data(), nodes[1]->params.data(), nodes[0]->params.size() * 4) == 0);
    if (r == 4) {  // and once between rounds, right after a published round
      kill9(pid);
      pid = spawn_coordinator(cfg.spes.state_dir, port, csv);
    }
  }
  for (auto& n : nodes) n->client->disconnect();  // the nodes are done: SIGTERM stops it at once
  ::kill(pid, SIGTERM);  // graceful: persists and exits 0
  int status = 0;
  ::waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status));

  // Rounds in order, none twice (a row is written after its round is persisted; a
  // kill between the two can only drop a row, never a round); the nodes saw every
  // round 1..kRounds above, and the persisted θ is the nodes' θ.
  std::ifstream in(csv);
  std::string line;
  std::vector<int> rounds;
  while (std::getline(in, line))
    if (!line.empty()) rounds.push_back(std::atoi(line.c_str()));
  CHECK(rounds.size() >= size_t(kRounds - 2));
  for (size_t i = 1; i < rounds.size(); ++i) CHECK(rounds[i] > rounds[i - 1]);
  CHECK(rounds.back() == kRounds);
  std::vector<float> theta(nodes[0]->params.size());
  const PersistedState ps = load_state_file(cfg.spes.state_dir + "/coordinator_state.bin", theta, nullptr);
  CHECK(ps.round == kRounds);
  CHECK(std::memcmp(theta.data(), nodes[0]->params.data(), theta.size() * 4) == 0);
  std::filesystem::remove_all(dir);
}

TEST_CASE("faults: SIGKILL of the coordinator at random points over 20 rounds loses no published round") {
  // Write-ahead persistence: whenever the kill lands (between rounds, during the
  // pushes, during the merge or the write of the state file, during the
  // publication), the restarted coordinator holds every round a node has seen, and
  // after each round the nodes' θ is the persisted θ.
  ProcessRun run("kill9-random");
  auto& [dir, csv, port, cfg, pid, nodes] = run;
  std::mt19937 g(13);
  int kills = 0;
  for (int r = 1; r <= 20; ++r) {
    for (auto& n : nodes) n->train();
    std::vector<RoundReport> st(2);
    std::vector<std::string> err(2);
    const int late_ms = int(g() % 40);
    std::vector<std::thread> ts;
    for (int p = 0; p < 2; ++p)
      ts.emplace_back([&, p] {
        try {
          if (p == 1) std::this_thread::sleep_for(std::chrono::milliseconds(late_ms));
          st[p] = nodes[p]->sync();
        } catch (const std::exception& e) {
          err[p] = e.what();
        }
      });
    const int mode = int(g() % 3);  // 0: no kill, 1: during the round, 2: after it
    if (mode == 1) {
      std::this_thread::sleep_for(std::chrono::microseconds(g() % 60000));
      kill9(pid);
      pid = spawn_coordinator(cfg.spes.state_dir, port, csv);
      ++kills;
    }
    for (auto& t : ts) t.join();
    REQUIRE_MESSAGE(err[0] == "", err[0]);
    REQUIRE_MESSAGE(err[1] == "", err[1]);
    CHECK(st[0].round == r);
    CHECK(st[1].round == r);
    CHECK(st[0].state_hash == st[1].state_hash);
    CHECK(std::memcmp(nodes[0]->params.data(), nodes[1]->params.data(), nodes[0]->params.size() * 4) == 0);
    std::vector<float> theta(nodes[0]->params.size());
    std::vector<float> residual;
    const PersistedState ps = load_state_file(cfg.spes.state_dir + "/coordinator_state.bin", theta, &residual);
    CHECK(ps.round == r);
    CHECK(ps.state_hash == st[0].state_hash);
    CHECK(std::memcmp(theta.data(), nodes[0]->params.data(), theta.size() * 4) == 0);
    if (mode == 2) {
      kill9(pid);
      pid = spawn_coordinator(cfg.spes.state_dir, port, csv);
      ++kills;
    }
  }
  CHECK(kills >= 8);
  kill9(pid);
  std::filesystem::remove_all(dir);
}

// Stopping a run (net/README.md, Stopping a run): the round a node asks in its push
// ends the run for every node that receives it, and only that round; a signal to the
// coordinator ends the run at its next round, and the coordinator exits once the last
// node has left (with none joined, at once).
TEST_CASE("stopping a run: a node's request or a signal to the coordinator ends the run at one round for all") {
  ProcessRun run("stop");
  auto& [dir, csv, port, cfg, pid, nodes] = run;
  auto round = [&](bool node_0_asks) {
    std::vector<RoundReport> st(2);
    std::vector<std::thread> ts;
    for (int p = 0; p < 2; ++p)
      ts.emplace_back([&, p] {
        nodes[size_t(p)]->train(1);
        st[size_t(p)] = nodes[size_t(p)]->sync(p == 0 && node_0_asks);
      });
    for (auto& t : ts) t.join();
    CHECK(st[0].round == st[1].round);
    CHECK(st[0].state_hash == st[1].state_hash);
    return st;
  };
  auto exited = [&](double seconds, int* status) { return run.exited(seconds, status); };
  std::vector<RoundReport> st = round(false);
  CHECK(!st[0].stop);
  CHECK(!st[1].stop);
  st = round(true);  // node 0 asks: both are told
  CHECK(st[0].round == 2);
  CHECK(st[0].stop);
  CHECK(st[1].stop);
  st = round(false);  // resumed: the next round goes on
  CHECK(!st[0].stop);
  CHECK(!st[1].stop);

  ::kill(pid, SIGTERM);  // nodes joined: the coordinator serves on to its next round
  int status = 0;
  CHECK(!exited(0.3, &status));
  st = round(false);
  CHECK(st[0].round == 4);
  CHECK(st[0].stop);
  CHECK(st[1].stop);
  CHECK(!exited(0.3, &status));  // node 1 is still there
  nodes[0]->client->disconnect();
  CHECK(!exited(0.3, &status));
  nodes[1]->client->disconnect();
  REQUIRE(exited(10, &status));
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(run.csv_rows() == 4);

  pid = spawn_coordinator(cfg.spes.state_dir, port, csv);  // no node joined: a signal stops it at once
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // listening; its signal handler is set just after
  ::kill(pid, SIGTERM);
  REQUIRE(exited(10, &status));
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

// A node whose push comes after the round that ended the run closed (round_timeout_s)
// misses that round's RoundDone: the snapshot it resyncs from tells it, so it stops at
// the same round as the others; once a node has resumed from that round, the run goes
// on and so does a late node. A signalled coordinator waits for the nodes that missed
// the round, stop_grace_s from when no node is left.
TEST_CASE("stopping a run: a node that missed the round that ended it stops there too, told by its snapshot") {
  SUBCASE("a node asked: the late node stops at that round, one further behind goes on; after a resume, so does a "
          "late node") {
    Config cfg = tiny_config(2, Codec::int8);
    cfg.spes.round_timeout_s = 0.3;
    CoordThread co(cfg);
    std::vector<std::unique_ptr<TestNode>> nodes;
    for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
    const SyncState round_0 = nodes[1]->client->state();
    const std::vector<float> theta_0 = nodes[1]->params;
    sync_all(nodes);  // round 1
    nodes[0]->train();
    const RoundReport a = nodes[0]->sync(true);  // round 2 closes on the timeout, node 0 alone
    CHECK(a.round == 2);
    CHECK(a.stop);
    nodes[1]->train();
    RoundReport b = nodes[1]->sync();  // its push is late: a snapshot of round 2
    CHECK(b.resynced);
    CHECK(b.round == 2);
    CHECK(b.state_hash == a.state_hash);
    CHECK(b.stop);
    nodes[1]->client->restore(round_0);  // as if resumed from a checkpoint of round 0
    nodes[1]->params = theta_0;
    nodes[1]->train();
    b = nodes[1]->sync();  // pushes round 1: a snapshot of round 2, which is not the round after its own
    CHECK(b.resynced);
    CHECK(b.round == 2);
    CHECK(!b.stop);

    nodes[0]->train();
    CHECK(nodes[0]->sync(true).stop);  // node 0 asks again at round 3, node 1 misses it
    nodes[0]->client->disconnect();
    nodes[0]->client->join(nodes[0]->params.data());  // node 0 resumes from round 3: the run goes on
    nodes[1]->train();
    b = nodes[1]->sync();
    CHECK(b.resynced);
    CHECK(b.round == 3);
    CHECK(!b.stop);
  }
  SUBCASE("a signalled coordinator waits for the late node, then exits") {
    ProcessRun run("stop-late", 0.3, 60);
    auto& nodes = run.nodes;
    const RoundReport a = run.signal_then_round_without_node_1();
    CHECK(a.round == 2);
    CHECK(a.stop);
    nodes[0]->client->disconnect();  // node 0 stopped; node 1, connected, trains on
    int status = 0;
    CHECK(!run.exited(0.3, &status));
    nodes[1]->train();
    const RoundReport b = nodes[1]->sync();  // refused as late, it leaves and comes back for its snapshot
    CHECK(b.resynced);
    CHECK(b.round == 2);
    CHECK(b.state_hash == a.state_hash);
    CHECK(b.stop);
    nodes[1]->client->disconnect();
    REQUIRE(run.exited(10, &status));  // every node of the run has round 2: at once, not after the 60 s
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    CHECK(run.csv_rows() == 2);
  }
  SUBCASE("a signalled coordinator exits stop_grace_s after the last node left, when a late node does not come") {
    ProcessRun run("stop-gone", 0.3, 3);
    auto& nodes = run.nodes;
    CHECK(run.signal_then_round_without_node_1().stop);
    nodes[0]->client->disconnect();
    nodes[1]->client->disconnect();  // node 1 is gone
    int status = 0;
    CHECK(!run.exited(1.0, &status));  // waiting for node 1
    REQUIRE(run.exited(10, &status));
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
}
