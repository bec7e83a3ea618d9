// Checksums, the state hash, and the HMAC proof used by the sync protocol.
//  - crc32c (engine/base/checksum.hpp): frame and chunk checksums.
//  - StateHasher / state_hash: a 64-bit hash of a parameter buffer's exact bits.
//    Every shared state carries one: after a sync round every node
//    and the coordinator compare it instead of trusting that they agree.
//  - hmac_sha256: proof of a shared secret over a nonce (OpenSSL libcrypto).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "engine/base/checksum.hpp"

namespace spes::net {

using spes::crc32c;

// Streaming 64-bit hash built for speed on big buffers (it runs over all of θ on
// both sides of every round): eight 64-bit lanes per 64-byte stripe, each adding
// (w ^ key)_lo · (w ^ key)_hi with a key that depends on the stripe's position, plus
// the raw word into its neighbour lane; every 16 stripes the lanes are scrambled
// (xor-shift, key, multiply), which makes the order of blocks matter; an avalanche
// at the end. 32x32->64 multiplies vectorise (AVX2: ~4x the scalar multiply-rotate
// hash). Feeding a buffer in any split gives the same value as one call, so a node
// can hash "frozen params + owned sync base" without assembling them.
class StateHasher {
 public:
  StateHasher();
  void update(const void* data, size_t n);
  void update(const float* x, int64_t n) { update(static_cast<const void*>(x), size_t(n) * 4); }
  uint64_t digest() const;

 private:
  void stripes(const uint8_t* p, size_t count);
  uint64_t acc_[8];
  uint8_t buf_[64];
  size_t buf_n_ = 0;
  uint32_t stripe_ = 0;  // position of the next stripe in its 16-stripe block
  uint64_t total_ = 0;
};

uint64_t state_hash(const float* x, int64_t n);

using Digest = std::array<uint8_t, 32>;
Digest hmac_sha256(const std::string& key, std::span<const uint8_t> message);
bool digest_equal(std::span<const uint8_t> a, std::span<const uint8_t> b);  // constant time
void random_bytes(uint8_t* out, size_t n);

// "0123456789abcdef" form of a state hash, as logged and written to CSV.
std::string hash_hex(uint64_t h);

}  // namespace spes::net
