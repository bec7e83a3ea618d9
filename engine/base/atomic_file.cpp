#include "engine/base/atomic_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "engine/base/error.hpp"

namespace spes {

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what, int err) {
  throw CheckpointError(path + ": " + what + ": " + std::strerror(err));
}

}  // namespace

FileWriter::FileWriter(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(path_, "cannot create", errno);
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::write(const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    // Linux writes at most ~2 GiB per call; loop for big tensors and short writes.
    ssize_t w = ::write(fd_, p, n < (size_t{1} << 30) ? n : (size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(path_, "write failed", errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
    written_ += static_cast<size_t>(w);
  }
}

void FileWriter::finish() {
  if (fd_ < 0) return;
  int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    fail(path_, "fsync failed", err);
  }
  if (::close(fd) != 0) fail(path_, "close failed", errno);
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail(dir, "cannot open folder to fsync", errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  // Some filesystems refuse fsync on folders (EINVAL); the rename is still atomic there.
  if (rc != 0 && err != EINVAL) fail(dir, "folder fsync failed", err);
}

void write_file_atomic(const std::string& path, const std::function<void(FileWriter&)>& body) {
  namespace fs = std::filesystem;
  const std::string tmp = path + ".tmp";
  try {
    FileWriter w(tmp);
    body(w);
    w.finish();
    if (::rename(tmp.c_str(), path.c_str()) != 0) fail(path, "cannot rename " + tmp + " into place", errno);
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
  fs::path parent = fs::path(path).parent_path();
  fsync_dir(parent.empty() ? "." : parent.string());
}

void write_file_atomic(const std::string& path, std::string_view content) {
  write_file_atomic(path, [&](FileWriter& w) { w.write(content); });
}

}  // namespace spes
