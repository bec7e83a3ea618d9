// TLS contexts and certificate checks (see tls.hpp).
#include "net/tls.hpp"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <filesystem>

#include "engine/base/error.hpp"
#include "net/certs.hpp"

namespace spes::net {

namespace {
void need_file(const std::string& path, const char* what) {
  if (!std::filesystem::is_regular_file(path))
    throw NetError(std::string("TLS ") + what + " " + path + " does not exist (make them with `spes-engine certs`)");
}
}  // namespace

std::unique_ptr<ssl::context> tls_context(const TlsFiles& f, bool server) {
  need_file(f.ca, "CA certificate (tls_ca)");
  need_file(f.cert, "certificate (tls_cert)");
  need_file(f.key, "private key (tls_key)");
  auto ctx = std::make_unique<ssl::context>(server ? ssl::context::tls_server : ssl::context::tls_client);
  SSL_CTX* c = ctx->native_handle();
  SSL_CTX_set_min_proto_version(c, TLS1_3_VERSION);
  SSL_CTX_set_max_proto_version(c, TLS1_3_VERSION);
  boost::system::error_code ec;
  auto load = [&](auto&& op, const std::string& path, const char* what) {
    op(ec);
    if (ec) throw NetError(std::string("TLS ") + what + " " + path + ": " + ec.message());
  };
  load([&](auto& e) { ctx->load_verify_file(f.ca, e); }, f.ca, "CA certificate (tls_ca)");
  load([&](auto& e) { ctx->use_certificate_chain_file(f.cert, e); }, f.cert, "certificate (tls_cert)");
  load([&](auto& e) { ctx->use_private_key_file(f.key, ssl::context::pem, e); }, f.key, "private key (tls_key)");
  if (SSL_CTX_check_private_key(c) != 1)
    throw NetError("TLS private key " + f.key + " does not match the certificate " + f.cert);
  ctx->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert);
  return ctx;
}

std::unique_ptr<ssl::context> plain_context() { return std::make_unique<ssl::context>(ssl::context::tls); }

int peer_node_id(TlsStream& s) {
  X509* cert = SSL_get0_peer_certificate(s.native_handle());
  if (!cert || SSL_get_verify_result(s.native_handle()) != X509_V_OK) return -1;
  char cn[64] = "";
  if (X509_NAME_get_text_by_NID(X509_get_subject_name(cert), NID_commonName, cn, sizeof cn) <= 0) return -1;
  return node_id_from_name(cn);
}

void expect_peer_host(TlsStream& s, const std::string& host) {
  X509_VERIFY_PARAM* p = SSL_get0_param(s.native_handle());
  if (X509_VERIFY_PARAM_set1_ip_asc(p, host.c_str()) != 1) X509_VERIFY_PARAM_set1_host(p, host.c_str(), 0);
  SSL_set_tlsext_host_name(s.native_handle(), host.c_str());
}

std::string tls_error(const boost::system::error_code& ec, TlsStream& s) {
  const long v = SSL_get_verify_result(s.native_handle());
  if (v != X509_V_OK) return std::string("certificate rejected: ") + X509_verify_cert_error_string(v);
  std::string m = ec.message();
  if (ec.category() == boost::asio::error::get_ssl_category()) {
    char buf[256];
    ERR_error_string_n(static_cast<unsigned long>(ec.value()), buf, sizeof buf);
    m = buf;
  }
  return m;
}

bool tls_certificate_refused(const boost::system::error_code& ec) {
  if (ec.category() != boost::asio::error::get_ssl_category()) return false;
  switch (ERR_GET_REASON(static_cast<unsigned long>(ec.value()))) {
    case SSL_R_SSLV3_ALERT_BAD_CERTIFICATE:
    case SSL_R_SSLV3_ALERT_CERTIFICATE_EXPIRED:
    case SSL_R_SSLV3_ALERT_CERTIFICATE_REVOKED:
    case SSL_R_SSLV3_ALERT_CERTIFICATE_UNKNOWN:
    case SSL_R_SSLV3_ALERT_UNSUPPORTED_CERTIFICATE:
    case SSL_R_TLSV1_ALERT_UNKNOWN_CA:
    case SSL_R_TLSV1_ALERT_ACCESS_DENIED:
    case SSL_R_TLSV13_ALERT_CERTIFICATE_REQUIRED:
    case SSL_R_CERTIFICATE_VERIFY_FAILED:
      return true;
    default:
      return false;
  }
}

}  // namespace spes::net
