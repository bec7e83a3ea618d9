// Plain helpers shared by the coordinator, the nodes and the engine glue: the
// shared secret and "host:port" addresses. No sockets here.
#pragma once
#include <cstdint>
#include <string>

namespace spes::net {

// The shared secret: contents of secret_file (trailing whitespace trimmed) when
// set, else $SPES_SECRET (unset or empty: "", no secret). A secret must pass
// check_secret. Throws NetError naming where the secret came from.
std::string load_secret(const std::string& secret_file);

// A secret is the HMAC key of every frame: at least kMinSecretBytes bytes that are
// not whitespace, so a blank or short one (guessable offline from one captured
// handshake) is refused. "" (no secret) passes; `where` names its source.
constexpr size_t kMinSecretBytes = 16;
void check_secret(const std::string& secret, const std::string& where);

// Plaintext with no secret and no TLS is allowed only on loopback or when the
// config says allow_insecure = true; else NetError naming `role` and `host`.
void check_insecure(const std::string& role, const std::string& host, bool has_secret, bool has_tls,
                    bool allow_insecure);

// "host:port" or "[v6]:port".
struct HostPort {
  std::string host;
  uint16_t port = 0;
};
HostPort parse_host_port(const std::string& s);  // throws NetError

bool is_loopback_host(const std::string& host);

}  // namespace spes::net
