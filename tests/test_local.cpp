// `spes-engine local` end to end (separate processes): one CSV with a node column,
// every node logging the coordinator's state hash after each round; and a failing
// node stops the whole run with a non-zero exit that names it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/config.hpp"
#include "stopped_run.hpp"
#include "test_util.hpp"

using namespace spes;

namespace {

std::vector<std::string> split(const std::string& line) {
  std::vector<std::string> out;
  std::istringstream is(line);
  for (std::string f; std::getline(is, f, ',');) out.push_back(f);
  if (!line.empty() && line.back() == ',') out.push_back("");
  return out;
}

// Writes a 2-node SPES config (sync every 2 steps) and returns its path.
std::string write_local_config(const test::TempDir& dir) {
  const int port = test::pick_port();
  Config c = test::small_config(dir.path, {"spes.n_nodes=2", "spes.ownership=\"partitioned\"", "spes.sync_steps=2",
                                           "spes.run_id=\"local-test\"", "spes.round_timeout_s=60",
                                           "spes.coordinator=\"127.0.0.1:" + std::to_string(port) + "\"",
                                           "spes.state_dir=\"" + (dir / "coordinator") + "\""});
  const std::string path = dir / "local.toml";
  std::ofstream(path) << config_to_toml(c);
  return path;
}

int run(const std::string& args, const test::TempDir& dir) {
  const std::string cmd = std::string(SPES_ENGINE_BIN) + " local " + args + " > " + (dir / "out.csv") + " 2> " +
                          (dir / "err.log");
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

TEST_CASE("local: coordinator + 2 node processes, node-prefixed CSV, equal state hashes") {
  test::TempDir dir("local");
  const std::string config = write_local_config(dir);
  const int rc = run(config, dir);
  INFO("stderr of local:\n" << test::read_text(dir / "err.log"));
  REQUIRE(rc == 0);
  std::istringstream csv(test::read_text(dir / "out.csv"));
  std::string line;
  std::getline(csv, line);
  const auto header = split(line);
  REQUIRE(header.size() > 2);
  CHECK(header[0] == "node");
  CHECK(header[1] == "step");
  const auto col = [&](const char* name) { return size_t(std::find(header.begin(), header.end(), name) - header.begin()); };
  std::map<std::string, std::map<std::string, std::string>> hash_by_step;  // step -> node -> hash
  int rows = 0;
  while (std::getline(csv, line)) {
    const auto row = split(line);
    REQUIRE(row.size() == header.size());
    ++rows;
    if (!row[col("state_hash")].empty()) hash_by_step[row[col("step")]][row[0]] = row[col("state_hash")];
  }
  CHECK(rows == 2 * 6);
  REQUIRE(hash_by_step.size() == 3);  // rounds after steps 2, 4, 6
  const std::string rounds = test::read_text(dir / "coordinator/rounds.csv");
  for (const auto& [step, by_node] : hash_by_step) {
    REQUIRE(by_node.size() == 2);
    CHECK(by_node.at("0") == by_node.at("1"));
    CHECK(rounds.find(by_node.at("0")) != std::string::npos);  // and the coordinator's
  }
}

TEST_CASE("local: Ctrl-C stops every node at a sync round with a checkpoint; --resume ends bit for bit as an "
          "uninterrupted run") {
  const std::vector<std::string> sets = {"--set train.steps=300", "--set optim.decay_steps=300",
                                         "--set train.eval_every=0", "--set checkpoint.every=0"};
  std::string args;
  for (const auto& s : sets) args += " " + s;
  test::TempDir ref("local-ref"), dir("local-int");
  REQUIRE(run(write_local_config(ref) + args, ref) == 0);

  // The same run, interrupted once its CSV shows step 20 of node 0.
  const std::string config = write_local_config(dir) + args;
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const std::string cmd = "exec " + std::string(SPES_ENGINE_BIN) + " local " + config + " > " + (dir / "out.csv") +
                            " 2> " + (dir / "err.log");
    execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
    _exit(127);
  }
  for (int i = 0; i < 600 && test::read_text(dir / "out.csv").find("\n0,20,") == std::string::npos; ++i) usleep(20000);
  kill(pid, SIGINT);
  int status = 0;
  waitpid(pid, &status, 0);
  const std::string err = test::read_text(dir / "err.log");
  INFO("stderr of the interrupted local:\n" << err);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 130);  // 0 would mean it finished first: nothing interrupted
  CHECK(err.find("stopped: every node wrote a checkpoint") != std::string::npos);
  test::check_stopped_at_one_round(dir, 2, 300);

  REQUIRE(run(config + " --resume", dir) == 0);
  test::check_ends_as(ref, dir, 300);
}

TEST_CASE("local: a failing node stops the run and is named") {
  test::TempDir dir("local-fail");
  const std::string config = write_local_config(dir);
  // A manifest that names a token file no node can open: `local` checks the manifests
  // before it starts anything (test_cli.cpp), the files are the nodes' to open.
  { std::ofstream(dir / "broken.manifest") << "missing.bin\n"; }
  CHECK(run(config + " --set 'data.train=\"" + (dir / "broken.manifest") + "\"'", dir) == 1);
  const std::string err = test::read_text(dir / "err.log");
  CHECK(err.find("missing.bin") != std::string::npos);
  CHECK(err.find("failed") != std::string::npos);
}
