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

Config restart_config(const std::string& state_dir, uint16_t port) {
  Config cfg = tiny_config(2, Codec::int8);
  cfg.spes.state_dir = state_dir;
  cfg.spes.coordinator = "127.0.0.1:" + std::to_string(port);
  return cfg;
}

pid_t spawn_coordinator(const std::string& state_dir, uint16_t port, const std::string& csv, bool fresh = false) {
  return spawn_test_child("net child: coordinator process",
                          {"SPES_NET_CHILD_STATE=" + state_dir, "SPES_NET_CHILD_PORT=" + std::to_string(port),
                           "SPES_NET_CHILD_CSV=" + csv, std::string("SPES_NET_CHILD_FRESH=") + (fresh ? "1" : "0")},
                          port);
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
  explicit ProcessRun(const std::string& name)
      : dir(temp_dir(name)),
        csv(dir + "/rounds.csv"),
        port(free_loopback_port()),
        cfg(restart_config(dir + "/state", port)),
        pid(spawn_coordinator(cfg.spes.state_dir, port, csv, true)) {
    for (int p = 0; p < 2; ++p)
      nodes.push_back(std::make_unique<TestNode>(cfg, p, "127.0.0.1:" + std::to_string(port)));
  }
};

}  // namespace

TEST_CASE("net child: coordinator process" * doctest::skip()) {
  const char* dir = std::getenv("SPES_NET_CHILD_STATE");
  const char* port = std::getenv("SPES_NET_CHILD_PORT");
  const char* csv = std::getenv("SPES_NET_CHILD_CSV");
  if (!dir || !port || !csv) return;
  const Config cfg = restart_config(dir, uint16_t(std::atoi(port)));
  std::ofstream out(csv, std::ios::app);
  CoordinatorOptions opt;
  opt.chunk_elems = 1024;
  opt.csv = &out;
  opt.log = std::getenv("SPES_NET_TEST_LOG") != nullptr;
  opt.handle_signals = true;
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
  auto exited = [&](double seconds, int* status) {
    for (int i = 0; i < int(seconds * 50); ++i) {
      if (::waitpid(pid, status, WNOHANG) == pid) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  };
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
  std::ifstream in(csv);
  std::string line;
  int rows = 0;
  while (std::getline(in, line)) rows += !line.empty();
  CHECK(rows == 4);

  pid = spawn_coordinator(cfg.spes.state_dir, port, csv);  // no node joined: a signal stops it at once
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // listening; its signal handler is set just after
  ::kill(pid, SIGTERM);
  REQUIRE(exited(10, &status));
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}
