#include "data/input_stream.hpp"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>
#include <zstd_errors.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/base/error.hpp"

namespace spes {

namespace fs = std::filesystem;

namespace {

constexpr size_t kFileBufferBytes = size_t{1} << 20;
constexpr size_t kReadAheadChunks = 4;  // decoded chunks of kFileBufferBytes waiting to be read

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

Compression compression_of(const std::string& path) {
  const std::string ext = fs::path(path).extension().string();
  if (ext == ".gz") return Compression::kGzip;
  if (ext == ".zst") return Compression::kZstd;
  if (ext == ".bz2" || ext == ".xz" || ext == ".lz4" || ext == ".lzma" || ext == ".br" || ext == ".zip" ||
      ext == ".7z") {
    throw DataError(path + ": " + ext + " compression is not read (gzip .gz and zstd .zst are); decompress it or "
                    "recompress it with zstd");
  }
  return Compression::kNone;
}

std::string without_compression_extension(const std::string& path) {
  for (const char* ext : {".gz", ".zst"})
    if (ends_with(path, ext)) return path.substr(0, path.size() - std::strlen(ext));
  return path;
}

// The file's bytes, plain or through a decoder. `pending_output` remembers that the
// last decoder call filled the caller's buffer, so the decoder may still hold output
// even when no input is left.
//
// Read-ahead: a compressed file is decoded on a thread of its own, up to
// kReadAheadChunks chunks ahead of the reader, so decompression overlaps the
// reader's work (JSON parsing, encoding) instead of adding to it; the reader gets
// the decoded bytes in order, and a decoding error where the reader reaches it.
struct InputStream::Impl {
  std::string path;
  Compression compression = Compression::kNone;
  int fd = -1;
  std::vector<char> in;  // compressed bytes [in_pos, in_end) not yet consumed
  size_t in_pos = 0, in_end = 0;
  std::atomic<uint64_t> file_read{0};
  bool eof = false;
  bool in_unit = false;  // inside a gzip member or zstd frame that has not ended
  bool pending_output = false;
  z_stream z{};
  bool z_ready = false;
  ZSTD_DCtx* zstd = nullptr;

  std::thread worker;
  std::mutex mu;
  std::condition_variable changed;
  std::deque<std::string> ready;  // decoded chunks, in order
  std::vector<std::string> spare;  // chunks read to the end, for the worker to refill
  bool decoded_all = false, stopping = false;
  std::exception_ptr error;
  std::string chunk;  // the chunk being read, from chunk_pos
  size_t chunk_pos = 0;

  ~Impl() {
    if (worker.joinable()) {
      {
        std::lock_guard<std::mutex> lk(mu);
        stopping = true;
      }
      changed.notify_all();
      worker.join();
    }
    if (z_ready) inflateEnd(&z);
    if (zstd != nullptr) ZSTD_freeDCtx(zstd);
    if (fd >= 0) ::close(fd);
  }

  [[noreturn]] void fail(const std::string& why) const {
    const char* what = compression == Compression::kGzip ? "gzip" : "zstd";
    throw DataError(path + ": not valid " + std::string(what) + " data near compressed byte " +
                    std::to_string(file_read - (in_end - in_pos)) + " (" + why + ")");
  }
  [[noreturn]] void truncated() const {
    throw DataError(path + ": the " + std::string(compression == Compression::kGzip ? "gzip member" : "zstd frame") +
                    " is cut off at the end of the file (truncated download?)");
  }

  // Reads the next piece of the file into `in`; false at its end.
  bool refill() {
    in_pos = in_end = 0;
    while (true) {
      const ssize_t got = ::read(fd, in.data(), in.size());
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) throw DataError(path + ": read error (" + std::string(std::strerror(errno)) + ")");
      in_end = static_cast<size_t>(got);
      file_read += in_end;
      eof = got == 0;
      return got > 0;
    }
  }

  size_t read_plain(char* out, size_t n) {
    while (true) {
      const ssize_t got = ::read(fd, out, n);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) throw DataError(path + ": read error (" + std::string(std::strerror(errno)) + ")");
      file_read += static_cast<uint64_t>(got);
      return static_cast<size_t>(got);
    }
  }

  // One decoder step on the buffered input; returns the bytes written to out.
  size_t step_gzip(char* out, size_t n) {
    z.next_in = reinterpret_cast<Bytef*>(in.data() + in_pos);
    z.avail_in = static_cast<uInt>(in_end - in_pos);
    z.next_out = reinterpret_cast<Bytef*>(out);
    z.avail_out = static_cast<uInt>(n);
    if (z.avail_in > 0) in_unit = true;
    const int rc = inflate(&z, Z_NO_FLUSH);
    in_pos = in_end - z.avail_in;
    if (rc == Z_STREAM_END) {
      in_unit = false;  // the next member, if any, starts at in_pos
      inflateReset(&z);
    } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
      fail(z.msg != nullptr ? z.msg : "zlib error " + std::to_string(rc));
    }
    return n - z.avail_out;
  }

  size_t step_zstd(char* out, size_t n) {
    ZSTD_inBuffer ib{in.data() + in_pos, in_end - in_pos, 0};
    ZSTD_outBuffer ob{out, n, 0};
    const size_t rc = ZSTD_decompressStream(zstd, &ob, &ib);
    in_pos += ib.pos;
    if (ZSTD_isError(rc) && ZSTD_getErrorCode(rc) == ZSTD_error_frameParameter_windowTooLarge) {
      throw DataError(path + ": the zstd frame needs a window above 128 MiB (made with zstd --long=28 or more), "
                      "more than is read; recompress it with --long=27 or less");
    }
    if (ZSTD_isError(rc)) fail(ZSTD_getErrorName(rc));
    // 0: a frame ended and all of it was flushed. A call that moved nothing says
    // nothing (at a frame boundary libzstd asks for the next header all the same).
    if (ib.pos > 0 || ob.pos > 0) in_unit = rc != 0;
    return ob.pos;
  }

  // The worker: decodes chunk after chunk until the end, an error, or the reader leaves.
  void decode_ahead() {
    try {
      while (true) {
        std::string next;
        {
          std::lock_guard<std::mutex> lk(mu);
          if (!spare.empty()) {
            next = std::move(spare.back());
            spare.pop_back();
          }
        }
        next.resize(kFileBufferBytes);
        size_t filled = 0;
        for (size_t got; filled < next.size() && (got = decode(next.data() + filled, next.size() - filled)) > 0;)
          filled += got;
        next.resize(filled);
        std::unique_lock<std::mutex> lk(mu);
        changed.wait(lk, [&] { return stopping || ready.size() < kReadAheadChunks; });
        if (stopping) return;
        if (filled == 0) {
          decoded_all = true;
        } else {
          ready.push_back(std::move(next));
        }
        changed.notify_all();
        if (filled == 0) return;
      }
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu);
      error = std::current_exception();
      decoded_all = true;
      changed.notify_all();
    }
  }

  size_t read_decoded(char* out, size_t n) {
    if (chunk_pos == chunk.size()) {
      std::unique_lock<std::mutex> lk(mu);
      changed.wait(lk, [&] { return !ready.empty() || decoded_all; });
      if (ready.empty()) {
        if (error) std::rethrow_exception(error);
        return 0;
      }
      if (!chunk.empty()) spare.push_back(std::move(chunk));
      chunk = std::move(ready.front());
      ready.pop_front();
      chunk_pos = 0;
      changed.notify_all();
    }
    const size_t k = std::min(n, chunk.size() - chunk_pos);
    std::memcpy(out, chunk.data() + chunk_pos, k);
    chunk_pos += k;
    return k;
  }

  size_t decode(char* out, size_t n) {
    while (true) {
      if (in_pos == in_end && !pending_output) {
        if (eof || !refill()) {
          if (in_unit) truncated();
          return 0;
        }
      }
      const size_t got = compression == Compression::kGzip ? step_gzip(out, n) : step_zstd(out, n);
      pending_output = got == n;
      if (got > 0) return got;
    }
  }
};

InputStream::InputStream(const std::string& path) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.path = path;
  s.compression = compression_of(path);
  std::error_code ec;
  if (!fs::exists(path, ec)) throw DataError(path + ": input file not found");
  if (!fs::is_regular_file(path, ec)) throw DataError(path + ": input is not a regular file");
  s.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (s.fd < 0) throw DataError(path + ": cannot be read (" + std::string(std::strerror(errno)) + ")");
  ::posix_fadvise(s.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  if (s.compression == Compression::kNone) return;
  s.in.resize(kFileBufferBytes);
  if (s.compression == Compression::kGzip) {
    // 15 + 32: a 32 KiB window, gzip or zlib header detected.
    if (inflateInit2(&s.z, 15 + 32) != Z_OK) throw DataError(path + ": cannot start zlib");
    s.z_ready = true;
  } else {
    s.zstd = ZSTD_createDCtx();
    if (s.zstd == nullptr) throw DataError(path + ": cannot start libzstd");
  }
  s.worker = std::thread([&s] { s.decode_ahead(); });
}

InputStream::~InputStream() = default;

size_t InputStream::read(char* out, size_t n) {
  if (n == 0) return 0;
  return impl_->compression == Compression::kNone ? impl_->read_plain(out, n) : impl_->read_decoded(out, n);
}

bool InputStream::skip(uint64_t n) {
  if (impl_->compression == Compression::kNone) {
    const off_t at = ::lseek(impl_->fd, 0, SEEK_CUR);
    const off_t end = ::lseek(impl_->fd, 0, SEEK_END);
    const uint64_t to = std::min<uint64_t>(uint64_t(at) + n, uint64_t(end));
    ::lseek(impl_->fd, static_cast<off_t>(to), SEEK_SET);
    impl_->file_read = to;
    return to - uint64_t(at) == n;
  }
  std::vector<char> sink(kFileBufferBytes);
  while (n > 0) {
    const size_t got = read(sink.data(), static_cast<size_t>(std::min<uint64_t>(n, sink.size())));
    if (got == 0) return false;
    n -= got;
  }
  return true;
}

uint64_t InputStream::file_bytes_read() const { return impl_->file_read.load(std::memory_order_relaxed); }
const std::string& InputStream::path() const { return impl_->path; }

uint64_t content_size(const std::string& path) {
  if (compression_of(path) == Compression::kNone) {
    std::error_code ec;
    const uint64_t size = fs::file_size(path, ec);
    if (ec) throw DataError(path + ": cannot be read (" + ec.message() + ")");
    return size;
  }
  InputStream in(path);
  std::vector<char> buf(kFileBufferBytes);
  uint64_t total = 0;
  for (size_t got; (got = in.read(buf.data(), buf.size())) > 0;) total += got;
  return total;
}

}  // namespace spes
