// configs/spes-slurm.sbatch end to end on one machine, with tests/fake_slurm's srun
// and scontrol standing in for SLURM's: a 2-node run to the end; the same run
// stopped as `scancel --signal=TERM JOB` stops it (SIGTERM to every task, the
// coordinator's included), every node at one sync round with a checkpoint of it; and
// resubmitted with --resume, ending bit for bit as the run that was never stopped.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "engine/config.hpp"
#include "stopped_run.hpp"
#include "test_util.hpp"

using namespace spes;

namespace {

// A 2-node SPES config (a round every 2 steps) in dir; returns its path.
std::string write_config(const test::TempDir& dir) {
  Config c = test::small_config(dir.path, {"spes.n_nodes=2", "spes.ownership=\"partitioned\"", "spes.sync_steps=2",
                                           "spes.run_id=\"slurm-test\"", "spes.round_timeout_s=60",
                                           "spes.state_dir=\"" + (dir / "coordinator") + "\"", "train.steps=120",
                                           "optim.decay_steps=120", "train.eval_every=0", "checkpoint.every=0"});
  const std::string path = dir / "run.toml";
  std::ofstream(path) << config_to_toml(c);
  return path;
}

// The shell command that submits the script in dir as job `job` (its outputs land there).
std::string sbatch(const test::TempDir& dir, const std::string& job, int port, const std::string& args) {
  return "cd '" + dir.path.string() + "' && exec env PATH='" + SPES_SOURCE_DIR + "/tests/fake_slurm':\"$PATH\"" +
         " SLURM_JOB_ID=" + job + " SLURM_JOB_NODELIST=localhost SLURM_NNODES=2 SLURM_CPUS_PER_TASK=1" +
         " SPES_ENGINE='" + SPES_ENGINE_BIN + "' SPES_PORT=" + std::to_string(port) + " FAKE_SLURM_PIDS=pids-" + job +
         " bash '" + SPES_SOURCE_DIR + "/configs/spes-slurm.sbatch' " + args + " > sbatch-" + job + ".log 2>&1";
}

int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

}  // namespace

TEST_CASE("spes-slurm.sbatch: scancel --signal=TERM stops every node at one round; --resume ends bit for bit") {
  test::TempDir ref("slurm-ref"), dir("slurm-stop");
  const std::string ref_config = write_config(ref), config = write_config(dir);
  {
    const int rc = exit_code(std::system(sbatch(ref, "101", test::pick_port(), ref_config).c_str()));
    INFO("the script's output:\n" << test::read_text(ref / "sbatch-101.log"));
    REQUIRE(rc == 0);
  }

  // The same run, stopped once node 0's CSV shows step 20.
  const int port = test::pick_port();
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", sbatch(dir, "102", port, config).c_str(), nullptr);
    _exit(127);
  }
  const std::string csv0 = dir / "train-102-r0-0.csv";
  for (int i = 0; i < 1500 && test::read_text(csv0).find("\n20,") == std::string::npos; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::istringstream pids(test::read_text(dir / "pids-102"));
  int tasks = 0;
  for (pid_t task; pids >> task; ++tasks) ::kill(task, SIGTERM);  // scancel --signal=TERM: every task
  CHECK(tasks == 3);  // the coordinator and two nodes
  int status = 0;
  waitpid(pid, &status, 0);
  const std::string log = test::read_text(dir / "sbatch-102.log");
  INFO("the stopped script's output:\n" << log);
  REQUIRE(exit_code(status) == 128 + SIGTERM);  // 0 would mean it ran to the end first: nothing stopped
  CHECK(log.find("--resume` continues the run") != std::string::npos);
  test::check_stopped_at_one_round(dir, 2, 120);

  {
    const int rc = exit_code(std::system(sbatch(dir, "103", test::pick_port(), config + " --resume").c_str()));
    INFO("the resumed script's output:\n" << test::read_text(dir / "sbatch-103.log"));
    REQUIRE(rc == 0);
  }
  test::check_ends_as(ref, dir, 120);
}
