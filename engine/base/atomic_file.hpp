// Crash-safe file writing: a file is written under a temporary name, fsynced, and
// renamed over its final name, then its folder is fsynced, so a reader sees the
// old file or the complete new one, never a torn one. Errors throw CheckpointError
// naming the file (these helpers serve checkpoints, exports and coordinator state).
#pragma once
#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace spes {

// An owned, unbuffered POSIX file opened for writing (created or truncated).
class FileWriter {
 public:
  explicit FileWriter(std::string path);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  void write(const void* data, size_t n);
  void write(std::string_view s) { write(s.data(), s.size()); }
  // fsync + close; an error here (e.g. disk full surfacing late) throws.
  void finish();
  const std::string& path() const { return path_; }
  size_t bytes_written() const { return written_; }

 private:
  std::string path_;
  int fd_ = -1;
  size_t written_ = 0;
};

// fsync a folder so that renames and creations inside it are durable.
void fsync_dir(const std::string& dir);

// Writes `path` atomically: `body` fills <path>.tmp, which is then fsynced and
// renamed over `path`; the folder is fsynced. On any error the temp file is removed.
void write_file_atomic(const std::string& path, const std::function<void(FileWriter&)>& body);
void write_file_atomic(const std::string& path, std::string_view content);

}  // namespace spes
