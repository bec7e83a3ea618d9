// Exact positional file I/O for the coordinator's state and spill files: pread /
// pwrite of exactly n bytes at an offset, retried on EINTR and short counts, safe
// from several threads. A failure throws NetError "<what>: read failed: <reason>"
// (or "<what>: truncated" when the file ends first).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace spes::net {

void pread_exact(int fd, const std::string& what, void* dst, size_t n, int64_t at);
void pwrite_exact(int fd, const std::string& what, const void* src, size_t n, int64_t at);

}  // namespace spes::net
