#include "net/digest.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdio>
#include <cstring>
#include <random>

#include "engine/base/error.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#include <nmmintrin.h>
#endif

namespace spes::net {

namespace {

constexpr uint64_t P1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t P2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t P3 = 0x165667B19E3779F9ull;
constexpr uint64_t P4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t P5 = 0x27D4EB2F165667C5ull;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

}  // namespace


namespace {

constexpr uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

constexpr int kStripesPerBlock = 16;

struct HashKeys {
  uint64_t stripe[kStripesPerBlock][8];  // per stripe position, per lane
  uint64_t scramble[8];
  constexpr HashKeys() : stripe{}, scramble{} {
    uint64_t s = 0x5350455353594E43ull;  // "SPESSYNC"
    for (auto& row : stripe)
      for (auto& k : row) k = mix64(s += 0x9E3779B97F4A7C15ull);
    for (auto& k : scramble) k = mix64(s += 0x9E3779B97F4A7C15ull);
  }
};
constexpr HashKeys kKeys;

}  // namespace

StateHasher::StateHasher() {
  for (int j = 0; j < 8; ++j) acc_[j] = kKeys.scramble[j] ^ P1;
}

namespace {

inline void scramble(uint64_t* acc) {
  for (int j = 0; j < 8; ++j) {
    const uint64_t a = (acc[j] ^ (acc[j] >> 47)) ^ kKeys.scramble[j];
    acc[j] = (a & 0xFFFFFFFFull) * 0x9E3779B1ull + (((a >> 32) * 0x9E3779B1ull) << 32);
  }
}

// The reference definition, one stripe at a time.
void stripes_scalar(uint64_t* acc, uint32_t& pos, const uint8_t* p, size_t count) {
  for (size_t s = 0; s < count; ++s, p += 64) {
    const uint64_t* key = kKeys.stripe[pos];
    uint64_t w[8];
    std::memcpy(w, p, 64);
    for (int j = 0; j < 8; ++j) {
      const uint64_t d = w[j] ^ key[j];
      acc[j] += (d & 0xFFFFFFFFull) * (d >> 32) + w[j ^ 1];
    }
    if (++pos == kStripesPerBlock) pos = 0, scramble(acc);
  }
}

#if defined(__x86_64__)
// The same arithmetic with AVX2: two 4-lane accumulators, vpmuludq for lo·hi, and a
// 64-bit swap inside each 128-bit half for the neighbour-lane add.
__attribute__((target("avx2"))) void stripes_avx2(uint64_t* acc, uint32_t& pos, const uint8_t* p, size_t count) {
  __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc));
  __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 4));
  for (size_t s = 0; s < count; ++s, p += 64) {
    const uint64_t* key = kKeys.stripe[pos];
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
    const __m256i d0 = _mm256_xor_si256(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key)));
    const __m256i d1 = _mm256_xor_si256(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + 4)));
    const __m256i p0 = _mm256_mul_epu32(d0, _mm256_srli_epi64(d0, 32));
    const __m256i p1 = _mm256_mul_epu32(d1, _mm256_srli_epi64(d1, 32));
    a0 = _mm256_add_epi64(a0, _mm256_add_epi64(p0, _mm256_shuffle_epi32(w0, _MM_SHUFFLE(1, 0, 3, 2))));
    a1 = _mm256_add_epi64(a1, _mm256_add_epi64(p1, _mm256_shuffle_epi32(w1, _MM_SHUFFLE(1, 0, 3, 2))));
    if (++pos == kStripesPerBlock) {
      pos = 0;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 4), a1);
      scramble(acc);
      a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc));
      a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 4));
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 4), a1);
}
#endif

}  // namespace

void StateHasher::stripes(const uint8_t* p, size_t count) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return stripes_avx2(acc_, stripe_, p, count);
#endif
  stripes_scalar(acc_, stripe_, p, count);
}

void StateHasher::update(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  total_ += n;
  if (buf_n_) {
    const size_t take = std::min(n, 64 - buf_n_);
    std::memcpy(buf_ + buf_n_, p, take);
    buf_n_ += take;
    p += take;
    n -= take;
    if (buf_n_ < 64) return;
    stripes(buf_, 1);
    buf_n_ = 0;
  }
  stripes(p, n / 64);
  p += n / 64 * 64;
  n %= 64;
  std::memcpy(buf_, p, n);
  buf_n_ = n;
}

uint64_t StateHasher::digest() const {
  uint64_t h = mix64(total_ ^ P5);
  for (int j = 0; j < 8; ++j) h = rotl(h ^ mix64(acc_[j] + kKeys.scramble[j]), 27) * P1 + P4;
  for (size_t i = 0; i < buf_n_; i += 8) {
    uint64_t w = 0;
    std::memcpy(&w, buf_ + i, std::min<size_t>(8, buf_n_ - i));
    h = rotl(h ^ mix64(w ^ kKeys.stripe[0][i / 8]), 31) * P2 + P3;
  }
  return mix64(h);
}

uint64_t state_hash(const float* x, int64_t n) {
  StateHasher h;
  h.update(x, n);
  return h.digest();
}

Digest hmac_sha256(const std::string& key, std::span<const uint8_t> message) {
  Digest out{};
  unsigned int len = 0;
  // An empty key is legal HMAC (insecure mode: both sides use it).
  static const uint8_t empty = 0;
  const void* k = key.empty() ? static_cast<const void*>(&empty) : key.data();
  if (!HMAC(EVP_sha256(), k, static_cast<int>(key.size()), message.data(), message.size(),
            out.data(), &len) || len != out.size())
    throw NetError("HMAC-SHA256 failed (OpenSSL)");
  return out;
}

bool digest_equal(std::span<const uint8_t> a, std::span<const uint8_t> b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

void random_bytes(uint8_t* out, size_t n) {
  if (RAND_bytes(out, static_cast<int>(n)) != 1) throw NetError("RAND_bytes failed (OpenSSL)");
}

std::string hash_hex(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

}  // namespace spes::net
