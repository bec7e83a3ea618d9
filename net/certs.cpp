// Certificate generation (see certs.hpp), OpenSSL 3.
#include "net/certs.hpp"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "engine/base/error.hpp"

namespace spes::net {

namespace {

using Key = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;
using Cert = std::unique_ptr<X509, decltype(&X509_free)>;

[[noreturn]] void fail(const std::string& what) {
  char buf[256] = "";
  ERR_error_string_n(ERR_get_error(), buf, sizeof buf);
  throw NetError("certs: " + what + (buf[0] ? std::string(" (") + buf + ")" : ""));
}

Key new_key() {
  Key k(EVP_PKEY_Q_keygen(nullptr, nullptr, "ED25519"), EVP_PKEY_free);
  if (!k) fail("Ed25519 key generation failed");
  return k;
}

void add_ext(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (!ext || !X509_add_ext(cert, ext, -1)) fail("extension " + value);
  X509_EXTENSION_free(ext);
}

// A certificate for `key` named `cn`, signed by issuer_key (self-signed when issuer is null).
Cert make_cert(EVP_PKEY* key, const std::string& cn, X509* issuer, EVP_PKEY* issuer_key, double from_days,
               double days, const std::vector<std::string>& exts) {
  Cert c(X509_new(), X509_free);
  X509_set_version(c.get(), 2);
  uint8_t serial[16];
  RAND_bytes(serial, sizeof serial);
  serial[0] &= 0x7f;
  BIGNUM* bn = BN_bin2bn(serial, sizeof serial, nullptr);
  BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(c.get()));
  BN_free(bn);
  X509_gmtime_adj(X509_getm_notBefore(c.get()), long(from_days * 86400));
  X509_gmtime_adj(X509_getm_notAfter(c.get()), long(days * 86400));
  X509_set_pubkey(c.get(), key);
  X509_NAME* name = X509_get_subject_name(c.get());
  X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("spes-engine run"), -1,
                             -1, 0);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0);
  X509_set_issuer_name(c.get(), issuer ? X509_get_subject_name(issuer) : name);
  X509* iss = issuer ? issuer : c.get();
  for (size_t i = 0; i + 1 < exts.size(); i += 2) add_ext(c.get(), iss, OBJ_txt2nid(exts[i].c_str()), exts[i + 1]);
  if (!X509_sign(c.get(), issuer_key, nullptr)) fail("signing " + cn);  // Ed25519: no separate digest
  return c;
}

void write_cert(const std::string& path, X509* c) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw NetError("certs: cannot write " + path);
  const bool ok = PEM_write_X509(f, c);
  if (std::fclose(f) != 0 || !ok) throw NetError("certs: cannot write " + path);
}

void write_key(const std::string& path, EVP_PKEY* k) {
  ::unlink(path.c_str());
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);  // never readable by others
  FILE* f = fd >= 0 ? ::fdopen(fd, "w") : nullptr;
  if (!f) throw NetError("certs: cannot write " + path);
  const bool ok = PEM_write_PrivateKey(f, k, nullptr, nullptr, 0, nullptr, nullptr);
  if (std::fclose(f) != 0 || !ok) throw NetError("certs: cannot write " + path);
}

Key read_key(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) throw NetError("certs: cannot read " + path);
  Key k(PEM_read_PrivateKey(f, nullptr, nullptr, nullptr), EVP_PKEY_free);
  std::fclose(f);
  if (!k) fail("bad private key " + path);
  return k;
}

Cert read_cert(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) throw NetError("certs: cannot read " + path);
  Cert c(PEM_read_X509(f, nullptr, nullptr, nullptr), X509_free);
  std::fclose(f);
  if (!c) fail("bad certificate " + path);
  return c;
}

bool is_ip(const std::string& h) {
  ASN1_OCTET_STRING* s = a2i_IPADDRESS(h.c_str());
  ASN1_OCTET_STRING_free(s);
  return s != nullptr;
}

std::string path_in(const std::string& dir, const std::string& name) { return (std::filesystem::path(dir) / name).string(); }

}  // namespace

std::string node_cert_name(int node_id) { return "node-" + std::to_string(node_id); }

int node_id_from_name(const std::string& cn) {
  if (cn.rfind("node-", 0) != 0 || cn.size() <= 5 || cn.size() > 10) return -1;
  int id = 0;
  for (size_t i = 5; i < cn.size(); ++i) {
    if (cn[i] < '0' || cn[i] > '9') return -1;
    id = id * 10 + (cn[i] - '0');
  }
  return id;
}

void make_node_cert(const std::string& ca_dir, const std::string& out_dir, int node_id, double valid_from_days,
                    double valid_days) {
  Key ca_key = read_key(path_in(ca_dir, "ca.key"));
  Cert ca = read_cert(path_in(ca_dir, "ca.crt"));
  Key k = new_key();
  const std::string name = node_cert_name(node_id);
  Cert c = make_cert(k.get(), name, ca.get(), ca_key.get(), valid_from_days, valid_days,
                     {"basicConstraints", "critical,CA:FALSE", "keyUsage", "critical,digitalSignature",
                      "extendedKeyUsage", "clientAuth", "subjectAltName", "DNS:" + name});
  write_key(path_in(out_dir, name + ".key"), k.get());
  write_cert(path_in(out_dir, name + ".crt"), c.get());
}

void make_run_certs(const CertRequest& r) {
  std::error_code ec;
  std::filesystem::create_directories(r.out_dir, ec);
  if (ec) throw NetError("certs: cannot create " + r.out_dir + ": " + ec.message());
  Key ca_key = new_key();
  Cert ca = make_cert(ca_key.get(), "spes-engine run CA", nullptr, ca_key.get(), r.valid_from_days, r.valid_days,
                      {"basicConstraints", "critical,CA:TRUE,pathlen:0", "keyUsage", "critical,keyCertSign,cRLSign",
                       "subjectKeyIdentifier", "hash"});
  write_key(path_in(r.out_dir, "ca.key"), ca_key.get());
  write_cert(path_in(r.out_dir, "ca.crt"), ca.get());

  std::string san = "DNS:localhost,IP:127.0.0.1,IP:::1";
  for (const std::string& h : r.coordinator_hosts)
    if (h != "localhost" && h != "127.0.0.1" && h != "::1" && !h.empty()) san += (is_ip(h) ? ",IP:" : ",DNS:") + h;
  Key ck = new_key();
  Cert cc = make_cert(ck.get(), "coordinator", ca.get(), ca_key.get(), r.valid_from_days, r.valid_days,
                      {"basicConstraints", "critical,CA:FALSE", "keyUsage", "critical,digitalSignature",
                       "extendedKeyUsage", "serverAuth", "subjectAltName", san});
  write_key(path_in(r.out_dir, "coordinator.key"), ck.get());
  write_cert(path_in(r.out_dir, "coordinator.crt"), cc.get());
  for (int id = 0; id < r.n_nodes; ++id) make_node_cert(r.out_dir, r.out_dir, id, r.valid_from_days, r.valid_days);
}

}  // namespace spes::net
