// `spes-engine local CONFIG [--resume]`: the coordinator and every node of the
// config on this machine, as separate processes (the same binary re-executed), with one CSV on
// stdout: each node's rows prefixed by a `node` column. The coordinator's round rows
// go to <state_dir>/rounds.csv and, prefixed, to stderr. Ctrl-C or any process
// failing stops them all; the failure is named.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
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

#include "engine/args.hpp"
#include "engine/commands.hpp"
#include "engine/config.hpp"
#include "engine/base/error.hpp"

namespace spes {

namespace {

volatile sig_atomic_t g_interrupted = 0;
void on_signal(int) { g_interrupted = 1; }

struct Child {
  std::string name;  // "coordinator" or "node N"
  int node = -1;     // -1 for the coordinator
  pid_t pid = -1;
  int out_fd = -1;   // its stdout
  std::string pending;  // partial line
  bool running = true;
  int status = 0;
};

std::string self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw Error("local: cannot find the spes-engine binary (/proc/self/exe)");
  return p.string();
}

Child spawn(const std::string& name, int node, const std::vector<std::string>& args) {
  int fds[2];
  if (pipe(fds) != 0) throw Error("local: pipe: " + std::string(std::strerror(errno)));
  const pid_t pid = fork();
  if (pid < 0) throw Error("local: fork: " + std::string(std::strerror(errno)));
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    std::fprintf(stderr, "local: exec %s: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  close(fds[1]);
  fcntl(fds[0], F_SETFD, FD_CLOEXEC);
  Child c;
  c.name = name;
  c.node = node;
  c.pid = pid;
  c.out_fd = fds[0];
  return c;
}

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + strsignal(WTERMSIG(status));
  return "unknown status";
}

class Launcher {
 public:
  // rounds_has_header: the round log already holds rows of this run (--resume).
  Launcher(std::ostream& csv, std::ofstream& rounds, bool rounds_has_header)
      : csv_(csv), rounds_(rounds), rounds_header_done_(rounds_has_header) {}

  std::vector<Child> children;

  // Reads whatever the children wrote; returns false when no pipe is open.
  bool pump(int timeout_ms) {
    std::vector<pollfd> fds;
    std::vector<Child*> who;
    for (auto& c : children)
      if (c.out_fd >= 0) {
        fds.push_back({c.out_fd, POLLIN, 0});
        who.push_back(&c);
      }
    if (fds.empty()) return false;
    const int n = poll(fds.data(), fds.size(), timeout_ms);
    if (n <= 0) return true;
    char buf[65536];
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const ssize_t got = read(fds[i].fd, buf, sizeof buf);
      if (got <= 0) {
        close(who[i]->out_fd);
        who[i]->out_fd = -1;
        continue;
      }
      who[i]->pending.append(buf, size_t(got));
      size_t nl;
      while ((nl = who[i]->pending.find('\n')) != std::string::npos) {
        line(*who[i], who[i]->pending.substr(0, nl));
        who[i]->pending.erase(0, nl + 1);
      }
    }
    return true;
  }

  // Collects exited children; returns the first that failed, if any.
  Child* reap() {
    Child* failed = nullptr;
    for (auto& c : children) {
      if (!c.running) continue;
      int status = 0;
      if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
        c.running = false;
        c.status = status;
        if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0) && !failed) failed = &c;
      }
    }
    return failed;
  }

  void signal_all(int sig) {
    for (auto& c : children)
      if (c.running) kill(c.pid, sig);
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
  void line(const Child& c, const std::string& text) {
    if (c.node < 0) {
      // Coordinator rows: to the rounds file, and visible on stderr.
      const bool header = text.rfind("round,", 0) == 0;
      if (header && rounds_header_done_) return;
      rounds_header_done_ = rounds_header_done_ || header;
      rounds_ << text << "\n";
      rounds_.flush();
      std::fprintf(stderr, "[coordinator] %s\n", text.c_str());
      return;
    }
    const bool header = text.rfind("step,", 0) == 0;
    if (header) {
      if (header_done_) return;
      header_done_ = true;
      csv_ << "node," << text << std::endl;
      return;
    }
    csv_ << c.node << "," << text << std::endl;
  }

  std::ostream& csv_;
  std::ofstream& rounds_;
  bool header_done_ = false;
  bool rounds_header_done_;
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
  Launcher L(std::cout, rounds, resume && std::filesystem::file_size(rounds_path) > 0);
  // A new run starts the coordinator --fresh too: otherwise it would resume the
  // previous run's θ from state_dir and hand it to nodes starting at step 0.
  std::vector<std::string> coordinator = {exe, "coordinator", config, resume ? "" : "--fresh"};
  if (resume) coordinator.pop_back();
  if (c.spes.sync_steps > 0) L.children.push_back(spawn("coordinator", -1, with_sets(coordinator)));
  for (int64_t n = 0; n < c.spes.n_nodes; ++n) {
    std::vector<std::string> node = {exe, "train", config, "--node-id", std::to_string(n)};
    if (resume) node.push_back("--resume");
    L.children.push_back(spawn("node " + std::to_string(n), int(n), with_sets(node)));
  }
  std::fprintf(stderr, "local: coordinator + %lld nodes started; round log %s\n", (long long)c.spes.n_nodes,
               rounds_path.c_str());

  int rc = 0;
  while (true) {
    L.pump(200);
    if (Child* failed = L.reap()) {
      std::fprintf(stderr, "local: %s failed (%s; its error is above); stopping the others\n", failed->name.c_str(),
                   describe_exit(failed->status).c_str());
      rc = 1;
      break;
    }
    if (g_interrupted) {
      std::fprintf(stderr, "local: interrupted; stopping every process\n");
      rc = 130;
      break;
    }
    if (!L.nodes_running()) break;  // every node finished its steps
  }
  L.stop_all();
  if (rc == 0) std::fprintf(stderr, "local: every node finished\n");
  return rc;
}

}  // namespace spes
