// `spes-engine train CONFIG [--set section.key=value]... [--node-id N] [--resume]`:
// one node of a run. CSV rows on stdout, logs on stderr. Under SLURM (srun), the
// task id is the node id (engine/slurm.hpp).
#include <signal.h>

#include <atomic>
#include <cstdlib>
#include <iostream>

#include "engine/args.hpp"
#include "engine/base/log.hpp"
#include "engine/checkpoint.hpp"
#include "engine/commands.hpp"
#include "engine/config.hpp"
#include "engine/net_sync.hpp"
#include "engine/slurm.hpp"
#include "engine/trainer.hpp"

namespace spes {

namespace {

std::atomic<int> g_signal{0};  // the SIGINT or SIGTERM that asked the run to stop

// The first SIGINT / SIGTERM stops the run with a checkpoint (Trainer::stop_on_signal:
// after the step under way, or at the next sync round); a second, of either kind,
// ends the process as the signal would have.
void on_stop_signal(int sig) {
  if (g_signal.exchange(sig) != 0) {
    signal(sig, SIG_DFL);
    raise(sig);
  }
}

void stop_on_signals() {
  static_assert(std::atomic<int>::is_always_lock_free, "stored from a signal handler");
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

}  // namespace

int train_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  ConfigArgs a;
  bool resume = false;
  po::options_description opts;
  a.declare(opts);
  opts.add_options()("resume", po::bool_switch(&resume), "continue from the newest checkpoint");
  if (!parse_args(args, opts, "spes-engine train CONFIG [--set section.key=value]... [--node-id N] [--resume]"))
    return 0;
  stop_on_signals();  // from the start: a signal while the model and data load stops the run at its first step
  Config c = a.load();
  // Under srun: this task is node SLURM_PROCID of SLURM_NTASKS (unless --node-id says otherwise).
  if (const auto task = slurm_task([](const char* name) { return std::getenv(name); }); task && !a.node_id) {
    ConfigArgs with_slurm = a;
    for (const std::string& s : slurm_overrides(*task, c.spes.coordinator, std::getenv("SPES_COORDINATOR")))
      with_slurm.sets.push_back(s);
    c = with_slurm.load();
    log_line("[slurm]", "task %lld of %lld: node %lld, coordinator %s", (long long)task->node_id,
             (long long)task->n_nodes, (long long)c.spes.node_id, c.spes.coordinator.c_str());
  }
  check_tokenizer(c);
  if (!resume) refuse_earlier_checkpoint(c, "train");
  // Resuming from a checkpoint: θ comes from it, so [train] init is not read
  // (a large file, and it may be gone by now).
  if (resume && !latest_checkpoint(node_checkpoint_root(c)).empty()) c.train.init.clear();
  Trainer t(c);
  // Before run(): θ is still the initial θ (initial_theta) the sync base starts from.
  if (c.spes.sync_steps > 0) t.set_sync_hook(make_net_sync_hook(c, t.layout(), t.ownership(), t.theta().data()));
  t.stop_on_signal(&g_signal);
  t.run(std::cout, resume);
  if (g_signal.load()) return 128 + g_signal.load();  // as a shell reports a process the signal stopped
  return t.stopped_by_run() ? kExitStoppedByRun : 0;
}

}  // namespace spes
