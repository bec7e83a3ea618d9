// Shared secret and address parsing (see address.hpp).
#include "net/address.hpp"

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "engine/base/error.hpp"

namespace spes::net {

std::string load_secret(const std::string& secret_file) {
  std::string s;
  if (!secret_file.empty()) {
    std::ifstream f(secret_file, std::ios::binary);
    if (!f) throw NetError("cannot read secret_file " + secret_file);
    std::stringstream ss;
    ss << f.rdbuf();
    s = ss.str();
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
    if (s.empty()) throw NetError("secret_file " + secret_file + " is empty");
    check_secret(s, "secret_file " + secret_file);
    return s;
  }
  if (const char* e = std::getenv("SPES_SECRET")) s = e;
  check_secret(s, "SPES_SECRET");
  return s;
}

void check_secret(const std::string& secret, const std::string& where) {
  if (secret.empty()) return;
  size_t solid = 0;
  for (char c : secret) solid += !std::isspace(static_cast<unsigned char>(c));
  if (solid < kMinSecretBytes)
    throw NetError(where + ": the shared secret has " + std::to_string(solid) + " non-blank bytes, at least " +
                   std::to_string(kMinSecretBytes) + " are needed");
}

void check_insecure(const std::string& role, const std::string& host, bool has_secret, bool has_tls,
                    bool allow_insecure) {
  if (has_secret || has_tls || allow_insecure || is_loopback_host(host)) return;
  throw NetError(role + " " + host + " is not loopback and there is no shared secret (secret_file / SPES_SECRET) "
                 "and no TLS (tls_ca): refusing plaintext; set one, or [spes] allow_insecure = true on a trusted network");
}

HostPort parse_host_port(const std::string& s) {
  HostPort hp;
  std::string port;
  if (!s.empty() && s[0] == '[') {
    const auto close = s.find(']');
    if (close == std::string::npos || close + 1 >= s.size() || s[close + 1] != ':')
      throw NetError("bad coordinator address '" + s + "': expected [v6addr]:port");
    hp.host = s.substr(1, close - 1);
    port = s.substr(close + 2);
  } else {
    const auto colon = s.rfind(':');
    if (colon == std::string::npos) throw NetError("bad coordinator address '" + s + "': expected host:port");
    hp.host = s.substr(0, colon);
    port = s.substr(colon + 1);
  }
  char* end = nullptr;
  const long p = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end || p < 0 || p > 65535)
    throw NetError("bad coordinator address '" + s + "': port must be 0..65535");
  hp.port = uint16_t(p);
  if (hp.host.empty()) throw NetError("bad coordinator address '" + s + "': empty host");
  return hp;
}

bool is_loopback_host(const std::string& h) { return h == "localhost" || h == "::1" || h.rfind("127.", 0) == 0; }

}  // namespace spes::net
