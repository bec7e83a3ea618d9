// The tokenizers the engine knows, behind one interface:
//
//   "bytes"             ByteTokenizer: token = byte value, vocabulary 256, document
//                       separator byte 0. Needs no file, so the demo runs on a fresh
//                       clone.
//   path/to/tokenizer.json
//                       BpeTokenizer (data/bpe_tokenizer.hpp): the byte-level BPE
//                       tokenizers real SPES runs use (OLMo's GPT-NeoX, Qwen2.5), read
//                       from a Hugging Face `tokenizer.json`, token for token equal to
//                       the `tokenizers` package.
//
// open_tokenizer(spec) picks one. Every method is const and thread-safe: the tokenize
// tool encodes blocks of one corpus on all cores through one Tokenizer.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/error.hpp"

namespace spes {

// Text that is not valid UTF-8 (a BPE tokenizer needs characters, not bytes): the
// offset of the first bad byte within the text given to encode.
struct InvalidUtf8Error : DataError {
  InvalidUtf8Error(const std::string& what, size_t offset) : DataError(what), offset(offset) {}
  size_t offset;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // "bytes" or the tokenizer.json path: how errors and manifests name it.
  virtual const std::string& name() const = 0;
  // Ids are in [0, vocab_size()): a model's vocab_size must be at least this.
  virtual int64_t vocab_size() const = 0;
  // The token the tokenize tool appends after every document, and its text.
  virtual uint32_t eos_id() const = 0;
  virtual std::string eos_text() const = 0;

  // Appends the ids of `text`. Throws InvalidUtf8Error when the tokenizer needs
  // UTF-8 and `text` is not.
  virtual void encode_into(std::string_view text, std::vector<uint32_t>& out) const = 0;
  std::vector<uint32_t> encode(std::string_view text) const;

  // The bytes the ids stand for (decode(encode(t)) == t for t in the tokenizer's
  // normal form). Throws DataError for an id outside [0, vocab_size()).
  virtual std::string decode(std::span<const uint32_t> ids) const = 0;
  std::string decode(std::span<const int32_t> ids) const;

  // The first position p >= from where `text` may be cut so that encoding
  // text[..p) and text[p..) separately gives exactly the ids of the whole;
  // text.size() when there is none. Lets the tokenize tool encode one long document
  // in parallel blocks with output identical for any number of threads.
  virtual size_t next_cut(std::string_view text, size_t from) const = 0;
};

class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int64_t kVocabSize = 256;
  // Byte 0 (NUL) never occurs in text, so it cannot be confused with content, and a
  // model learns it as "end of document" (the role of OLMo's EOS token).
  static constexpr uint32_t kEos = 0;

  const std::string& name() const override;
  int64_t vocab_size() const override { return kVocabSize; }
  uint32_t eos_id() const override { return kEos; }
  std::string eos_text() const override { return std::string(1, '\0'); }
  void encode_into(std::string_view text, std::vector<uint32_t>& out) const override;
  std::string decode(std::span<const uint32_t> ids) const override;
  using Tokenizer::decode;
  size_t next_cut(std::string_view text, size_t from) const override { return std::min(from, text.size()); }
};

// "bytes" -> ByteTokenizer; anything else is a path to a tokenizer.json ->
// BpeTokenizer. Throws DataError naming the file when it is missing or unsupported.
std::unique_ptr<Tokenizer> open_tokenizer(const std::string& spec);

}  // namespace spes
