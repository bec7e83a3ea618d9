// The commands through the binary: a value out of range is one line on stderr naming
// the flag, a non-zero exit, nothing on stdout, and nothing started or written; eval's
// CSV; train stopped by a signal. (The config's keys are test_config.cpp's; the
// data's, test_data.cpp's; local's signals, test_local.cpp's.)
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace fs = std::filesystem;
using spes::test::read_text;
using spes::test::TempDir;

namespace {

struct Run {
  int status = -1;
  std::string out, err;
};

// `spes-engine ARGS` in `dir`, stdout and stderr kept apart.
Run run_engine(const fs::path& dir, const std::string& args) {
  const std::string cmd = "cd '" + dir.string() + "' && " + SPES_ENGINE_BIN + " " + args + " > out.txt 2> err.txt";
  const int raw = std::system(cmd.c_str());
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, read_text(dir / "out.txt"), read_text(dir / "err.txt")};
}

// A config that loads: its data need not exist for a command that fails first.
const char* kConfig = R"([model]
vocab_size = 256
d_model = 32
n_layers = 1
n_heads = 2
n_kv_heads = 2
n_experts = 4
top_k = 2
expert_hidden = 32
seq_len = 32
[train]
device = "cpu"
[data]
train = "missing/train.manifest"
[spes]
sync_steps = 10
coordinator = "127.0.0.1:29893"
state_dir = "coordinator-state"
)";

// kConfig on real token data (the shipped corpus's first 60 kB, tokenized in dir):
// [data] train and validation.
std::string trainable_config(const fs::path& dir) {
  {
    std::ifstream in(std::string(SPES_SOURCE_DIR) + "/data/corpus/tinyshakespeare.txt");
    std::string text(60000, '\0');
    in.read(text.data(), std::streamsize(text.size()));
    std::ofstream(dir / "corpus.txt") << text;
  }
  REQUIRE(run_engine(dir, "tokenize --input corpus.txt --out data --val-fraction 0.1 --threads 1").status == 0);
  std::string config = kConfig;
  const std::string from = "train = \"missing/train.manifest\"";
  config.replace(config.find(from), from.size(), "train = \"data/train.manifest\"\nvalidation = \"data/val.manifest\"");
  return config;
}

}  // namespace

TEST_CASE("command-line values out of range: one line naming the flag, exit 2, nothing started") {
  TempDir dir("cli-args");
  { std::ofstream(dir.path / "c.toml") << kConfig; }
  struct Case {
    std::string args, expect;
  };
  const std::vector<Case> cases = {
      // -1 was the "not given" mark and trained as node 0.
      {"train c.toml --node-id -1", "spes-engine train: --node-id -1: expected a node id >= 0"},
      // 70000 was cut to 16 bits and the coordinator listened on port 4464.
      {"coordinator c.toml --fresh --port 70000", "spes-engine coordinator: --port 70000: expected 0..65535"},
      {"coordinator c.toml --rollback-to -1", "spes-engine coordinator: --rollback-to -1: expected a round >= 0"},
      // Was "no validation data".
      {"eval c.toml --checkpoint ck --batches -1", "spes-engine eval: --batches must be ≥ 0 (0 = all)"},
      // NaN passed "< 0" and sampled the same text for every seed.
      {"generate --checkpoint ck --temperature nan", "spes-engine generate: --temperature must be ≥ 0"},
      {"generate --checkpoint ck --seed -1", "spes-engine generate: --seed must be ≥ 0"},
      // These fell back to defaults, or printed the table before failing.
      {"plan c.toml --micro-batch 0", "spes-engine plan: --micro-batch must be ≥ 1"},
      {"plan c.toml --link 1Gbit --step-ms nan", "spes-engine plan: --step-ms: a positive time, with --link"},
      {"plan c.toml --memory 80XB", "spes-engine plan: --memory 80XB: expected a size such as 80GiB"},
      {"plan c.toml --memory nanGiB", "spes-engine plan: --memory nanGiB: expected a size such as 80GiB"},
      {"plan c.toml --link 1Gbit --set spes.sync_steps=0",
       "spes-engine plan: --link: c.toml has no sync rounds ([spes] sync_steps = 0)"},
      {"upcycle --checkpoint ck --config c.toml --out up --noise -1", "spes-engine upcycle: --noise must be >= 0"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.args);
    const Run r = run_engine(dir.path, c.args);
    CHECK(r.status == 2);
    CHECK(r.out.empty());
    CHECK(r.err == c.expect + "\n");
  }
  CHECK_FALSE(fs::exists(dir.path / "coordinator-state"));
}

TEST_CASE("local: a missing data manifest stops it before the coordinator starts") {
  TempDir dir("cli-local");
  { std::ofstream(dir.path / "c.toml") << kConfig; }
  const Run r = run_engine(dir.path, "local c.toml --set spes.n_nodes=2 --set spes.experts_per_node=2");
  CHECK(r.status == 1);
  const std::string manifest = (dir.path / "missing" / "train.manifest").string();
  CHECK(r.err == "spes-engine: error: manifest " + manifest + ": not found\n");
  CHECK_FALSE(fs::exists(dir.path / "coordinator-state"));  // before: round 0 written, then one error per node
}

TEST_CASE("a config path that is a folder, and a model larger than memory: one line, exit 1") {
  TempDir dir("cli-memory");
  fs::create_directories(dir.path / "folder");
  Run r = run_engine(dir.path, "train folder");
  CHECK(r.status == 1);
  CHECK(r.err == "spes-engine: error: folder: is a folder, not a TOML config file\n");
  // The parameters alone: 2e9 x 4096 floats. Was "std::bad_alloc".
  { std::ofstream(dir.path / "huge.toml") << kConfig; }
  r = run_engine(dir.path, "train huge.toml --set model.vocab_size=2000000000 --set model.d_model=4096 "
                           "--set model.n_heads=32 --set model.n_kv_heads=32");
  CHECK(r.status == 1);
  CAPTURE(r.err);
  CHECK(r.err.starts_with("spes-engine: error: out of host memory: "));
  CHECK(r.err.find('\n') == r.err.size() - 1);
}

TEST_CASE("eval: CSV on stdout; with --data the config's training manifest need not exist") {
  TempDir dir("cli-eval");
  { std::ofstream(dir.path / "c.toml") << trainable_config(dir.path); }
  const std::string train = "train c.toml --set train.steps=2 --set train.micro_batch=2 --set train.global_batch=2 "
                            "--set train.threads=1 --set spes.sync_steps=0 --set 'checkpoint.dir=\"ck\"'";
  REQUIRE(run_engine(dir.path, train).status == 0);
  const Run with_config = run_engine(dir.path, "eval c.toml --checkpoint ck --batches 2 --set train.threads=1");
  CHECK(with_config.status == 0);
  CAPTURE(with_config.err);
  CHECK(with_config.out.starts_with("checkpoint,step,tokens,ce,perplexity\nck,2,"));
  // The same checkpoint and validation data, the config's training manifest gone.
  const Run with_data = run_engine(dir.path, "eval c.toml --checkpoint ck --batches 2 --data data/val.manifest "
                                             "--set 'data.train=\"gone.manifest\"' --set train.threads=1");
  CHECK(with_data.status == 0);
  CAPTURE(with_data.err);
  CHECK(with_data.out == with_config.out);
}

TEST_CASE("train: SIGINT and SIGTERM stop it after the step under way, with a checkpoint of that step") {
  TempDir dir("cli-signal");
  { std::ofstream(dir.path / "c.toml") << trainable_config(dir.path); }
  for (const int sig : {SIGINT, SIGTERM}) {
    CAPTURE(sig);
    const std::string name = sig == SIGINT ? "int" : "term", ck = "ck-" + name;
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      const std::string cmd = "cd '" + dir.path.string() + "' && exec " + SPES_ENGINE_BIN +
                              " train c.toml --set train.steps=100000 --set train.threads=1 --set spes.sync_steps=0 "
                              "--set train.eval_every=0 --set 'checkpoint.dir=\"" + ck + "\"' > " + name + ".csv 2> " + name +
                              ".err";
      execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
      _exit(127);
    }
    // Once it has trained 5 steps: its handler is in place.
    for (int i = 0; i < 600 && read_text(dir.path / (name + ".csv")).find("\n5,") == std::string::npos; ++i)
      usleep(20000);
    kill(pid, sig);
    int status = 0;
    waitpid(pid, &status, 0);
    const std::string out = read_text(dir.path / (name + ".csv")), err = read_text(dir.path / (name + ".err"));
    INFO("stderr:\n" << err);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 128 + sig);
    CHECK(err.find(std::string(strsignal(sig)) + ": stopping at step ") != std::string::npos);
    // The checkpoint is of the last step the CSV shows.
    const std::string last_row = out.substr(out.rfind('\n', out.size() - 2) + 1);
    const std::string step = last_row.substr(0, last_row.find(','));
    char folder[32];
    std::snprintf(folder, sizeof folder, "step-%08lld", std::stoll(step));
    CHECK(fs::exists(dir.path / ck / folder / "state.bin"));
  }
}

TEST_CASE("a new run over an earlier run's checkpoints or coordinator state is refused, naming them") {
  TempDir dir("cli-earlier");
  { std::ofstream(dir.path / "c.toml") << trainable_config(dir.path); }
  const std::string train = "train c.toml --set train.steps=2 --set train.threads=1 --set spes.sync_steps=0 "
                            "--set train.eval_every=0 --set 'checkpoint.dir=\"ck\"'";
  REQUIRE(run_engine(dir.path, train).status == 0);
  // Run B over run A's folder: its --resume would have taken A's step 2, and pruning
  // would have dropped B's own checkpoints.
  Run r = run_engine(dir.path, train + " --set optim.lr=0.01");
  CHECK(r.status == 1);
  CHECK(r.out.empty());
  CHECK(r.err == "spes-engine: error: " + (dir.path / "ck").string() +
                     " holds a checkpoint of an earlier run (step-00000002): `train --resume` continues it; a new run "
                     "needs another [checkpoint] dir, or that one removed\n");
  CHECK(run_engine(dir.path, train + " --resume").status == 0);
  // local: the coordinator's state of an earlier run.
  fs::create_directories(dir.path / "coordinator-state");
  { std::ofstream(dir.path / "coordinator-state" / "coordinator_state.bin") << "earlier"; }
  r = run_engine(dir.path, "local c.toml --set spes.n_nodes=2 --set spes.experts_per_node=2");
  CHECK(r.status == 1);
  CHECK(r.err == "spes-engine: error: " + (dir.path / "coordinator-state" / "coordinator_state.bin").string() +
                     " is an earlier run's: `local --resume` continues it; a new run needs another [spes] state_dir, "
                     "or that one removed\n");
}

TEST_CASE("coordinator --fresh: a missing TLS file or a short secret is refused before round 0 is written") {
  TempDir dir("cli-coordinator-tls");
  { std::ofstream(dir.path / "c.toml") << kConfig; }
  Run r = run_engine(dir.path, "coordinator c.toml --fresh --set 'spes.tls_ca=\"certs/ca.crt\"'");
  CHECK(r.status == 1);
  CHECK(r.err.find("certs/ca.crt does not exist") != std::string::npos);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(!fs::exists(dir.path / "coordinator-state" / "coordinator_state.bin"));
  { std::ofstream(dir.path / "short.secret") << "too short"; }
  r = run_engine(dir.path, "coordinator c.toml --fresh --set 'spes.secret_file=\"short.secret\"'");
  CHECK(r.status == 1);
  CHECK(r.err.find("short.secret") != std::string::npos);
  CHECK(!fs::exists(dir.path / "coordinator-state" / "coordinator_state.bin"));
}
