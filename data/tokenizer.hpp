// The built-in byte-level tokenizer: token = byte value, vocab 256. It needs no
// files, so the demo runs on a fresh clone; real runs bring OLMo-format token files
// made by their own tokenizer.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace spes {

struct ByteTokenizer {
  static constexpr int64_t kVocabSize = 256;
  // The document separator the tokenize tool appends after each document (the role
  // of OLMo's EOS token). Byte 0 (NUL) never occurs in text, so it cannot be confused
  // with content, and a model learns it as "end of document".
  static constexpr uint32_t kEos = 0;

  static std::vector<uint32_t> encode(std::string_view text);
  // Appends the tokens of `text` to `out` (no allocation per call beyond growth).
  static void encode_into(std::string_view text, std::vector<uint32_t>& out);
  // Throws DataError for an id outside [0, 256).
  static std::string decode(std::span<const int32_t> tokens);
  static std::string decode(std::span<const uint32_t> tokens);
};

}  // namespace spes
