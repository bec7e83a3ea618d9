// The PEM files of a TLS endpoint, apart from net/tls.hpp so that the coordinator's
// and the node's options can name them without pulling Boost.Asio and OpenSSL's
// headers into every file that includes those options.
#pragma once
#include <string>

namespace spes::net {

// PEM files; an empty ca means TLS is off.
struct TlsFiles {
  std::string ca, cert, key;
  bool on() const { return !ca.empty(); }
};

}  // namespace spes::net
