#include "engine/checksum.hpp"

#include <boost/crc.hpp>
#include <cstring>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace spes {

uint32_t crc32c_portable(const void* data, size_t n, uint32_t seed) {
  // Reflected CRC-32C; init 0xFFFFFFFF and final xor 0xFFFFFFFF, so continuing
  // from a previous result means starting from its complement.
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc(seed ^ 0xFFFFFFFFu);
  crc.process_bytes(data, n);
  return crc.checksum();
}

uint32_t crc32c(const void* data, size_t n, uint32_t seed) {
#if defined(__SSE4_2__)
  // The hardware instruction runs ~10x faster than the byte table, which matters
  // for multi-GB checkpoints and 100M-parameter sync payloads.
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t c = ~seed;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n > 0) {
    c32 = _mm_crc32_u8(c32, *p++);
    --n;
  }
  return ~c32;
#else
  return crc32c_portable(data, n, seed);
#endif
}

}  // namespace spes
