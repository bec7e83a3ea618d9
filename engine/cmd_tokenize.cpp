// `spes-engine tokenize --input FILE|DIR... --out DIR [--tokenizer bytes|TOKENIZER.json]
// [--format auto|text|jsonl] [--text-field NAME] [--skip-bad] [--dtype auto|uint16|uint32]
// [--val-fraction F] [--max-shard-bytes N] [--threads N] [--no-eos]`: text or JSONL,
// plain, gzip or zstd, to OLMo-format token files and manifests (data/tokenize.hpp).
// A summary goes to stderr.
#include <iostream>

#include "data/tokenize.hpp"
#include "engine/args.hpp"
#include "engine/commands.hpp"

namespace spes {

int tokenize_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  std::vector<std::string> inputs;
  std::string out_dir, format = "auto", dtype = "auto", tokenizer = "bytes", text_field = "text";
  double val_fraction = 0.0;
  int64_t max_shard_bytes = int64_t{4} << 30, threads = 0;
  bool no_eos = false, skip_bad = false;
  po::options_description opts;
  opts.add_options()("input,i", po::value(&inputs)->multitoken(), "input files and folders (also accepted as plain arguments); a folder stands for "
      "every *.jsonl, *.json, *.txt under it, each plain, .gz or .zst, in byte order of their paths")(
      "out,o", po::value(&out_dir), "output folder")(
      "tokenizer", po::value(&tokenizer), "bytes (the byte-level tokenizer) or a Hugging Face tokenizer.json (byte-level BPE)")(
      "format", po::value(&format), "auto|text|jsonl (auto: *.jsonl and *.json, also before .gz/.zst, are JSONL, anything else text)")(
      "text-field", po::value(&text_field), "JSONL: the field holding each document's text")(
      "skip-bad", po::bool_switch(&skip_bad),
      "JSONL: skip (and count) documents without a string text field instead of stopping")(
      "dtype", po::value(&dtype), "auto|uint16|uint32 token width (auto: uint16 when the vocabulary fits, else uint32)")(
      "val-fraction", po::value(&val_fraction), "hold out this fraction in [0, 1) as validation data")(
      "max-shard-bytes", po::value(&max_shard_bytes), "the largest output token file in bytes (default 4 GiB)")(
      "threads", po::value(&threads), "encoding threads (0 = all cores); the output is the same for any number")(
      "no-eos", po::bool_switch(&no_eos), "do not end documents with the tokenizer's EOS token");
  if (!parse_args(args, opts, "spes-engine tokenize --input FILE... --out DIR [options]", {"input*"})) return 0;
  TokenizeOptions opt;
  if (inputs.empty()) throw UsageError("tokenize: no input files (--input FILE...)");
  if (out_dir.empty()) throw UsageError("tokenize: no output folder (--out DIR)");
  if (format == "auto") opt.format = InputFormat::kAuto;
  else if (format == "text") opt.format = InputFormat::kText;
  else if (format == "jsonl") opt.format = InputFormat::kJsonl;
  else throw UsageError("tokenize: --format '" + format + "' is not one of auto, text, jsonl");
  if (dtype != "auto" && dtype != "uint16" && dtype != "uint32")
    throw UsageError("tokenize: --dtype '" + dtype + "' is not auto, uint16 or uint32");
  if (dtype != "auto") opt.dtype = parse_token_dtype(dtype);
  if (threads < 0) throw UsageError("tokenize: --threads must be >= 0");
  opt.threads = threads;
  opt.tokenizer = tokenizer;
  if (!(val_fraction >= 0.0 && val_fraction < 1.0)) throw UsageError("tokenize: --val-fraction must be in [0, 1)");
  opt.val_fraction = val_fraction;
  if (max_shard_bytes < 1) throw UsageError("tokenize: --max-shard-bytes must be positive");
  opt.max_shard_bytes = uint64_t(max_shard_bytes);
  if (text_field.empty()) throw UsageError("tokenize: --text-field must not be empty");
  opt.text_field = text_field;
  opt.skip_bad = skip_bad;
  opt.append_eos = !no_eos;
  opt.inputs = inputs;
  opt.out_dir = out_dir;

  const TokenizeSummary s = run_tokenize(opt);
  std::cerr << "tokenize: " << tokenizer << " (vocab " << s.vocab_size << "), " << token_dtype_name(s.dtype) << "; "
            << s.inputs << " input file(s), " << s.documents << " documents; " << s.train_tokens << " train tokens in "
            << s.train_files.size() << " file(s) -> " << s.train_manifest;
  if (!s.validation_manifest.empty())
    std::cerr << "; " << s.validation_tokens << " validation tokens in " << s.validation_files.size()
              << " file(s) -> " << s.validation_manifest;
  std::cerr << "\n";
  if (s.skipped > 0)
    std::cerr << "tokenize: skipped " << s.skipped << " document(s) without a string \"" << text_field
              << "\" (--skip-bad); the first: " << s.first_skipped << "\n";
  return 0;
}

}  // namespace spes
