// The coordinator's memory (issue 14): its peak RSS over a round, as a multiple of the
// model's fp32 bytes, at a moderate size (31M parameters). The coordinator runs as a
// separate process (this test binary re-executed on a hidden test case) so that its
// peak RSS (VmHWM) is its own, over the process's RSS before the coordinator exists.
// It holds one fp32 accumulator; θ, the download residual, the outer momentum and the
// lossy round result live in files (net/state_file, net/publication), read a chunk at
// a time. The rest is chunk-sized scratch, fixed plus some per core: a second
// model-sized buffer (θ in memory, a decoded copy, the encoded round result) fails.
#include <doctest/doctest.h>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "net_test_util.hpp"


using namespace spes;
using namespace spes::net;
using namespace spes::net::testing;

namespace {

Config memory_config(const std::string& codec, uint16_t port) {
  Config c = tiny_config(1, parse_codec(codec), OwnershipMode::all);
  c.model.vocab_size = 8192;
  c.model.d_model = 512;
  c.model.n_layers = 4;
  c.model.n_heads = 8;
  c.model.n_kv_heads = 8;
  c.model.n_experts = 8;
  c.model.expert_hidden = 384;
  c.spes.coordinator = "127.0.0.1:" + std::to_string(port);
  return c;
}

}  // namespace

TEST_CASE("net child: memory coordinator process" * doctest::skip()) {
  const char* codec = std::getenv("SPES_NET_MEM_CODEC");
  const char* port = std::getenv("SPES_NET_MEM_PORT");
  if (!codec || !port) return;
  Config cfg = memory_config(codec, uint16_t(std::atoi(port)));
  // Every round is persisted before it is published: to RAM (/dev/shm) when there is
  // one, so the test measures the coordinator, not the disk; shmem is not its RSS.
  const std::filesystem::path shm = "/dev/shm";
  cfg.spes.state_dir = ((std::filesystem::is_directory(shm) ? shm : std::filesystem::temp_directory_path()) /
                        ("spes-test-memory-" + std::to_string(::getpid())))
                           .string();
  CoordinatorOptions opt;
  opt.log = false;
  opt.handle_signals = true;
  opt.fresh = true;
  // The process before the coordinator exists (the test binary; with CUDA its runtime
  // libraries alone are ~1× this model): the parent subtracts it.
  if (const char* base = std::getenv("SPES_NET_MEM_BASE")) std::ofstream(base) << status_kib(::getpid(), "VmRSS:");
  {
    Coordinator c(test_coordinator_params(cfg), opt);
    c.run();
  }
  std::filesystem::remove_all(cfg.spes.state_dir);
}

TEST_CASE("coordinator memory: peak RSS per codec at 31M parameters") {
  // Issue 14's goal is 1.5× the model for every codec. Here the chunk-sized scratch is
  // a large part of a small model: each core beyond two encodes a 4 MiB chunk of a
  // lossy round with ~16 MiB of scratch of its own, which the bound allows for.
  const double model_mb = 125.9;
  const double per_core = 16.0 / model_mb * std::max(0, int(std::thread::hardware_concurrency()) - 2);
  const std::vector<std::pair<std::string, double>> bounds = {
      {"fp32", 1.3 + per_core}, {"bf16", 1.5 + per_core}, {"int8", 1.5 + per_core}, {"sparse", 1.5 + per_core}};
  for (const auto& [codec, bound] : bounds) {
    CAPTURE(codec);
    const uint16_t port = free_loopback_port();
    const Config cfg = memory_config(codec, port);
    const std::string base_file = temp_dir("memory-base") + "/rss";
    const pid_t pid = spawn_test_child("net child: memory coordinator process",
                                       {"SPES_NET_MEM_CODEC=" + codec, "SPES_NET_MEM_PORT=" + std::to_string(port),
                                        "SPES_NET_MEM_BASE=" + base_file},
                                       port, 30);
    TestNode node(cfg, 0, "127.0.0.1:" + std::to_string(port));
    for (int r = 1; r <= 2; ++r) {
      node.train(1);
      CHECK(node.sync().round == r);
    }
    const double model_bytes = double(node.layout.total) * 4;
    long base_kib = 0;
    std::ifstream(base_file) >> base_kib;
    REQUIRE(base_kib > 0);
    const double ratio = double(status_kib(pid, "VmHWM:") - base_kib) * 1024 / model_bytes;
    node.client->disconnect();  // the node is done: SIGTERM stops the coordinator at once
    ::kill(pid, SIGTERM);
    int st = 0;
    ::waitpid(pid, &st, 0);
    MESSAGE(codec << ": coordinator peak RSS " << ratio << " x the model (" << model_bytes / 1e6 << " MB), bound "
                  << bound);
    CHECK(std::fabs(model_bytes / 1e6 - model_mb) < 0.1);  // the size the bounds are for
    CHECK(ratio > 1.0);  // it holds the accumulator at least: the measurement is real
    CHECK(ratio <= bound);
  }
}
