// Per-frame HMAC-SHA256 (see frame_mac.hpp), through OpenSSL 3's EVP_MAC.
#include "net/frame_mac.hpp"

#include <openssl/core_names.h>
#include <openssl/evp.h>

#include <cstring>
#include <vector>

#include "engine/base/error.hpp"
#include "net/frame.hpp"

namespace spes::net {

Digest session_key(const std::string& secret, std::span<const uint8_t> server_nonce,
                   std::span<const uint8_t> node_nonce) {
  std::vector<uint8_t> m(12);
  std::memcpy(m.data(), "spes-session", 12);
  m.insert(m.end(), server_nonce.begin(), server_nonce.end());
  m.insert(m.end(), node_nonce.begin(), node_nonce.end());
  return hmac_sha256(secret, m);
}

FrameMac::~FrameMac() { stop(); }

void FrameMac::stop() {
  EVP_MAC_CTX_free(ctx_);
  ctx_ = nullptr;
}

void FrameMac::start(const Digest& key, Side me) {
  stop();
  EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  if (!mac) throw NetError("HMAC unavailable (OpenSSL EVP_MAC_fetch)");
  ctx_ = EVP_MAC_CTX_new(mac);
  EVP_MAC_free(mac);  // the context holds its own reference
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0), OSSL_PARAM_construct_end()};
  if (!ctx_ || !EVP_MAC_init(ctx_, key.data(), key.size(), params)) throw NetError("HMAC init failed (OpenSSL)");
  send_dir_ = me;
  recv_dir_ = me == node ? coordinator : node;
  send_seq_ = recv_seq_ = 0;
}

Digest FrameMac::compute(uint8_t dir, uint64_t seq, const uint8_t* header, const uint8_t* body, size_t n) {
  uint8_t prefix[9] = {dir};
  for (int i = 0; i < 8; ++i) prefix[1 + i] = uint8_t(seq >> (8 * i));
  Digest out{};
  size_t len = 0;
  // A NULL key re-initialises with the key given in start().
  if (!EVP_MAC_init(ctx_, nullptr, 0, nullptr) || !EVP_MAC_update(ctx_, prefix, sizeof prefix) ||
      !EVP_MAC_update(ctx_, header, kHeaderBytes) || (n && !EVP_MAC_update(ctx_, body, n)) ||
      !EVP_MAC_final(ctx_, out.data(), &len, out.size()) || len != out.size())
    throw NetError("HMAC-SHA256 failed (OpenSSL)");
  return out;
}

Digest FrameMac::seal(const uint8_t* header, const uint8_t* body, size_t body_size) {
  return compute(send_dir_, send_seq_++, header, body, body_size);
}

bool FrameMac::open(const uint8_t* header, const uint8_t* body, size_t body_size, const uint8_t* mac) {
  const Digest expect = compute(recv_dir_, recv_seq_, header, body, body_size);
  if (!digest_equal(expect, std::span<const uint8_t>(mac, kMacBytes))) return false;
  ++recv_seq_;
  return true;
}

}  // namespace spes::net
