#include "data/tokenizer.hpp"

#include "engine/base/error.hpp"

namespace spes {

namespace {

template <typename T>
std::string decode_ids(std::span<const T> tokens) {
  std::string text;
  text.reserve(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int64_t id = static_cast<int64_t>(tokens[i]);
    if (id < 0 || id >= ByteTokenizer::kVocabSize) {
      throw DataError("byte tokenizer: token id " + std::to_string(id) + " at position " + std::to_string(i) +
                      " is outside the byte vocabulary [0, 256)");
    }
    text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
  }
  return text;
}

}  // namespace

void ByteTokenizer::encode_into(std::string_view text, std::vector<uint32_t>& out) {
  out.reserve(out.size() + text.size());
  for (char c : text) out.push_back(static_cast<unsigned char>(c));
}

std::vector<uint32_t> ByteTokenizer::encode(std::string_view text) {
  std::vector<uint32_t> out;
  encode_into(text, out);
  return out;
}

std::string ByteTokenizer::decode(std::span<const int32_t> tokens) { return decode_ids(tokens); }
std::string ByteTokenizer::decode(std::span<const uint32_t> tokens) { return decode_ids(tokens); }

}  // namespace spes
