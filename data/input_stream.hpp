// A corpus file read front to back as bytes, whether it ships plain, gzip-compressed
// (`.gz`, zlib) or zstd-compressed (`.zst`, libzstd), so that `spes-engine tokenize`
// reads corpora as they ship (Dolma's `.json.gz`, the Pile's `.jsonl.zst`) without a
// decompressed copy on disk.
//
// Streaming: the stream holds one 1 MiB buffer of compressed input, the
// decompressor's state (zlib: a 32 KiB window; zstd: the frame's window, at most
// 128 MiB, libzstd's default limit, within which every level and `--long` stay;
// files made with `zstd --long=28` and up exceed it and are refused, saying so) and up
// to 5 MiB of decoded text read ahead, never the whole file. A compressed file is
// decoded on a thread of its own, ahead of the reader, so decompression overlaps the
// tokenizer's work. Concatenated gzip members (pigz, bgzip, `cat a.gz b.gz`) and zstd
// frames are read one after the other, as `zcat` and `zstdcat` do.
//
// The compression is named by the extension; other compressions (.bz2, .xz, .lz4,
// ...) are refused with one line naming the file.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace spes {

enum class Compression { kNone, kGzip, kZstd };

// By the file name's last extension; throws DataError for a compression that is not read.
Compression compression_of(const std::string& path);
// The name without its compression extension ("a.jsonl.gz" -> "a.jsonl").
std::string without_compression_extension(const std::string& path);

class InputStream {
 public:
  // Throws DataError naming the file when it cannot be opened.
  explicit InputStream(const std::string& path);
  ~InputStream();
  InputStream(const InputStream&) = delete;
  InputStream& operator=(const InputStream&) = delete;

  // Up to n > 0 bytes of (decompressed) content into out; 0 only at the end. Corrupt
  // or truncated compressed data throws DataError naming the file and the
  // compressed byte offset.
  size_t read(char* out, size_t n);
  // Skips n bytes of content (plain files seek; compressed ones decompress and
  // discard); false when the content ends first.
  bool skip(uint64_t n);
  // Bytes of the file itself consumed so far (for progress on compressed input).
  uint64_t file_bytes_read() const;
  const std::string& path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The content's size in bytes: the file size for plain files, a decompressing pass
// for compressed ones (neither gzip nor zstd stores it reliably).
uint64_t content_size(const std::string& path);

}  // namespace spes
