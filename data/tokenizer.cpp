#include "data/tokenizer.hpp"

#include "data/bpe_tokenizer.hpp"

namespace spes {

std::vector<uint32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> out;
  encode_into(text, out);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::vector<uint32_t> u(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0) {
      throw DataError(name() + ": token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                      " is negative");
    }
    u[i] = static_cast<uint32_t>(ids[i]);
  }
  return decode(std::span<const uint32_t>(u));
}

const std::string& ByteTokenizer::name() const {
  static const std::string kName = "bytes";
  return kName;
}

void ByteTokenizer::encode_into(std::string_view text, std::vector<uint32_t>& out) const {
  out.reserve(out.size() + text.size());
  for (char c : text) out.push_back(static_cast<unsigned char>(c));
}

std::string ByteTokenizer::decode(std::span<const uint32_t> ids) const {
  std::string text;
  text.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= kVocabSize) {
      throw DataError("byte tokenizer: token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                      " is outside the byte vocabulary [0, 256)");
    }
    text.push_back(static_cast<char>(static_cast<unsigned char>(ids[i])));
  }
  return text;
}

std::unique_ptr<Tokenizer> open_tokenizer(const std::string& spec) {
  if (spec == "bytes") return std::make_unique<ByteTokenizer>();
  if (spec.empty()) throw DataError("tokenizer: empty name (expected \"bytes\" or a path to a tokenizer.json)");
  return std::make_unique<BpeTokenizer>(spec);
}

}  // namespace spes
