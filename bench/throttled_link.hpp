// An emulated slow link on loopback: a TCP proxy to a target port whose two
// directions each pass a token bucket of `bytes_per_s`, shared by every connection
// accepted on its port (one proxy = one node's link). Used by bench_sync
// (--slow-link: one round through it) and link_proxy (a run's nodes through it).
#pragma once
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace spes::bench {

inline sockaddr_in loopback_address(uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

// A socket bound to the loopback `*port` (0: a free one, written back), listening
// when backlog > 0; -1 when the port cannot be bound.
inline int listen_loopback(int backlog, uint16_t* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a = loopback_address(*port);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || (backlog > 0 && ::listen(fd, backlog) != 0)) {
    ::close(fd);
    return -1;
  }
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return fd;
}

// A socket connected to the loopback `port`, or -1.
inline int connect_loopback(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const sockaddr_in a = loopback_address(port);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0) return fd;
  ::close(fd);
  return -1;
}

class ThrottledProxy {
 public:
  using Clock = std::chrono::steady_clock;
  // Listens on `listen_port` (0: a free one); port() is 0 when it could not bind.
  ThrottledProxy(uint16_t target_port, double bytes_per_s, uint16_t listen_port = 0)
      : target_(target_port), port_(listen_port), rate_(bytes_per_s) {
    lfd_ = listen_loopback(8, &port_);
    if (lfd_ < 0) {
      port_ = 0;
      return;
    }
    accept_ = std::thread([this] { serve(); });
  }
  ~ThrottledProxy() {
    if (lfd_ < 0) return;
    ::shutdown(lfd_, SHUT_RDWR);
    ::close(lfd_);
    accept_.join();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);  // unblocks pumps of connections still open
    }
    for (auto& t : pumps_) t.join();
    for (int fd : fds_) ::close(fd);
  }
  ThrottledProxy(const ThrottledProxy&) = delete;
  ThrottledProxy& operator=(const ThrottledProxy&) = delete;

  uint16_t port() const { return port_; }
  // Bytes forwarded towards the target (a node's pushes) and back (its pulls).
  int64_t bytes_to_target() const { return to_target_.bytes; }
  int64_t bytes_from_target() const { return from_target_.bytes; }

 private:
  // One direction of the link: every connection's bytes queue on one clock.
  struct Bucket {
    std::mutex mu;
    Clock::time_point next{};
    std::atomic<int64_t> bytes{0};
    // The time by which n more bytes have passed; an idle link banks no credit.
    Clock::time_point reserve(int64_t n, double rate) {
      std::lock_guard<std::mutex> lock(mu);
      next = std::max(next, Clock::now()) +
             std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(double(n) / rate));
      bytes += n;
      return next;
    }
  };

  void serve() {
    for (;;) {
      const int in = ::accept(lfd_, nullptr, nullptr);
      if (in < 0) return;
      const int out = connect_loopback(target_);
      if (out < 0) {
        ::close(in);
        continue;
      }
      std::lock_guard<std::mutex> lock(mu_);
      fds_.push_back(in);
      fds_.push_back(out);
      pumps_.emplace_back([this, in, out] { pump(in, out, to_target_); });
      pumps_.emplace_back([this, in, out] { pump(out, in, from_target_); });
    }
  }
  // Forwards from → to; a chunk leaves once the bucket has passed it (n / rate).
  void pump(int from, int to, Bucket& bucket) {
    std::vector<uint8_t> buf(64 * 1024);
    for (;;) {
      const ssize_t r = ::recv(from, buf.data(), buf.size(), 0);
      if (r <= 0) break;
      std::this_thread::sleep_until(bucket.reserve(r, rate_));
      for (ssize_t w = 0; w < r;) {
        const ssize_t k = ::send(to, buf.data() + w, size_t(r - w), MSG_NOSIGNAL);
        if (k <= 0) return;
        w += k;
      }
    }
    ::shutdown(to, SHUT_WR);
  }

  uint16_t target_, port_;
  double rate_;
  int lfd_ = -1;
  Bucket to_target_, from_target_;
  std::mutex mu_;
  std::vector<int> fds_;
  std::thread accept_;
  std::vector<std::thread> pumps_;
};

}  // namespace spes::bench
