// An on-path attacker cannot stop a node for good (issue 33, point 3): a proxy
// between a node and the coordinator flips one byte of one frame, towards the node
// (a round result) or towards the coordinator (a push). The frame fails its MAC,
// which is a connection fault: the node reconnects with backoff (a push is resent,
// a lost result comes as a snapshot) and the run goes on with agreeing hashes. Only
// the handshake's explicit refusals stay final (test_net_refusal).
#include <doctest/doctest.h>

#include <mutex>

#include "net_test_util.hpp"

using namespace spes;
using namespace spes::net;
using namespace spes::net::testing;

namespace {

// A loopback TCP proxy to `port` that flips one byte, once: the byte at offset
// `flip_at` of the first connection's stream in the chosen direction.
struct FlippingProxy {
  int listen_fd = -1;
  uint16_t port = 0;
  std::thread accepter;
  std::mutex mu;
  std::vector<std::thread> pumps;
  std::vector<int> fds;
  std::atomic<bool> stopping{false};
  std::atomic<int> flipped{0};
  std::atomic<int> connections{0};

  FlippingProxy(uint16_t target, bool to_node, int64_t flip_at) {
    listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    ::setsockopt(listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(listen_fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(listen_fd, 16) == 0);
    socklen_t len = sizeof a;
    ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
    accepter = std::thread([this, target, to_node, flip_at] {
      for (;;) {
        const int in = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (in < 0 || stopping) {
          if (in >= 0) ::close(in);
          return;
        }
        RawConn up;
        if (!up.connect(target)) {
          ::close(in);
          continue;
        }
        const int out = up.fd;
        up.fd = -1;
        const bool first = connections++ == 0;
        std::lock_guard<std::mutex> lk(mu);
        fds.push_back(in);
        fds.push_back(out);
        // node → coordinator, and coordinator → node
        pumps.emplace_back([this, in, out, flip = first && !to_node ? flip_at : -1] { pump(in, out, flip); });
        pumps.emplace_back([this, in, out, flip = first && to_node ? flip_at : -1] { pump(out, in, flip); });
      }
    });
  }
  void pump(int from, int to, int64_t flip_at) {
    uint8_t buf[8192];
    int64_t offset = 0;
    for (;;) {
      const ssize_t r = ::recv(from, buf, sizeof buf, 0);
      if (r <= 0) break;
      if (flip_at >= offset && flip_at < offset + r) {
        buf[flip_at - offset] ^= 0x10;
        ++flipped;
      }
      offset += r;
      const uint8_t* p = buf;
      for (ssize_t n = r; n > 0;) {
        const ssize_t w = ::send(to, p, size_t(n), MSG_NOSIGNAL);
        if (w <= 0) goto done;
        p += w;
        n -= w;
      }
    }
  done:
    ::shutdown(from, SHUT_RDWR);
    ::shutdown(to, SHUT_RDWR);
  }
  ~FlippingProxy() {
    stopping = true;
    ::shutdown(listen_fd, SHUT_RDWR);
    accepter.join();
    ::close(listen_fd);
    std::lock_guard<std::mutex> lk(mu);
    for (int fd : fds) ::shutdown(fd, SHUT_RDWR);
    for (auto& t : pumps) t.join();
    for (int fd : fds) ::close(fd);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
};

// Two nodes, node 0 behind the proxy; three rounds. Returns node 0's reports.
std::vector<RoundReport> rounds_through_proxy(bool to_node) {
  const Config cfg = tiny_config(2, Codec::int8);
  CoordinatorOptions opt;
  opt.log = std::getenv("SPES_NET_TEST_LOG") != nullptr;
  CoordThread co(cfg, opt);
  // Past the handshake (Challenge, Hello, Welcome: a few hundred bytes), inside the
  // first chunk frame of round 1 (a chunk is 1024 values).
  FlippingProxy proxy(co.port(), to_node, 3000);
  std::vector<std::unique_ptr<TestNode>> nodes;
  nodes.push_back(std::make_unique<TestNode>(cfg, 0, proxy.address()));
  nodes.push_back(std::make_unique<TestNode>(cfg, 1, co.address()));
  std::vector<RoundReport> reports;
  for (int r = 1; r <= 3; ++r) {
    const std::vector<RoundReport> st = sync_all(nodes);  // throws when a node stops
    CHECK(st[0].state_hash == st[1].state_hash);
    CHECK(st[1].state_hash == co.c->stats().state_hash);
    reports.push_back(st[0]);
  }
  CHECK(proxy.flipped == 1);
  CHECK(proxy.connections >= 2);  // the node reconnected after the damaged frame
  CHECK(co.c->stats().round >= 3);
  return reports;
}

}  // namespace

TEST_CASE("on-path: a byte flipped in a frame to the node is a connection fault: it reconnects and goes on") {
  const auto reports = rounds_through_proxy(true);
  CHECK(reports.back().round >= 3);
}

TEST_CASE("on-path: a byte flipped in a node's push is a connection fault: it reconnects, resends, goes on") {
  const auto reports = rounds_through_proxy(false);
  CHECK(reports.back().round == 3);
  CHECK(!reports[0].resynced);  // the push was resent on the new connection and merged
}
