// A run's nodes over emulated slow links (bench/study/slow_link.sh): one throttled
// loopback link per --listen port, each forwarding to the coordinator's port at RATE
// each way (bench/throttled_link.hpp), until SIGTERM or SIGINT; then one CSV row per
// link on stdout: the bytes it carried each way.
//   link_proxy --rate RATE --to PORT --listen PORT [--listen PORT]...
//   (RATE as `spes-engine plan --link` reads it: 100Mbit, 7.5Mbit, 1Gbit)
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench/throttled_link.hpp"
#include "engine/args.hpp"
#include "engine/base/error.hpp"
#include "engine/link_plan.hpp"

namespace {

const char* kUsage = "usage: link_proxy --rate RATE --to PORT --listen PORT [--listen PORT]...";

uint16_t parse_port(const char* flag, const char* s) {
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  if (*s == 0 || *end != 0 || v < 1 || v > 65535)
    throw spes::UsageError(std::string(flag) + " " + s + ": expected a port in 1..65535");
  return uint16_t(v);
}

double parse_rate(const std::string& s) {
  try {
    return spes::parse_link_rate(s);
  } catch (const spes::UsageError&) {
    throw spes::UsageError("--rate " + s + ": expected a rate in bits per second such as 7.5Mbit or 1Gbit");
  }
}

int run(int argc, char** argv) {
  double bits_per_s = 0;
  uint16_t target = 0;
  std::vector<uint16_t> listen;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (!std::strcmp(argv[i], "--rate") && has_value) bits_per_s = parse_rate(argv[++i]);
    else if (!std::strcmp(argv[i], "--to") && has_value) target = parse_port("--to", argv[++i]);
    else if (!std::strcmp(argv[i], "--listen") && has_value) listen.push_back(parse_port("--listen", argv[++i]));
    else throw spes::UsageError(std::string("unknown or incomplete argument '") + argv[i] + "'; " + kUsage);
  }
  if (bits_per_s <= 0 || target == 0 || listen.empty()) throw spes::UsageError(kUsage);

  // Blocked here, so every thread inherits the mask and sigwait below receives them.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);

  std::vector<std::unique_ptr<spes::bench::ThrottledProxy>> links;
  for (uint16_t port : listen) {
    links.push_back(std::make_unique<spes::bench::ThrottledProxy>(target, bits_per_s / 8, port));
    if (links.back()->port() == 0) throw spes::Error("link_proxy: cannot listen on 127.0.0.1:" + std::to_string(port));
  }
  std::fprintf(stderr, "link_proxy: %zu link(s) at %g Mbit/s each way to 127.0.0.1:%u, ready\n", links.size(),
               bits_per_s / 1e6, unsigned(target));
  int sig = 0;
  sigwait(&stop, &sig);
  std::printf("port,bytes_to_target,bytes_from_target\n");
  for (const auto& l : links)
    std::printf("%u,%lld,%lld\n", unsigned(l->port()), (long long)l->bytes_to_target(),
                (long long)l->bytes_from_target());
  std::fflush(stdout);
  links.clear();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const spes::UsageError& e) {
    std::fprintf(stderr, "link_proxy: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
