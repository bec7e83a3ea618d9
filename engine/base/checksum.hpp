// CRC32C (Castagnoli), the checksum of checkpoint sections and wire frames.
// Chainable: crc32c(b, crc32c(a)) == crc32c(a ++ b), and crc32c("123456789") is
// 0xE3069283 (RFC 3720 check value).
#pragma once
#include <cstddef>
#include <cstdint>

namespace spes {

uint32_t crc32c(const void* data, size_t n, uint32_t seed = 0);

// The portable Boost.CRC version; crc32c() uses the CPU's crc32 instruction (three
// interleaved streams) when it has one. Exposed so a test can hold them equal.
uint32_t crc32c_portable(const void* data, size_t n, uint32_t seed = 0);

}  // namespace spes
