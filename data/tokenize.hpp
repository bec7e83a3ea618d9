// Tokenizing a corpus (`spes-engine tokenize`, engine/cmd_tokenize.cpp): plain text or JSONL in, OLMo-format token files
// (data/token_file.hpp) and a manifest out, with the built-in byte-level tokenizer.
//
// Documents. A plain-text input file is one document; a JSONL line is one document
// (its "text" field). Every document ends with ByteTokenizer::kEos (byte 0), the
// byte-level stand-in for the EOS token OLMo's tokenize script appends after each
// document, so the model sees where one text stops and the next begins when
// instances cut across documents. Inputs containing a NUL byte are rejected since it
// would read as a document end; --no-eos turns the separator (and that check) off.
//
// Validation split (val_fraction F > 0). JSONL: whole documents go to validation,
// evenly spread (document d when floor((d+1)·F) > floor(d·F)), so no document is in
// both splits. Plain text: the last F of each file's bytes, starting at the first
// line start at or after the cut, so no line is split (nanoGPT's Shakespeare uses the
// same head/tail split). Outputs: <out>/train.manifest + train-NNNNN.bin and, with a
// split, <out>/val.manifest + val-NNNNN.bin. Manifests list file names relative to
// their folder, so the folder can move.
//
// Atomic output: all token files are written under temporary names and renamed into
// place only after every input was read without error; the manifests are written
// last the same way. A failed run leaves the previous outputs untouched.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/token_file.hpp"

namespace spes {

enum class InputFormat { kAuto, kText, kJsonl };  // auto: *.jsonl / *.json are JSONL, else text

struct TokenizeOptions {
  std::vector<std::string> inputs;
  std::string out_dir;
  InputFormat format = InputFormat::kAuto;
  TokenDtype dtype = TokenDtype::kUint16;
  double val_fraction = 0.0;   // [0, 1)
  bool append_eos = true;      // end each document with ByteTokenizer::kEos
  uint64_t shard_tokens = 0;   // tokens per output file; 0 = one file per split
};

struct TokenizeSummary {
  std::string train_manifest;
  std::string validation_manifest;  // empty without a split
  std::vector<std::string> train_files;
  std::vector<std::string> validation_files;
  uint64_t train_tokens = 0;
  uint64_t validation_tokens = 0;
  uint64_t documents = 0;
};

// Throws DataError naming the file (and line, for JSONL) on bad input: missing file,
// invalid JSON, a line that is not an object or lacks a string "text", a NUL byte,
// or an output split that would be empty.
TokenizeSummary run_tokenize(const TokenizeOptions& options);

}  // namespace spes
