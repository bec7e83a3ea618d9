// Byte-level BPE from a Hugging Face `tokenizer.json`, equal token for token to the
// `tokenizers` package (checked by tests/test_bpe_oracle.cpp) for the two families
// SPES runs use: OLMo's GPT-NeoX tokenizer and Qwen2/Qwen2.5's.
//
// What encode does, in the order `tokenizers` does it:
//  1. The text must be valid UTF-8; otherwise InvalidUtf8Error with the offset of the
//     first bad byte (never a replacement: a corpus with broken bytes is a bug to fix
//     upstream, and a silently changed text would not match the `tokenizers` package,
//     which cannot even hold such text in a Python str).
//  2. Added tokens with "normalized": false (e.g. "<|endoftext|>") are cut out of the
//     raw text, leftmost-longest (aho-corasick LeftmostLongest in `tokenizers`).
//  3. Each remaining piece is normalized (NFC, when the file asks for it), then the
//     added tokens with "normalized": true (NeoX's runs of 2..24 spaces) are cut out.
//  4. Each remaining piece goes through the pre-tokenizer: ByteLevel (optionally with
//     add_prefix_space; with use_regex, split by the GPT-2 regex), or a Sequence of
//     Split (a regex or a literal string, behavior "Isolated") ending with ByteLevel.
//     Regexes run on PCRE2 with JIT; Oniguruma's \s, \S, \d, \w (what `tokenizers`
//     uses) are translated to the same character sets.
//  5. Each word is BPE-merged by merge rank (lowest first, leftmost among equal), with
//     a per-thread cache of recent words.
// decode maps each id to its token text and undoes the byte-to-character mapping of
// the ByteLevel decoder; it returns the exact bytes (`tokenizers` returns a Python str
// and so replaces a byte sequence that is not UTF-8 by U+FFFD; for ids from encode the
// two agree).
//
// Supported, and nothing else (anything else is refused at load with one line naming
// the file and the component): model BPE without dropout, byte_fallback,
// ignore_merges or subword prefixes/suffixes, merges as "a b" strings or ["a", "b"]
// pairs, every byte that can occur in UTF-8 in the vocabulary; normalizer null or NFC
// (alone or in a Sequence); pre-tokenizer ByteLevel, or Sequence of Split(s) ending in
// ByteLevel; decoder ByteLevel; post-processor null or ByteLevel (it adds no tokens);
// added tokens without single_word/lstrip/rstrip; no truncation or padding.
//
// Vocabulary size = largest id (vocab or added token) + 1 (NeoX 50280, Qwen2.5 151665).
// End-of-document token (appended by the tokenize tool): the first special added token
// whose text is one of "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>" (in this
// order); a file with none is refused. Both NeoX and Qwen2 use "<|endoftext|>".
// Special tokens written in the text itself are encoded as those tokens, as
// `tokenizers` (and OLMo's data pipeline) does.
#pragma once
#include <memory>
#include <string>

#include "data/tokenizer.hpp"

namespace spes {

class BpeTokenizer final : public Tokenizer {
 public:
  // Reads `path`; throws DataError "PATH: ..." (one line) when it is missing, not JSON,
  // or uses a component listed as unsupported above.
  explicit BpeTokenizer(const std::string& path);
  // The same from JSON text; `name` stands for the file in messages.
  BpeTokenizer(const std::string& json_text, const std::string& name);
  ~BpeTokenizer() override;
  BpeTokenizer(const BpeTokenizer&) = delete;
  BpeTokenizer& operator=(const BpeTokenizer&) = delete;

  const std::string& name() const override;
  int64_t vocab_size() const override;
  uint32_t eos_id() const override;
  std::string eos_text() const override;
  void encode_into(std::string_view text, std::vector<uint32_t>& out) const override;
  std::string decode(std::span<const uint32_t> ids) const override;
  using Tokenizer::decode;
  // Cuts where neither the added tokens, NFC nor the pre-tokenizer regex can join
  // across (a lone "\n" between two non-space characters; an ASCII letter, a space,
  // an ASCII letter): only for the two regexes this was worked out for (GPT-2's and
  // Qwen2's); other files are not cut within a document.
  size_t next_cut(std::string_view text, size_t from) const override;

  // The token's text as in the file (an added token's content, else the vocab key).
  const std::string& token_text(uint32_t id) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The Unicode versions of the character tables behind encode: PCRE2's (\p{L}, \p{N},
// case folding) and utf8proc's (NFC). Text with characters assigned after the older
// of the two can split differently from `tokenizers` (whose Oniguruma is newer): such
// a character is not a letter to our regex.
struct UnicodeVersions {
  std::string regex;
  std::string normalizer;
};
UnicodeVersions bpe_unicode_versions();

// The offset of the first byte of `text` that does not belong to a valid UTF-8
// sequence (overlong forms, surrogates and code points above U+10FFFF are invalid),
// or text.size() when all of it is valid.
size_t find_invalid_utf8(std::string_view text);

}  // namespace spes
