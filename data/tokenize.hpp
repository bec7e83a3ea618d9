// Tokenizing a corpus (`spes-engine tokenize`, engine/cmd_tokenize.cpp): plain text or
// JSONL in, plain or compressed (gzip, zstd: data/input_stream.hpp), as files or
// folders; OLMo-format token files (data/token_file.hpp) and a manifest out, with the
// byte-level tokenizer or a BPE tokenizer.json (data/tokenizer.hpp).
//
// Inputs. A file is read as named; a folder stands for every *.jsonl, *.json and
// *.txt under it (recursively), each plain, .gz or .zst, in byte order of their paths
// (as `find DIR -type f | LC_ALL=C sort`), so the output does not depend on the
// order the file system lists them in.
//
// Documents. A plain-text input file is one document; a JSONL line is one document
// (its text field, `text` unless named otherwise). A line whose object lacks the field
// or holds a non-string there is an error naming file and line, or, with skip_bad,
// skipped and counted. Every document ends with the tokenizer's EOS token, as OLMo's
// tokenize script appends one after each document, so the model sees where one text
// stops and the next begins when instances cut across documents: byte 0 for the byte
// tokenizer (inputs containing a NUL byte are then rejected, since it would read as a
// document end), the file's end-of-text token for BPE (see data/bpe_tokenizer.hpp).
// --no-eos turns the separator (and the NUL check) off.
//
// Token width. uint16 when every id fits (vocabulary <= 65536), else uint32; asking
// for uint16 with a larger vocabulary is an error.
//
// Threads. Documents, and long documents cut where the tokenizer says a cut cannot
// change the tokens (Tokenizer::next_cut), are encoded as blocks on `threads` threads
// (std::thread) and written in input order: the output is identical for any number
// of threads, and for a compressed input identical to that of its decompressed copy.
//
// Memory. Inputs are streamed: per input, one 1 MiB read buffer, the decompressor's
// window and ~5 MiB of decoded text read ahead (data/input_stream.hpp); then ~16 MiB
// of text waiting to be encoded (plus the document that crossed the mark), held once
// as blocks, and its ids (4 bytes per token in vectors grown by doubling), one 1 MiB
// write buffer per split, and the longest stretch of a document that holds no cut
// point (a JSONL document is parsed whole; a text file with no cut point, e.g. under
// a tokenizer that is never cut, is held whole). Peak RSS on a 2.39 GB compressed
// corpus: bench/RESULTS.md.
//
// Validation split (val_fraction F > 0). JSONL: whole documents go to validation,
// evenly spread (document d when floor((d+1)·F) > floor(d·F)), so no document is in
// both splits. Plain text: the last F of each file's bytes, starting at the first
// line start at or after the cut, so no line is split (nanoGPT's Shakespeare uses the
// same head/tail split); head and tail are then two documents (a compressed text file
// is decompressed twice more to find the cut, its size being stored nowhere).
// Outputs: <out>/train.manifest + train-NNNNN.bin and, with a split, <out>/val.manifest +
// val-NNNNN.bin, each token file at most max_shard_bytes and written as it fills.
// Manifests list file names relative to their folder, so the folder can move.
//
// Atomic output: all token files are written under temporary names and renamed into
// place only after every input was read without error; the manifests are written
// last the same way. A failed run leaves the previous outputs untouched.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/token_file.hpp"

namespace spes {

// auto: *.jsonl / *.json (before a .gz / .zst) are JSONL, else text
enum class InputFormat { kAuto, kText, kJsonl };

struct TokenizeOptions {
  std::vector<std::string> inputs;  // files and folders
  std::string out_dir;
  InputFormat format = InputFormat::kAuto;
  std::string tokenizer = "bytes";  // "bytes" or a path to a tokenizer.json
  std::optional<TokenDtype> dtype;  // unset: uint16 when the vocabulary fits, else uint32
  double val_fraction = 0.0;   // [0, 1)
  bool append_eos = true;      // end each document with the tokenizer's EOS token
  uint64_t max_shard_bytes = uint64_t{4} << 30;  // the largest output token file
  std::string text_field = "text";               // JSONL: the document's field
  bool skip_bad = false;  // JSONL: skip (and count) documents without a string text field
  int64_t threads = 0;         // encoding threads; 0 = all cores
};

struct TokenizeSummary {
  std::string train_manifest;
  std::string validation_manifest;  // empty without a split
  std::vector<std::string> train_files;
  std::vector<std::string> validation_files;
  uint64_t train_tokens = 0;
  uint64_t validation_tokens = 0;
  uint64_t documents = 0;
  uint64_t inputs = 0;          // input files read (folders expanded)
  uint64_t skipped = 0;         // documents skipped by skip_bad
  std::string first_skipped;    // "file:line: why" of the first of them
  TokenDtype dtype = TokenDtype::kUint16;
  int64_t vocab_size = 0;
};

// The input files that `inputs` stands for: files as given, each folder replaced by
// its corpus files in byte order of their paths. Throws DataError for a folder
// without any.
std::vector<std::string> list_inputs(const std::vector<std::string>& inputs);

// Throws DataError naming the file (and line) on bad input: missing file, corrupt or
// truncated compressed data, an unread compression (.xz, .bz2, ...), invalid JSON, a
// line that is not an object or lacks a string text field, a NUL byte (byte
// tokenizer), text that is not UTF-8 (BPE: the byte offset too), an output split
// that would be empty; and naming the tokenizer when it cannot be used.
TokenizeSummary run_tokenize(const TokenizeOptions& options);

}  // namespace spes
