// Plain helpers shared by the coordinator, the nodes and the engine glue: the
// shared secret and "host:port" addresses. No sockets here.
#pragma once
#include <cstdint>
#include <string>

namespace spes::net {

// The shared secret: contents of secret_file (trailing whitespace trimmed) when
// set, else $SPES_SECRET, else "" (insecure mode). Throws NetError.
std::string load_secret(const std::string& secret_file);

// "host:port" or "[v6]:port".
struct HostPort {
  std::string host;
  uint16_t port = 0;
};
HostPort parse_host_port(const std::string& s);  // throws NetError

bool is_loopback_host(const std::string& host);

}  // namespace spes::net
