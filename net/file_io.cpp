#include "net/file_io.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "engine/base/error.hpp"

namespace spes::net {

namespace {
constexpr size_t kMaxCall = size_t(1) << 30;  // bytes per syscall
}

void pread_exact(int fd, const std::string& what, void* dst, size_t n, int64_t at) {
  auto* p = static_cast<uint8_t*>(dst);
  while (n) {
    const ssize_t r = ::pread(fd, p, std::min(n, kMaxCall), off_t(at));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw NetError(what + ": read failed: " + std::strerror(errno));
    if (r == 0) throw NetError(what + ": truncated");
    p += r, at += r, n -= size_t(r);
  }
}

void pwrite_exact(int fd, const std::string& what, const void* src, size_t n, int64_t at) {
  const auto* p = static_cast<const uint8_t*>(src);
  while (n) {
    const ssize_t w = ::pwrite(fd, p, std::min(n, kMaxCall), off_t(at));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) throw NetError(what + ": write failed: " + std::strerror(errno));
    p += w, at += w, n -= size_t(w);
  }
}

}  // namespace spes::net
