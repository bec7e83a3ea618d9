// Sync round cost over loopback for a ~100M-parameter OLMoE-shaped state, per codec:
//  0. the codecs alone: encode (node push) and apply (node pull) GB/s of fp32 θ, on
//     1 and 2 threads;
//  1. one node owning every expert: push 100M params + merge + pull, as seconds and
//     GB/s of wire bytes, next to a raw TCP copy of the same bytes on this machine;
//     the coordinator (a separate process) peak RSS over the model's fp32 bytes;
//     parts 1 and 2 run in plaintext (loopback needs no secret): part 3 prices security;
//  2. 4 nodes x 2 experts (SPES ownership): bytes per node per round next to what
//     the SPES reference sends (fp32 trained params up + full fp32 model down).
//  3. transport security, 1 node owning every expert, fp32: round time in plaintext,
//     with a MAC on every frame (shared secret) and over TLS 1.3, and the handshake
//     time of each (a tiny model, reconnecting before every round).
//  4. (--slow-link) one node owning every expert through a token-bucket throttled
//     loopback proxy at 1 Gbit/s and 100 Mbit/s each way: how long the step loop
//     waits at a round, with rounds overlapped with training or not.
//   bench_sync [--rounds N] [--small] [--codecs] [--only CODEC] [--security] [--slow-link]
//   (--small: a ~16M-parameter model, for a quick look; --codecs: only part 0; --only:
//   one codec; --security: only part 3; --slow-link: only part 4)
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "bench/throttled_link.hpp"
#include "engine/config.hpp"
#include "engine/net_sync.hpp"
#include "engine/openmp_env.hpp"
#include "model/layout.hpp"
#include "net/certs.hpp"
#include "net/codec.hpp"
#include "net/coordinator.hpp"
#include "net/sync_client.hpp"

extern char** environ;

using namespace spes;
using spes::bench::connect_loopback;
using spes::bench::listen_loopback;
using spes::bench::ThrottledProxy;
using Clock = std::chrono::steady_clock;

namespace {

// size: 0 = ~100M parameters, 1 = ~10M (--small), 2 = tiny (handshake timing).
Config bench_config(const std::string& codec, int n_nodes, int size, uint16_t port) {
  Config c;
  ModelConfig& m = c.model;
  const bool small = size >= 1;
  m.vocab_size = small ? 4096 : 16384;
  m.d_model = small ? 256 : 768;
  m.n_layers = small ? 4 : 8;
  m.n_heads = small ? 4 : 12;
  m.n_kv_heads = m.n_heads;
  m.n_experts = 8;
  m.top_k = 2;
  m.expert_hidden = small ? 512 : 384;
  m.seq_len = 1024;
  c.train.seed = 1;
  c.spes.n_nodes = n_nodes;
  c.spes.ownership = n_nodes == 1 ? OwnershipMode::all : OwnershipMode::partitioned;
  c.spes.experts_per_node = n_nodes == 1 ? 0 : m.n_experts / n_nodes;
  c.spes.codec = net::parse_codec(codec);
  c.spes.run_id = "bench";
  c.spes.coordinator = "127.0.0.1:" + std::to_string(port);
  c.spes.round_timeout_s = 600;
  c.spes.sync_steps = 1;
  // Every round is persisted before it is published: in RAM here, so the bench
  // measures the protocol and the copy, not the disk.
  c.spes.state_dir = "/dev/shm/spes-bench-sync-" + std::to_string(port);
  if (size == 2) m.vocab_size = 256, m.d_model = 64, m.n_layers = 1, m.n_heads = 2, m.n_kv_heads = 2, m.expert_hidden = 64;
  return c;
}

uint16_t free_port() {
  uint16_t port = 0;
  ::close(listen_loopback(0, &port));
  return port;
}

long proc_kib(pid_t pid, const char* key) {
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/status").c_str(), "r");
  if (!f) return 0;
  char line[256];
  long v = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, key, std::strlen(key)) == 0) v = std::atol(line + std::strlen(key));
  std::fclose(f);
  return v;
}

bool can_connect(uint16_t port) {
  const int fd = connect_loopback(port);
  if (fd >= 0) ::close(fd);
  return fd >= 0;
}

// The coordinator in its own process, so its peak RSS is its own.
// mode: "plain" (no secret), "mac" (shared secret: frame MACs), "tls" (certificates in `certs`).
pid_t spawn_coordinator(const char* self, const std::string& codec, int n_nodes, int size, uint16_t port,
                        const std::string& mode = "mac", const std::string& certs = "-") {
  std::string a0 = self, a1 = "--coordinator", a2 = codec, a3 = std::to_string(n_nodes), a4 = std::to_string(size),
              a5 = std::to_string(port), a6 = mode, a7 = certs;
  char* argv[] = {a0.data(), a1.data(), a2.data(), a3.data(), a4.data(), a5.data(), a6.data(), a7.data(), nullptr};
  pid_t pid = -1;
  if (posix_spawn(&pid, self, nullptr, nullptr, argv, environ) != 0) {
    std::perror("posix_spawn");
    std::exit(1);
  }
  while (!can_connect(port)) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return pid;
}

const char* kSecret = "bench-secret-0123456789";

net::TlsFiles tls_files(const std::string& certs, const std::string& name) {
  return {certs + "/ca.crt", certs + "/" + name + ".crt", certs + "/" + name + ".key"};
}

int coordinator_child(char** argv) {
  const Config c = bench_config(argv[2], std::atoi(argv[3]), std::atoi(argv[4]), uint16_t(std::atoi(argv[5])));
  const std::string mode = argv[6];
  net::CoordinatorParams p = coordinator_params(c);
  p.secret = mode == "plain" ? "" : kSecret;
  if (mode == "tls") p.tls = tls_files(argv[7], "coordinator");
  net::CoordinatorOptions o;
  o.log = std::getenv("SPES_BENCH_LOG") != nullptr;  // the coordinator's round log (merge ms) on stderr
  o.handle_signals = true;
  o.fresh = true;
  net::Coordinator co(std::move(p), o);
  co.run();
  return 0;
}

// A raw TCP copy of `bytes` over loopback (sender thread -> receiver), in seconds.
double raw_tcp_seconds(int64_t bytes) {
  uint16_t port = 0;
  const int lfd = listen_loopback(1, &port);
  std::vector<uint8_t> src(4 << 20, 0x5A), dst(4 << 20);
  const int cfd = connect_loopback(port);
  const int sfd = ::accept(lfd, nullptr, nullptr);
  const auto t0 = Clock::now();
  std::thread sender([&] {
    int64_t left = bytes;
    while (left > 0) {
      const ssize_t w = ::send(cfd, src.data(), size_t(std::min<int64_t>(left, int64_t(src.size()))), 0);
      if (w <= 0) break;
      left -= w;
    }
  });
  int64_t got = 0;
  while (got < bytes) {
    const ssize_t r = ::recv(sfd, dst.data(), dst.size(), 0);
    if (r <= 0) break;
    got += r;
  }
  sender.join();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  ::close(cfd);
  ::close(sfd);
  ::close(lfd);
  return s;
}

// Local "training" between rounds: a small change to every owned parameter.
void perturb(std::vector<float>& p, const Ownership& own, int round) {
  for (const Range& r : own.space.ranges())
    for (int64_t i = r.begin; i < r.end; ++i) p[size_t(i)] += 1e-4f * float(((i * 2654435761u + round) >> 7) % 200 - 100) / 100.0f;
}

// GB/s of fp32 θ through encode_update and apply_update, 1M-element chunks, `threads` each.
void codec_speed(const char* name, int threads) {
  const net::Codec c = net::parse_codec(name);
  const int64_t chunk = 1 << 20, n_chunks = 32;
  std::vector<float> theta(size_t(chunk * n_chunks)), base(theta.size()), res(theta.size(), 0.0f);
  for (size_t i = 0; i < theta.size(); ++i) base[i] = 0.02f * float(int(i % 2001) - 1000) / 1000.0f;
  for (size_t i = 0; i < theta.size(); ++i) theta[i] = base[i] + 1e-4f * float(int((i * 7919) % 201) - 100) / 100.0f;
  std::vector<uint8_t> payload(net::encoded_bytes(c, chunk));
  auto best_of = [](auto&& f) {
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = Clock::now();
      f();
      best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return best;
  };
  const double enc = best_of([&] {
    for (int64_t k = 0; k < n_chunks; ++k)
      net::encode_update(c, theta.data() + k * chunk, base.data() + k * chunk, res.data() + k * chunk,
                         res.data() + k * chunk, chunk, payload.data(), threads);
  });
  const double app = best_of([&] {
    for (int64_t k = 0; k < n_chunks; ++k)
      net::apply_update(c, payload.data(), chunk, base.data() + k * chunk, theta.data() + k * chunk, threads);
  });
  const double gb = double(theta.size()) * 4 / 1e9;
  std::printf("%-6s %7d %12.2f %12.2f\n", name, threads, gb / enc, gb / app);
  std::fflush(stdout);
}

// One node owning everything in `mode`: the best round of `rounds` (size 0/1), or
// the mean round with (reconnect) or without a new connection each time (size 2);
// link_mbit > 0: through a link emulated at that rate each way.
double mode_round_seconds(const char* self, const std::string& mode, const std::string& certs, int size, int rounds,
                          bool reconnect, double link_mbit = 0) {
  const uint16_t port = free_port();
  const Config c = bench_config("fp32", 1, size, port);
  const ParamLayout layout = make_layout(c.model);
  std::vector<float> params(size_t(layout.total));
  init_parameters(params.data(), c.model, layout, c.train.seed);
  const pid_t pid = spawn_coordinator(self, "fp32", 1, size, port, mode, certs);
  const Ownership own = make_ownership(c.model, layout, 0, 1, OwnershipMode::all, 0);
  net::SyncClientParams sp = sync_client_params(c, layout, own, params);
  sp.secret = mode == "plain" ? "" : kSecret;
  if (mode == "tls") sp.tls = tls_files(certs, "node-0");
  std::unique_ptr<ThrottledProxy> link;
  if (link_mbit > 0) {
    link = std::make_unique<ThrottledProxy>(port, link_mbit * 1e6 / 8);
    sp.coordinator = "127.0.0.1:" + std::to_string(link->port());
  }
  net::SyncClientOptions o;
  o.log = false;
  auto client_ptr = std::make_unique<net::SyncClient>(sp, o);
  net::SyncClient& client = *client_ptr;
  client.sync_round(params.data(), 0);  // connected, warm
  double best = 1e30, sum = 0;
  for (int r = 1; r <= rounds; ++r) {
    perturb(params, own, r);
    if (reconnect) client.disconnect();
    const auto t0 = Clock::now();
    client.sync_round(params.data(), r * 100);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::min(best, s), sum += s;
  }
  client_ptr.reset();  // before the link it talks through
  link.reset();
  ::kill(pid, SIGTERM);
  ::waitpid(pid, nullptr, 0);
  std::filesystem::remove_all(c.spes.state_dir);
  return size == 2 ? sum / rounds : best;
}

void security_modes(const char* self, bool small, int rounds, const ParamLayout& layout, const std::vector<float>&) {
  const std::string certs = "/tmp/bench_sync_certs_" + std::to_string(::getpid());
  net::CertRequest req;
  req.out_dir = certs;
  net::make_run_certs(req);
  std::printf("\ntransport security, 1 node owning every expert, fp32 (%.0fM params; best of %d rounds)\n",
              layout.total / 1e6, rounds);
  std::printf("%-6s %9s %10s %14s\n", "mode", "round s", "vs plain", "handshake ms");
  double plain = 0;
  for (const char* mode : {"plain", "mac", "tls"}) {
    const double s = mode_round_seconds(self, mode, certs, small ? 1 : 0, rounds, false);
    if (!std::strcmp(mode, "plain")) plain = s;
    const int n = 30;
    const double hs = mode_round_seconds(self, mode, certs, 2, n, true) - mode_round_seconds(self, mode, certs, 2, n, false);
    std::printf("%-6s %9.3f %10.2f %14.2f\n", mode, s, s / plain, hs * 1e3);
    std::fflush(stdout);
  }
  // On loopback the round is CPU-bound and the crypto shows; over the links SPES
  // runs on, the bytes bound it. One round through an emulated 1 Gbit/s link.
  std::printf("through an emulated 1 Gbit/s link (one round):\n%-6s %9s %10s\n", "mode", "round s", "vs plain");
  double plain_link = 0;
  for (const char* mode : {"plain", "tls"}) {
    const double s = mode_round_seconds(self, mode, certs, small ? 1 : 0, 1, false, 1000);
    if (!std::strcmp(mode, "plain")) plain_link = s;
    std::printf("%-6s %9.3f %10.2f\n", mode, s, s / plain_link);
    std::fflush(stdout);
  }
  std::filesystem::remove_all(certs);
}


}  // namespace

int main(int argc, char** argv) {
  default_to_short_openmp_spin(argv);  // as spes-engine does: idle OpenMP threads must not spin through a round
  if (argc >= 8 && !std::strcmp(argv[1], "--coordinator")) return coordinator_child(argv);
  int rounds = 3;
  bool small = false, codecs_only = false, slow_link = false, security_only = false;
  std::vector<const char*> codecs = {"fp32", "bf16", "int8", "sparse"};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--small")) small = true;
    else if (!std::strcmp(argv[i], "--codecs")) codecs_only = true;
    else if (!std::strcmp(argv[i], "--slow-link")) slow_link = true;
    else if (!std::strcmp(argv[i], "--security")) security_only = true;
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) codecs = {argv[++i]};
  }
  const char* self = "/proc/self/exe";
  char self_path[4096];
  const ssize_t n = ::readlink(self, self_path, sizeof self_path - 1);
  if (n > 0) self_path[n] = 0, self = self_path;

  const Config probe = bench_config("fp32", 1, small, 0);
  const ParamLayout layout = make_layout(probe.model);
  const double model_mb = double(layout.total) * 4 / 1e6;
  std::printf("bench_sync: %.1fM params (%.1f MB fp32; shared %.1fM, 8 experts x %.2fM), loopback, %d rounds each\n",
              layout.total / 1e6, model_mb, layout.shared_count / 1e6, layout.expert_block / 1e6, rounds);
  std::vector<float> init(size_t(layout.total));
  init_parameters(init.data(), probe.model, layout, probe.train.seed);

  if (security_only) {
    security_modes(self, small, rounds, layout, init);
    return 0;
  }

  // ---- 4. an emulated slow link ------------------------------------------------------
  if (slow_link) {
    constexpr double kOverlapTrainS = 3.0;  // optimizer steps between two rounds, emulated
    std::printf("\nslow link: 1 node owning every expert through a throttled loopback, one round (the step loop's "
                "wait at a round; overlap: the round runs behind %.0f s of emulated training)\n%-6s %10s %9s %9s %10s %14s\n",
                kOverlapTrainS, "codec", "link", "up MB", "down MB", "wait s", "overlap wait s");
    for (double mbit : {1000.0, 100.0})
      for (const char* codec : codecs) {
        const uint16_t port = free_port();
        const Config c = bench_config(codec, 1, small, port);
        const pid_t pid = spawn_coordinator(self, codec, 1, small, port);
        {
          ThrottledProxy proxy(port, mbit * 1e6 / 8);
          const Ownership own = make_ownership(c.model, layout, 0, 1, OwnershipMode::all, 0);
          net::SyncClientParams sp = sync_client_params(c, layout, own, init);
          sp.secret = kSecret;
          sp.coordinator = "127.0.0.1:" + std::to_string(proxy.port());
          net::SyncClientOptions o;
          o.log = false;
          net::SyncClient client(sp, o);
          std::vector<float> params = init;
          perturb(params, own, 1);
          const auto t0 = Clock::now();
          const net::RoundReport st = client.sync_round(params.data(), 100);
          const double s = std::chrono::duration<double>(Clock::now() - t0).count();
          // Overlapped: push, "train" for kOverlapTrainS, then apply the round.
          perturb(params, own, 2);
          client.start_round(params.data(), 200);
          std::this_thread::sleep_for(std::chrono::duration<double>(kOverlapTrainS));
          const auto t1 = Clock::now();
          client.finish_round(params.data());
          const double wait = std::chrono::duration<double>(Clock::now() - t1).count();
          std::printf("%-6s %5.0f Mbit/s %9.1f %9.1f %10.2f %14.2f\n", codec, mbit, st.bytes_up / 1e6, st.bytes_down / 1e6,
                      s, wait);
          std::fflush(stdout);
          client.disconnect();
          ::kill(pid, SIGTERM);
          ::waitpid(pid, nullptr, 0);
        }
        std::filesystem::remove_all(c.spes.state_dir);
      }
    return 0;
  }

  // ---- 0. the codecs alone --------------------------------------------------------
  std::printf("\ncodecs alone: GB/s of fp32 θ (1M-element chunks, best of 3)\n%-6s %7s %12s %12s\n", "codec", "threads",
              "encode GB/s", "apply GB/s");
  for (const char* codec : codecs)
    for (int threads : {1, 2}) codec_speed(codec, threads);
  if (codecs_only) return 0;

  // ---- 1. one node owning everything -------------------------------------------
  std::printf("\n1 node owning every expert: push %.0fM + merge + pull %.0fM (best round)\n", layout.total / 1e6,
              layout.total / 1e6);
  std::printf("%-6s %9s %9s %8s %7s %10s %7s %14s   %s\n", "codec", "up MB", "down MB", "seconds", "GB/s", "raw TCP s",
              "ratio", "coord RSS/model", "push / merge / pull ms");
  for (const char* codec : codecs) {
    const uint16_t port = free_port();
    const Config c = bench_config(codec, 1, small, port);
    const pid_t pid = spawn_coordinator(self, codec, 1, small, port, "plain");
    const Ownership own = make_ownership(c.model, layout, 0, 1, OwnershipMode::all, 0);
    net::SyncClientParams sp = sync_client_params(c, layout, own, init);
    sp.secret = "";  // plaintext: the codecs and the merge against raw TCP; part 3 adds security
    net::SyncClientOptions o;
    o.log = false;
    net::SyncClient client(sp, o);
    std::vector<float> params = init;
    double best = 1e30;
    net::RoundReport st, best_st;
    for (int r = 1; r <= rounds; ++r) {
      perturb(params, own, r);
      const auto t0 = Clock::now();
      st = client.sync_round(params.data(), r * 100);
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (s < best) best = s, best_st = st;
    }
    const long hwm = proc_kib(pid, "VmHWM:");
    client.disconnect();  // done: a coordinator signalled with nodes joined would wait for their next round
    ::kill(pid, SIGTERM);
    ::waitpid(pid, nullptr, 0);
    std::filesystem::remove_all(c.spes.state_dir);
    const int64_t wire = st.bytes_up + st.bytes_down;
    const double raw = raw_tcp_seconds(wire);
    std::printf("%-6s %9.1f %9.1f %8.3f %7.2f %10.3f %7.2f %14.2f   %.0f / %.0f / %.0f\n", codec, st.bytes_up / 1e6,
                st.bytes_down / 1e6, best, wire / best / 1e9, raw, best / raw,
                double(hwm) * 1024 / (double(layout.total) * 4), best_st.push_ms, best_st.wait_ms, best_st.pull_ms);
    std::fflush(stdout);
  }

  // ---- 2. SPES ownership: 4 nodes x 2 experts ------------------------------------
  std::printf("\n4 nodes x 2 experts (SPES): bytes per node per round vs the SPES reference\n");
  std::printf("%-6s %9s %9s %9s %11s %7s %8s\n", "codec", "up MB", "down MB", "total MB", "SPES ref MB", "ratio",
              "seconds");
  for (const char* codec : codecs) {
    const uint16_t port = free_port();
    const Config c = bench_config(codec, 4, small, port);
    const pid_t pid = spawn_coordinator(self, codec, 4, small, port, "plain");
    std::vector<std::unique_ptr<net::SyncClient>> clients;
    std::vector<Ownership> owns;
    std::vector<std::vector<float>> params;
    for (int p = 0; p < 4; ++p) {
      owns.push_back(make_ownership(c.model, layout, p, 4, OwnershipMode::partitioned, 2));
      net::SyncClientParams sp = sync_client_params(c, layout, owns[p], init);
      sp.secret = "";
      net::SyncClientOptions o;
      o.log = false;
      clients.push_back(std::make_unique<net::SyncClient>(sp, o));
      params.push_back(init);
    }
    std::vector<net::RoundReport> st(4);
    double secs = 0;
    for (int r = 1; r <= 2; ++r) {
      for (int p = 0; p < 4; ++p) perturb(params[p], owns[p], r * 10 + p);
      const auto t0 = Clock::now();
      std::vector<std::thread> ts;
      for (int p = 0; p < 4; ++p) ts.emplace_back([&, p] { st[p] = clients[p]->sync_round(params[p].data(), r * 100); });
      for (auto& t : ts) t.join();
      secs = std::chrono::duration<double>(Clock::now() - t0).count();
    }
    for (auto& cl : clients) cl->disconnect();  // done: see above
    ::kill(pid, SIGTERM);
    ::waitpid(pid, nullptr, 0);
    std::filesystem::remove_all(c.spes.state_dir);
    const double ref = (double(owns[0].space.size()) * 4 + double(layout.total) * 4) / 1e6;
    const double total = double(st[0].bytes_up + st[0].bytes_down) / 1e6;
    std::printf("%-6s %9.1f %9.1f %9.1f %11.1f %7.2f %8.3f\n", codec, st[0].bytes_up / 1e6, st[0].bytes_down / 1e6,
                total, ref, total / ref, secs);
    std::fflush(stdout);
    for (int p = 1; p < 4; ++p)
      if (st[p].state_hash != st[0].state_hash) std::printf("  !! node %d state hash differs\n", p);
  }
  security_modes(self, small, rounds, layout, init);
  return 0;
}
