// OLMo-format token data: raw little-endian uint16 or uint32 arrays with no header
// (what OLMo's prepare_memmap_dataset / dolma and the SPES scripts write), listed
// one file per line in a manifest, memory-mapped read-only and cut into fixed-length
// training instances.
//
// Instance boundaries. Instance i of a file is tokens [i·(S+1), (i+1)·(S+1)) with
// S = model seq_len: it feeds S input positions and S shifted targets, so every
// position the model computes has a label. OLMo's MemMapDataset cuts chunks of
// max_sequence_length tokens and trains on chunk[:-1] -> chunk[1:] (one fewer
// prediction than positions); our layout is exactly OLMo's with chunk_size = S+1,
// which keeps the model's context (and max_position_embeddings on export) at S.
// As in OLMo, instances never span two files and a file's trailing tokens that do
// not fill an instance are dropped.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/enum_names.hpp"

namespace spes {

enum class TokenDtype : uint8_t { kUint16, kUint32 };
inline constexpr EnumName<TokenDtype> kTokenDtypeNames[] = {{TokenDtype::kUint16, "uint16"},
                                                            {TokenDtype::kUint32, "uint32"}};

// "uint16" | "uint32"; anything else throws DataError.
TokenDtype parse_token_dtype(std::string_view name);
const char* token_dtype_name(TokenDtype dtype);
inline size_t token_width(TokenDtype dtype) { return dtype == TokenDtype::kUint16 ? 2 : 4; }

// One token file, memory-mapped read-only, whatever its name (the SPES reference's
// raw memmaps are named `.npy`). Throws DataError naming the file when it is missing,
// unreadable, its size is not a multiple of the token width, or it starts with a
// NumPy header (an np.save file, not a raw array).
class TokenFile {
 public:
  TokenFile(std::string path, TokenDtype dtype);
  ~TokenFile();
  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  TokenDtype dtype() const { return dtype_; }
  uint64_t n_tokens() const { return n_tokens_; }

  // Copies tokens [begin, begin+count) to out as int32, checking each id is below
  // vocab_size; a bad id throws DataError naming the file and the token offset.
  void read(uint64_t begin, uint64_t count, int64_t vocab_size, int32_t* out) const;
  // Scans the whole file with the same check.
  void validate(int64_t vocab_size) const;

 private:
  void unmap() noexcept;
  void refuse_npy_header();
  [[noreturn]] void throw_bad_token(uint64_t offset, uint32_t id, int64_t vocab_size) const;

  std::string path_;
  TokenDtype dtype_ = TokenDtype::kUint16;
  const unsigned char* data_ = nullptr;  // mapping (nullptr for an empty file)
  size_t map_bytes_ = 0;
  uint64_t n_tokens_ = 0;
};

// Reads a manifest: one token-file path per line, optionally followed by a tab and
// the file's size in bytes (tokenize writes it; a file of another size is a
// DataError); blank lines and lines starting with '#' are skipped, surrounding
// whitespace is trimmed, relative paths are resolved against the manifest's folder.
// Throws DataError when the manifest is missing or lists no files.
std::vector<std::string> read_manifest(const std::string& manifest_path);

struct DatasetOptions {
  TokenDtype dtype = TokenDtype::kUint16;
  int64_t seq_len = 0;     // model context S; an instance is S+1 tokens
  int64_t vocab_size = 0;  // every token id must be below this
  // Files up to this size are scanned for bad token ids when opened, so a bad file
  // fails at startup; bigger files are checked instance by instance as they are read
  // (the error still names file and offset).
  uint64_t scan_at_load_bytes = uint64_t{64} << 20;
};

// All instances of all files of a manifest, in manifest order.
class TokenDataset {
 public:
  TokenDataset(const std::string& manifest_path, const DatasetOptions& options);
  // The same from an explicit file list; `source` names it in error messages.
  TokenDataset(const std::vector<std::string>& files, const DatasetOptions& options,
               std::string source);

  const std::string& source() const { return source_; }
  int64_t seq_len() const { return options_.seq_len; }
  int64_t instance_tokens() const { return options_.seq_len + 1; }
  int64_t vocab_size() const { return options_.vocab_size; }
  uint64_t n_instances() const { return n_instances_; }
  size_t n_files() const { return files_.size(); }
  const TokenFile& file(size_t i) const { return files_[i]; }

  // Writes the instance's seq_len+1 tokens to out.
  void read_instance(uint64_t instance, int32_t* out) const;
  // Which file holds an instance, and the token offset of its first token there.
  struct Location {
    size_t file;
    uint64_t token_offset;
  };
  Location locate(uint64_t instance) const;

  // Hash of what decides the instance list (dtype, seq_len, each file's token count;
  // not the paths, so a data folder may move). A sampler state remembers it so that
  // a resume on different data is refused instead of silently reading other tokens.
  uint64_t fingerprint() const;

 private:
  void open(const std::vector<std::string>& files);

  std::string source_;
  DatasetOptions options_;
  std::vector<TokenFile> files_;
  std::vector<uint64_t> first_instance_;  // per file, plus the total at the end
  uint64_t n_instances_ = 0;
};

}  // namespace spes
