// `spes-engine local CONFIG [--resume]`: the coordinator and every node of the
// config on this machine, as separate processes (the same binary re-executed), with one CSV on
// stdout: each node's rows prefixed by a `node` column. The coordinator's round rows
// go to <state_dir>/rounds.csv and, prefixed, to stderr. Ctrl-C or any process
// failing stops them all; the failure is named.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/program_options.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "data/token_file.hpp"
#include "engine/args.hpp"
#include "engine/commands.hpp"
#include "engine/config.hpp"
#include "engine/trainer.hpp"
#include "engine/base/csv.hpp"
#include "engine/base/error.hpp"
#include "engine/base/format.hpp"
#include "engine/base/log.hpp"
#include "engine/base/progress.hpp"
#include "net/global_state.hpp"
#ifdef SPES_HAVE_CUDA
#include "cuda/device_probe.hpp"
#endif

namespace spes {

namespace {

volatile sig_atomic_t g_interrupted = 0;  // SIGINT / SIGTERM received, counted
void on_signal(int) { g_interrupted = g_interrupted + 1; }

struct Child {
  std::string name;  // "coordinator" or "node N"
  int node = -1;     // -1 for the coordinator
  pid_t pid = -1;
  int out_fd = -1;   // its stdout (CSV rows)
  int err_fd = -1;   // its stderr (log lines), relayed so they never run into the progress line
  std::string pending, pending_err;  // partial lines
  bool running = true;
  int status = 0;
};

std::string self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw Error("local: cannot find the spes-engine binary (/proc/self/exe)");
  return p.string();
}

// gpus non-empty: the child sees only those devices (CUDA_VISIBLE_DEVICES, e.g.
// "2,3"), so nodes share a machine's GPUs out; empty leaves the environment alone.
Child spawn(const std::string& name, int node, const std::vector<std::string>& args, const std::string& gpus = "") {
  int fds[2], efds[2];
  if (pipe(fds) != 0 || pipe(efds) != 0) throw Error("local: pipe: " + std::string(std::strerror(errno)));
  const pid_t pid = fork();
  if (pid < 0) throw Error("local: fork: " + std::string(std::strerror(errno)));
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    dup2(efds[1], STDERR_FILENO);
    for (int fd : {fds[0], fds[1], efds[0], efds[1]}) close(fd);
    setenv("SPES_PROGRESS", "off", 1);  // local draws one progress line for every process
    signal(SIGPIPE, SIG_DFL);           // local ignores it; an ignored signal would survive exec
    setpgid(0, 0);  // a terminal's Ctrl-C reaches local alone, which stops the processes in order
    prctl(PR_SET_PDEATHSIG, SIGTERM);   // local gone (even killed): its processes stop too
    if (!gpus.empty()) setenv("CUDA_VISIBLE_DEVICES", gpus.c_str(), 1);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    std::fprintf(stderr, "local: exec %s: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  close(fds[1]);
  close(efds[1]);
  fcntl(fds[0], F_SETFD, FD_CLOEXEC);
  fcntl(efds[0], F_SETFD, FD_CLOEXEC);
  Child c;
  c.name = name;
  c.node = node;
  c.pid = pid;
  c.out_fd = fds[0];
  c.err_fd = efds[0];
  return c;
}

// A child's exit status as `local` expects it: 0, or once every child was sent SIGTERM,
// train's 128 + SIGTERM (it stopped with a checkpoint) or kExitStoppedByRun (another
// node's stop reached it first).
bool ended_as_asked(int status, bool stopping) {
  if (!WIFEXITED(status)) return false;
  const int code = WEXITSTATUS(status);
  return code == 0 || (stopping && (code == 128 + SIGTERM || code == kExitStoppedByRun));
}

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + strsignal(WTERMSIG(status));
  return "unknown status";
}

class Launcher {
 public:
  // rounds_has_header: the round log already holds rows of this run (--resume).
  Launcher(std::ostream& csv, std::ofstream& rounds, bool rounds_has_header, int64_t n_nodes, int64_t steps)
      : csv_(csv), rounds_(rounds), rounds_header_done_(rounds_has_header), nodes_(size_t(n_nodes)), steps_(steps),
        progress_("local:", 30.0) {}

  std::vector<Child> children;

  // Reads whatever the children wrote; returns false when no pipe is open.
  bool pump(int timeout_ms) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Child*, bool>> who;  // (child, is its stderr)
    for (auto& c : children) {
      if (c.out_fd >= 0) fds.push_back({c.out_fd, POLLIN, 0}), who.push_back({&c, false});
      if (c.err_fd >= 0) fds.push_back({c.err_fd, POLLIN, 0}), who.push_back({&c, true});
    }
    if (fds.empty()) return false;
    const int n = poll(fds.data(), fds.size(), timeout_ms);
    if (n <= 0) return true;
    char buf[65536];
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto [child, is_err] = who[i];
      int& fd = is_err ? child->err_fd : child->out_fd;
      std::string& pending = is_err ? child->pending_err : child->pending;
      const ssize_t got = read(fd, buf, sizeof buf);
      if (got <= 0) {
        close(fd);
        fd = -1;
        if (!pending.empty()) is_err ? log_raw(pending.c_str()) : line(*child, pending);
        pending.clear();
        continue;
      }
      pending.append(buf, size_t(got));
      size_t nl;
      while ((nl = pending.find('\n')) != std::string::npos) {
        const std::string text = pending.substr(0, nl);
        is_err ? log_raw(text.c_str()) : line(*child, text);
        pending.erase(0, nl + 1);
      }
    }
    return true;
  }

  // Collects exited children; returns the first that failed, if any. stopping: the
  // children were asked to stop (SIGTERM), so ending by it is no failure either.
  Child* reap(bool stopping = false) {
    Child* failed = nullptr;
    for (auto& c : children) {
      if (!c.running) continue;
      int status = 0;
      if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
        c.running = false;
        c.status = status;
        if (!ended_as_asked(status, stopping) && !failed) failed = &c;
      }
    }
    return failed;
  }

  void signal_all(int sig) {
    for (auto& c : children)
      if (c.running) kill(c.pid, sig);
  }
  void signal_nodes(int sig) {
    for (auto& c : children)
      if (c.running && c.node >= 0) kill(c.pid, sig);
  }

  // SIGTERM, then SIGKILL after a grace period, pumping output meanwhile.
  void stop_all() {
    signal_all(SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (any_running() && std::chrono::steady_clock::now() < deadline) {
      pump(100);
      reap();
    }
    signal_all(SIGKILL);
    while (any_running()) {
      pump(50);
      reap();
    }
    while (pump(0)) {
    }
  }

  // What could not be written (the CSV on stdout, the round log); "" when all was.
  const std::string& output_error() const { return output_error_; }

  bool any_running() const {
    for (const auto& c : children)
      if (c.running) return true;
    return false;
  }
  bool nodes_running() const {
    for (const auto& c : children)
      if (c.running && c.node >= 0) return true;
    return false;
  }

 private:
  // The first output that failed is what stops the run (output_error).
  void check_written(const std::ostream& out, const char* what) {
    if (!out && output_error_.empty()) output_error_ = std::string(what) + " could not be written (file system full?)";
  }

  void line(const Child& c, const std::string& text) {
    if (c.node < 0) {
      // Coordinator rows: to the rounds file, and visible on stderr.
      const bool header = text.rfind("round,", 0) == 0;
      if (header && rounds_header_done_) return;
      rounds_header_done_ = rounds_header_done_ || header;
      rounds_ << text << "\n";
      rounds_.flush();
      check_written(rounds_, "the round log");
      log_line("[coordinator]", "%s", text.c_str());
      return;
    }
    const bool header = text.rfind("step,", 0) == 0;
    if (header) {
      columns_ = split(text);
      if (header_done_) return;
      header_done_ = true;
      csv_ << "node," << text << std::endl;
      check_written(csv_, "the CSV on stdout");
      return;
    }
    csv_ << c.node << "," << text << std::endl;
    check_written(csv_, "the CSV on stdout");
    track(c.node, split(text));
  }

  // One progress line for every node: the slowest node's step, each node's loss,
  // the total throughput, the last sync round.
  void track(int node, const std::vector<std::string>& row) {
    auto col = [&](const char* name) -> std::string {
      for (size_t i = 0; i < columns_.size() && i < row.size(); ++i)
        if (columns_[i] == name) return row[i];
      return "";
    };
    if (node < 0 || size_t(node) >= nodes_.size()) return;
    NodeProgress& p = nodes_[size_t(node)];
    try {
      p.step = std::stoll(col("step"));
      p.loss = std::stod(col("loss"));
      p.tokens_per_s = std::stod(col("tokens_per_s"));
      const int64_t r = std::stoll(col("sync_round"));
      if (r > 0) round_ = std::max(round_, r);
    } catch (const std::exception&) {
      return;  // not a row of numbers: nothing to show
    }
    int64_t slowest = INT64_MAX;
    double tps = 0;
    std::string losses;
    for (const NodeProgress& n : nodes_) {
      slowest = std::min(slowest, n.step);
      tps += n.tokens_per_s;
      losses += strprintf(" %.3f", n.loss);
    }
    const std::string line = strprintf("step %lld/%lld  loss", (long long)slowest, (long long)steps_) + losses +
                             strprintf("  %.0f tok/s  round %lld  ETA ", tps, (long long)round_) +
                             progress_.eta(double(slowest), double(steps_));
    progress_.update(line, slowest == steps_);
  }

  static std::vector<std::string> split(const std::string& line) {
    std::vector<std::string> out;
    size_t a = 0;
    for (size_t b; (b = line.find(',', a)) != std::string::npos; a = b + 1) out.push_back(line.substr(a, b - a));
    out.push_back(line.substr(a));
    return out;
  }

  struct NodeProgress {
    int64_t step = 0;
    double loss = 0, tokens_per_s = 0;
  };
  std::ostream& csv_;
  std::ofstream& rounds_;
  bool header_done_ = false;
  bool rounds_header_done_;
  std::vector<std::string> columns_;
  std::string output_error_;
  std::vector<NodeProgress> nodes_;
  int64_t steps_;
  int64_t round_ = 0;
  Progress progress_;
};

}  // namespace

int local_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  std::string config;
  std::vector<std::string> sets;
  bool resume = false;
  po::options_description opts;
  opts.add_options()("config", po::value(&config)->required(), "TOML config")(
      "set", po::value(&sets)->composing(), "override a config key for every process: section.key=value")(
      "resume", po::bool_switch(&resume), "continue the run: nodes from their checkpoints, the coordinator from its state");
  if (!parse_args(args, opts, "spes-engine local CONFIG [--set section.key=value]... [--resume]")) return 0;
  const Config c = load_config(config, sets);  // validated once here, before anything starts
  check_tokenizer(c);
  // The nodes' data before anything starts: a missing manifest is one line here, not
  // one per node after the coordinator has written its first round.
  read_manifest(c.data.train);
  if (!c.data.validation.empty()) read_manifest(c.data.validation);
  // A new run over an earlier one's state would replace the coordinator's and leave
  // the nodes' checkpoints for a later --resume to mix with the new run.
  if (!resume) {
    const std::string state = (std::filesystem::path(c.spes.state_dir) / net::kCoordinatorStateFile).string();
    if (c.spes.sync_steps > 0 && std::filesystem::exists(state))
      throw ConfigError(state + " is an earlier run's: `local --resume` continues it; a new run needs another "
                       "[spes] state_dir, or that one removed");
    for (int64_t n = 0; n < c.spes.n_nodes; ++n) {
      Config node = c;
      node.spes.node_id = n;
      refuse_earlier_checkpoint(node, "local");
    }
  }
  if (c.spes.sync_steps == 0)
    std::fprintf(stderr, "local: [spes] sync_steps = 0: nodes train independently (no sync rounds)\n");
  // Share the cores: a node left at "all cores" would oversubscribe the machine
  // n_nodes times over, and OpenMP spinning makes that far slower than splitting.
  if (c.train.threads == 0) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    sets.push_back("train.threads=" + std::to_string(std::max<int64_t>(1, int64_t(cores) / c.spes.n_nodes)));
  }
  std::filesystem::create_directories(c.spes.state_dir);
  const std::string rounds_path = (std::filesystem::path(c.spes.state_dir) / "rounds.csv").string();
  // A new run starts a new round log; --resume appends to it.
  std::ofstream rounds(rounds_path, resume ? std::ios::app : std::ios::trunc);
  if (!rounds) throw Error("local: cannot write " + rounds_path);

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  const std::string exe = self_exe();
  auto with_sets = [&](std::vector<std::string> args) {
    for (const auto& s : sets) {
      args.push_back("--set");
      args.push_back(s);
    }
    return args;
  };
  Launcher L(std::cout, rounds, resume && std::filesystem::file_size(rounds_path) > 0, c.spes.n_nodes, c.train.steps);
  // Several nodes on a machine with several GPUs: each node gets its share — a block
  // of gpus / n_nodes devices, or GPU n mod count when there are fewer GPUs than
  // nodes (unless the user chose devices with [train] gpus or CUDA_VISIBLE_DEVICES).
  int gpus = 0;
#ifdef SPES_HAVE_CUDA
  if (c.train.device != Device::cpu && c.train.gpus.empty() && !std::getenv("CUDA_VISIBLE_DEVICES") && c.spes.n_nodes > 1)
    gpus = cuda::gpu_count();
#endif
  auto node_gpus = [&](int64_t n) {
    if (gpus <= 1) return std::string();
    if (gpus < c.spes.n_nodes) return std::to_string(n % gpus);
    const int64_t k = gpus / c.spes.n_nodes;
    std::string list;
    for (int64_t g = n * k; g < (n + 1) * k; ++g) {
      if (!list.empty()) list += ',';
      list += std::to_string(g);
    }
    return list;
  };
  // A new run starts the coordinator --fresh too: otherwise it would resume the
  // previous run's θ from state_dir and hand it to nodes starting at step 0.
  std::vector<std::string> coordinator = {exe, "coordinator", config, resume ? "" : "--fresh"};
  if (resume) coordinator.pop_back();
  if (c.spes.sync_steps > 0) L.children.push_back(spawn("coordinator", -1, with_sets(coordinator)));
  for (int64_t n = 0; n < c.spes.n_nodes; ++n) {
    std::vector<std::string> node = {exe, "train", config, "--node-id", std::to_string(n)};
    if (resume) node.push_back("--resume");
    L.children.push_back(spawn("node " + std::to_string(n), int(n), with_sets(node), node_gpus(n)));
  }
  std::fprintf(stderr, "local: coordinator + %lld nodes started; round log %s\n", (long long)c.spes.n_nodes,
               rounds_path.c_str());

  int rc = 0;
  bool stopping = false, forced = false;  // interrupted once: the nodes stop at a round; twice: at once
  while (true) {
    L.pump(200);
    if (!L.output_error().empty()) {
      log_line("local:", "%s; stopping every process", L.output_error().c_str());
      rc = 1;
      break;
    }
    if (g_interrupted && !stopping) {
      // Each node asks the run to stop in its next push, and every node stops at the
      // round whose result ends the run, with a checkpoint of it (net/README.md,
      // Stopping a run); without sync rounds each node stops after its step. The
      // coordinator is stopped once the nodes are done: asked now, it would end the run
      // at once if no node had joined it yet.
      stopping = true;
      rc = 130;
      L.signal_nodes(SIGTERM);
      log_line("local:", "interrupted: every node stops %s, with a checkpoint (local --resume continues); "
               "interrupt again to stop every process at once",
               c.spes.sync_steps > 0 ? "at the next sync round" : "after its step");
    } else if (g_interrupted > 1) {
      log_line("local:", "interrupted again: stopping every process now");
      forced = true;
      break;
    }
    if (Child* failed = L.reap(stopping)) {
      // Relay what it wrote before it exited, so its error comes before ours.
      for (int i = 0; i < 100 && (failed->err_fd >= 0 || failed->out_fd >= 0); ++i) L.pump(20);
      log_line("local:", "%s failed (%s; its error is above); stopping the others", failed->name.c_str(),
               describe_exit(failed->status).c_str());
      rc = 1;
      break;
    }
    if (!L.nodes_running()) break;  // every node finished its steps
  }
  L.stop_all();
  if (rc == 0) log_line("local:", "every node finished");
  if (stopping && !forced && rc == 130)
    log_line("local:", "stopped: every node wrote a checkpoint; local --resume continues");
  return rc;
}

}  // namespace spes
