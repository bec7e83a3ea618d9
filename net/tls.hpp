// TLS 1.3 with mutual certificates for the sync protocol (net/README.md, Security),
// through Boost.Asio's ssl::stream over OpenSSL: no crypto of our own. Both sides
// present a certificate signed by the run's CA (net/certs.hpp) and verify the
// other's; the coordinator reads the node id its peer's certificate names, the node
// checks that the coordinator's certificate names the host it dialed.
#pragma once
#include <memory>
#include <string>
#include <utility>  // before Asio: boost/asio/awaitable.hpp uses std::exchange
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>

#include "net/tls_files.hpp"

namespace spes::net {

namespace ssl = boost::asio::ssl;
using TlsStream = ssl::stream<boost::asio::ip::tcp::socket>;

// TLS 1.3 only, the peer's certificate required and verified against the CA.
// Throws NetError naming the file that could not be used.
std::unique_ptr<ssl::context> tls_context(const TlsFiles& f, bool server);
// A context for streams that never handshake (plaintext mode).
std::unique_ptr<ssl::context> plain_context();

// After a verified handshake: the node id the peer's certificate names (CN
// "node-<id>"), or -1.
int peer_node_id(TlsStream& s);
// Before a client handshake: the server certificate must name `host` (IP or DNS SAN).
void expect_peer_host(TlsStream& s, const std::string& host);
// A handshake error in words (OpenSSL's reason, e.g. "certificate has expired").
std::string tls_error(const boost::system::error_code& ec, TlsStream& s);
// Whether a TLS error is the peer's verdict on our certificate (an alert: bad,
// expired, revoked, unknown CA, access denied...): final. Any other TLS error after
// the handshake (a record that fails its MAC, a truncated one) is damage on the
// path, worth a reconnect.
bool tls_certificate_refused(const boost::system::error_code& ec);

}  // namespace spes::net
