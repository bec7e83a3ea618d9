// Small Asio helpers shared by the coordinator's sessions and the node's client.
#pragma once
#include <netinet/in.h>
#include <netinet/tcp.h>

#include <algorithm>
#include <utility>  // before Asio: boost/asio/awaitable.hpp uses std::exchange
#include <boost/asio.hpp>
#include <chrono>

namespace spes::net {

inline std::chrono::nanoseconds to_duration(double s) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(std::min(s, 1e9)));
}

// No Nagle (frames are written whole), and TCP keep-alive probes after 10 s idle
// so a peer that vanished without a FIN is noticed within ~25 s.
inline void tune_socket(boost::asio::ip::tcp::socket& sock) {
  boost::system::error_code ec;
  sock.set_option(boost::asio::ip::tcp::no_delay(true), ec);
  sock.set_option(boost::asio::socket_base::keep_alive(true), ec);
  const int fd = sock.native_handle();
  int idle = 10, intvl = 5, cnt = 3;
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
}

}  // namespace spes::net
