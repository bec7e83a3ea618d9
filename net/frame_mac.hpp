// The MAC on every frame after the handshake in shared-secret mode (net/README.md,
// Security).
// The Hello/Welcome proofs show both sides know the secret; from then on each
// frame carries HMAC-SHA256 under a session key derived from the secret and both
// handshake nonces (fresh per connection, so a frame of one session is worthless
// in another), over a per-direction sequence number, the header and the payload:
// a flipped byte, a replayed, dropped or reordered frame fails its MAC. CRC32C
// stays in the header to tell transport damage from tampering in the logs.
// Wire: header flag kFlagMac set, then kMacBytes after the payload. Not used over
// TLS (TLS authenticates every record) nor without a secret (loopback only).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include <openssl/types.h>

#include "net/digest.hpp"

namespace spes::net {

constexpr uint16_t kFlagMac = 1;
constexpr size_t kMacBytes = 32;

// HMAC(secret, "spes-session" | server nonce | node nonce).
Digest session_key(const std::string& secret, std::span<const uint8_t> server_nonce,
                   std::span<const uint8_t> node_nonce);

class FrameMac {
 public:
  enum Side : uint8_t { node = 'N', coordinator = 'C' };  // who sends: the direction byte
  FrameMac() = default;
  ~FrameMac();
  FrameMac(const FrameMac&) = delete;
  FrameMac& operator=(const FrameMac&) = delete;

  // Keys both directions; sequence numbers restart at 0. `me` is this end.
  void start(const Digest& key, Side me);
  void stop();  // a new connection starts unsealed
  bool on() const { return ctx_ != nullptr; }

  // The MAC of the next outgoing frame (its header already carries kFlagMac).
  Digest seal(const uint8_t* header, const uint8_t* body, size_t body_size);
  // Checks the next incoming frame's MAC (constant time); advances on success only.
  bool open(const uint8_t* header, const uint8_t* body, size_t body_size, const uint8_t* mac);

 private:
  Digest compute(uint8_t dir, uint64_t seq, const uint8_t* header, const uint8_t* body, size_t n);
  EVP_MAC_CTX* ctx_ = nullptr;  // keyed once; re-initialised per frame
  uint8_t send_dir_ = 0, recv_dir_ = 0;
  uint64_t send_seq_ = 0, recv_seq_ = 0;
};

}  // namespace spes::net
