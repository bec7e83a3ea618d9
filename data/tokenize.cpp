#include "data/tokenize.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/input_stream.hpp"
#include "data/tokenizer.hpp"
#include "engine/base/error.hpp"
#include "engine/base/log.hpp"
#include "engine/base/progress.hpp"
#include "engine/base/parallel.hpp"

namespace spes {

namespace fs = std::filesystem;

namespace {

constexpr size_t kChunkBytes = size_t{1} << 20;

std::string errno_text() { return std::strerror(errno); }

// A file written through a temporary name; commit() fsyncs and renames it into place,
// the destructor removes an uncommitted temporary.
class AtomicFile {
 public:
  explicit AtomicFile(fs::path final_path) : final_(std::move(final_path)) {
    temp_ = final_;
    temp_ += ".tmp." + std::to_string(::getpid());
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw DataError("tokenize: cannot create " + temp_.string() + " (" + errno_text() + ")");
  }
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) {
      std::error_code ec;
      fs::remove(temp_, ec);
    }
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        throw DataError("tokenize: writing " + temp_.string() + " failed (" + errno_text() + ")");
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  // Flushes to disk and closes; the file keeps its temporary name until commit().
  void close() {
    if (fd_ < 0) return;
    if (::fsync(fd_) != 0 || ::close(fd_) != 0) {
      fd_ = -1;
      throw DataError("tokenize: flushing " + temp_.string() + " failed (" + errno_text() + ")");
    }
    fd_ = -1;
  }
  void commit() {
    close();
    std::error_code ec;
    fs::rename(temp_, final_, ec);
    if (ec) throw DataError("tokenize: cannot rename " + temp_.string() + " to " + final_.string() + " (" + ec.message() + ")");
    committed_ = true;
  }
  const fs::path& final_path() const { return final_; }

 private:
  fs::path final_;
  fs::path temp_;
  int fd_ = -1;
  bool committed_ = false;
};

// One split's output: token files of at most shard_tokens tokens each, each written
// as it fills (under its temporary name until commit()).
class ShardWriter {
 public:
  ShardWriter(fs::path dir, std::string prefix, TokenDtype dtype, uint64_t shard_tokens)
      : dir_(std::move(dir)), prefix_(std::move(prefix)), dtype_(dtype), shard_tokens_(shard_tokens) {
    buffer_.reserve(kChunkBytes + 4);
  }

  void write(const std::vector<uint32_t>& tokens) {
    for (uint32_t t : tokens) put(t);
  }
  void put(uint32_t t) {
    if (shards_.empty() || in_shard_ == shard_tokens_) start_shard();
    // Little-endian, whatever the host (the on-disk format is fixed).
    buffer_.push_back(static_cast<unsigned char>(t));
    buffer_.push_back(static_cast<unsigned char>(t >> 8));
    if (dtype_ == TokenDtype::kUint32) {
      buffer_.push_back(static_cast<unsigned char>(t >> 16));
      buffer_.push_back(static_cast<unsigned char>(t >> 24));
    }
    ++in_shard_;
    ++total_;
    if (buffer_.size() >= kChunkBytes) flush();
  }
  uint64_t tokens() const { return total_; }

  // Closes the last shard; the files keep their temporary names until commit().
  void close() {
    flush();
    for (auto& s : shards_) s->close();
  }
  std::vector<std::string> commit() {
    std::vector<std::string> names;
    for (auto& s : shards_) {
      s->commit();
      names.push_back(s->final_path().filename().string());
    }
    return names;
  }

 private:
  void start_shard() {
    flush();
    if (!shards_.empty()) shards_.back()->close();
    char name[64];
    std::snprintf(name, sizeof(name), "%s-%05zu.bin", prefix_.c_str(), shards_.size());
    shards_.push_back(std::make_unique<AtomicFile>(dir_ / name));
    in_shard_ = 0;
  }
  void flush() {
    if (!buffer_.empty()) shards_.back()->write(buffer_.data(), buffer_.size());
    buffer_.clear();
  }

  fs::path dir_;
  std::string prefix_;
  TokenDtype dtype_;
  uint64_t shard_tokens_;
  std::vector<std::unique_ptr<AtomicFile>> shards_;
  std::vector<unsigned char> buffer_;
  uint64_t in_shard_ = 0;
  uint64_t total_ = 0;
};

// JSONL or text, by the name without its compression extension.
InputFormat detect_format(const std::string& path) {
  const std::string ext = fs::path(without_compression_extension(path)).extension().string();
  return (ext == ".jsonl" || ext == ".json") ? InputFormat::kJsonl : InputFormat::kText;
}

// What a folder given as input stands for: *.jsonl, *.json, *.txt, each plain, .gz or .zst.
bool is_corpus_file_name(const std::string& name) {
  const std::string base = without_compression_extension(name);
  for (const char* ext : {".jsonl", ".json", ".txt"})
    if (base.ends_with(ext) && base.size() > std::strlen(ext)) return true;
  return false;
}

bool is_val_document(uint64_t d, double f) {
  return f > 0.0 && std::floor(static_cast<double>(d + 1) * f) > std::floor(static_cast<double>(d) * f);
}

// The 1-based line of content byte `offset`, for an error message.
uint64_t line_of(const std::string& path, uint64_t offset) {
  InputStream in(path);
  uint64_t line = 1;
  std::vector<char> buf(kChunkBytes);
  uint64_t pos = 0;
  while (pos < offset) {
    const size_t got = in.read(buf.data(), static_cast<size_t>(std::min<uint64_t>(buf.size(), offset - pos)));
    if (got == 0) break;
    line += static_cast<uint64_t>(std::count(buf.data(), buf.data() + got, '\n'));
    pos += got;
  }
  return line;
}

struct Writers {
  ShardWriter train;
  ShardWriter* val;  // nullptr without a split
};

// How far through the input files the run is, in file bytes (compressed bytes for
// compressed files), for the progress line.
struct InputProgress {
  uint64_t total = 0;
  uint64_t finished = 0;                 // bytes of the files already done
  const InputStream* current = nullptr;  // the file being read
  uint64_t done() const { return finished + (current != nullptr ? current->file_bytes_read() : 0); }
};

// Where a block came from, for error messages.
struct Origin {
  std::string path;
  uint64_t offset = 0;    // plain text: the block's first byte in the file's content
  uint64_t jsonl_line = 0;  // JSONL: the document's line (offsets are then within its text field)
};

// Blocks of text encoded on up to `threads` threads and written in the order they
// were added, so the output does not depend on the number of threads.
class BlockEncoder {
 public:
  static constexpr size_t kBlockBytes = size_t{256} << 10;  // the unit of parallel work
  static constexpr size_t kBatchBytes = size_t{16} << 20;   // text held before encoding

  BlockEncoder(const Tokenizer& tok, int64_t threads, bool append_eos, std::string text_field,
               const InputProgress& input)
      : tok_(tok), threads_(threads), append_eos_(append_eos), text_field_(std::move(text_field)), input_(input) {}

  // Text that the tokenizer may encode on its own (a document, or a part of one cut
  // at a Tokenizer::next_cut position), cut further into blocks; EOS after it if
  // `document_end`.
  void add(std::string_view text, ShardWriter& out, bool document_end, const Origin& origin) {
    size_t begin = 0;
    while (begin < text.size()) {
      const size_t cut = begin + kBlockBytes < text.size() ? tok_.next_cut(text, begin + kBlockBytes) : text.size();
      Origin o = origin;
      if (o.jsonl_line == 0) o.offset += begin;
      else o.offset = begin;
      blocks_.push_back(Block{std::string(text.substr(begin, cut - begin)), &out, false, std::move(o), {}, {}});
      pending_ += cut - begin;
      begin = cut;
    }
    documents_ += document_end;
    if (document_end && append_eos_) {
      if (text.empty()) blocks_.push_back(Block{{}, &out, false, origin, {}, {}});
      blocks_.back().eos_after = true;
    }
    if (pending_ >= kBatchBytes) flush();
  }

  void flush() {
    parallel_for(static_cast<int64_t>(blocks_.size()), threads_, [&](int64_t i) {
      Block& b = blocks_[static_cast<size_t>(i)];
      try {
        tok_.encode_into(b.text, b.ids);
      } catch (...) {
        b.error = std::current_exception();
      }
    });
    for (Block& b : blocks_) {
      if (b.error) rethrow(b);
      b.out->write(b.ids);
      if (b.eos_after) b.out->put(tok_.eos_id());
    }
    blocks_.clear();
    done_bytes_ += pending_;
    pending_ = 0;
    const double mb = double(done_bytes_) / 1e6, in_mb = double(input_.done()) / 1e6,
                 in_total = double(input_.total) / 1e6;
    progress_.update(strprintf("%.1f / %.1f MB of input files, %.1f MB of text, %llu documents, %.1f MB/s of text, ETA ",
                               in_mb, in_total, mb, (unsigned long long)documents_,
                               mb / std::max(progress_.elapsed_s(), 1e-9)) +
                     progress_.eta(in_mb, in_total));
  }

 private:
  struct Block {
    std::string text;
    ShardWriter* out;
    bool eos_after;
    Origin origin;
    std::vector<uint32_t> ids;
    std::exception_ptr error;
  };

  [[noreturn]] void rethrow(const Block& b) const {
    try {
      std::rethrow_exception(b.error);
    } catch (const InvalidUtf8Error& e) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned char>(b.text[e.offset]));
      const std::string why = " is not valid UTF-8 (" + std::string(hex) + "), which the tokenizer " + tok_.name() +
                              " needs; fix or drop the bad bytes";
      if (b.origin.jsonl_line > 0) {
        throw DataError(b.origin.path + ":" + std::to_string(b.origin.jsonl_line) + ": byte " +
                        std::to_string(b.origin.offset + e.offset) + " of \"" + text_field_ + "\"" + why);
      }
      const uint64_t at = b.origin.offset + e.offset;
      throw DataError(b.origin.path + ":" + std::to_string(line_of(b.origin.path, at)) + ": byte " +
                      std::to_string(at) + why);
    }
  }

  const Tokenizer& tok_;
  int64_t threads_;
  bool append_eos_;
  std::string text_field_;
  const InputProgress& input_;
  uint64_t done_bytes_ = 0, documents_ = 0;
  Progress progress_{"tokenize:"};
  std::vector<Block> blocks_;
  size_t pending_ = 0;
};

// One document of a text file arriving in pieces: handed to the encoder up to the
// last cut the tokenizer allows (cuts at least a block apart), the rest held until
// more text or the end. A document that received no bytes adds nothing.
class DocumentFeed {
 public:
  DocumentFeed(BlockEncoder& enc, const Tokenizer& tok, ShardWriter& out, std::string path, uint64_t at)
      : enc_(enc), tok_(tok), out_(out), path_(std::move(path)), text_at_(at) {}

  void append(const char* p, size_t n) {
    if (n == 0) return;
    text_.append(p, n);
    received_ += n;
    constexpr size_t kBlock = BlockEncoder::kBlockBytes;
    size_t last = 0;
    for (size_t c = tok_.next_cut(text_, search_from_); c < text_.size(); c = tok_.next_cut(text_, c + kBlock)) last = c;
    // next_cut looks at most 4 bytes ahead: positions before this one hold no cut.
    const size_t searched = text_.size() > 4 ? text_.size() - 4 : 0;
    if (last == 0) {
      search_from_ = std::max(search_from_, searched);
      return;
    }
    enc_.add(std::string_view(text_).substr(0, last), out_, false, Origin{path_, text_at_, 0});
    text_.erase(0, last);
    text_at_ += last;
    search_from_ = searched > last + kBlock ? searched - last : kBlock;
  }
  void finish() {
    if (received_ > 0) enc_.add(text_, out_, true, Origin{path_, text_at_, 0});
    text_.clear();
  }

 private:
  BlockEncoder& enc_;
  const Tokenizer& tok_;
  ShardWriter& out_;
  std::string path_;
  std::string text_;  // not yet handed over; starts at content offset text_at_
  uint64_t text_at_;
  uint64_t received_ = 0;
  size_t search_from_ = BlockEncoder::kBlockBytes;  // positions of text_ before this were searched already
};

// Where a text file's validation tail starts: the first line start at or after the
// cut at (1 - F) of its content (the cut itself when no newline follows it), so no
// line is split.
uint64_t validation_start(const std::string& path, uint64_t size, double val_fraction) {
  const uint64_t cut = static_cast<uint64_t>(static_cast<double>(size) * (1.0 - val_fraction));
  if (cut == 0) return 0;
  InputStream in(path);
  in.skip(cut - 1);  // a newline just before the cut counts
  std::vector<char> buf(kChunkBytes);
  uint64_t pos = cut - 1;
  for (size_t got; (got = in.read(buf.data(), buf.size())) > 0; pos += got) {
    if (const char* nl = static_cast<const char*>(std::memchr(buf.data(), '\n', got))) {
      return pos + static_cast<uint64_t>(nl - buf.data()) + 1;
    }
  }
  return cut;
}

// A plain-text file: one document, optionally split head (train) / tail (validation).
uint64_t tokenize_text(const std::string& path, const TokenizeOptions& opt, Writers& w, BlockEncoder& enc,
                       const Tokenizer& tok, InputProgress& progress) {
  // Without a split the file is read once; with one, its size (a decompressing pass
  // for a compressed file) and the line start after the cut are found first.
  uint64_t switch_at = UINT64_MAX;
  if (w.val != nullptr) switch_at = validation_start(path, content_size(path), opt.val_fraction);

  InputStream in(path);
  progress.current = &in;
  const bool nul_is_eos = opt.append_eos && tok.eos_text() == std::string(1, '\0');
  DocumentFeed head(enc, tok, w.train, path, 0);
  std::optional<DocumentFeed> tail;
  std::vector<char> buf(kChunkBytes);
  uint64_t pos = 0;
  for (size_t got; (got = in.read(buf.data(), buf.size())) > 0; pos += got) {
    // The byte tokenizer's EOS is byte 0: refuse text that contains it.
    if (const void* nul = nul_is_eos ? std::memchr(buf.data(), '\0', got) : nullptr) {
      const uint64_t at = pos + static_cast<uint64_t>(static_cast<const char*>(nul) - buf.data());
      throw DataError(path + ":" + std::to_string(line_of(path, at)) + ": contains a NUL byte (byte " +
                      std::to_string(at) + "), which the byte tokenizer uses as the document separator; "
                      "use --no-eos for binary input");
    }
    size_t k = 0;
    if (!tail && switch_at < pos + got) {
      k = static_cast<size_t>(switch_at - pos);
      head.append(buf.data(), k);
      head.finish();
      tail.emplace(enc, tok, *w.val, path, switch_at);
    }
    (tail ? *tail : head).append(buf.data() + k, got - k);
  }
  if (tail) tail->finish();
  else head.finish();
  progress.current = nullptr;
  return pos > 0 ? 1 : 0;
}

// Lines of a stream, without their '\n'; the last line may lack one.
class LineReader {
 public:
  explicit LineReader(InputStream& in) : in_(in) {}
  bool next(std::string_view& line) {
    while (true) {
      if (const void* nl = std::memchr(buf_.data() + scanned_, '\n', buf_.size() - scanned_)) {
        const size_t end = static_cast<size_t>(static_cast<const char*>(nl) - buf_.data());
        line = std::string_view(buf_).substr(begin_, end - begin_);
        begin_ = scanned_ = end + 1;
        return true;
      }
      scanned_ = buf_.size();
      if (eof_) {
        if (begin_ == buf_.size()) return false;
        line = std::string_view(buf_).substr(begin_);
        begin_ = scanned_ = buf_.size();
        return true;
      }
      buf_.erase(0, begin_);
      scanned_ -= begin_;
      begin_ = 0;
      const size_t had = buf_.size();
      buf_.resize(had + kChunkBytes);
      const size_t got = in_.read(buf_.data() + had, kChunkBytes);
      buf_.resize(had + got);
      eof_ = got == 0;
    }
  }

 private:
  InputStream& in_;
  std::string buf_;
  size_t begin_ = 0, scanned_ = 0;  // the next line starts at begin_; no '\n' in [begin_, scanned_)
  bool eof_ = false;
};

// A JSONL file: one document per non-blank line, from its text field.
uint64_t tokenize_jsonl(const std::string& path, const TokenizeOptions& opt, Writers& w, uint64_t first_doc,
                        BlockEncoder& enc, const Tokenizer& tok, InputProgress& progress, TokenizeSummary& summary) {
  InputStream in(path);
  progress.current = &in;
  LineReader lines(in);
  const bool nul_is_eos = opt.append_eos && tok.eos_text() == std::string(1, '\0');
  const std::string& field = opt.text_field;
  std::string_view line;
  uint64_t line_no = 0;
  uint64_t docs = 0;
  while (lines.next(line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    auto where = [&] { return path + ":" + std::to_string(line_no); };
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      // e.what() is "[json.exception.parse_error.101] parse error at ..."; keep the reason.
      std::string why = e.what();
      if (auto p = why.find("] "); p != std::string::npos) why = why.substr(p + 2);
      throw DataError(where() + ": not valid JSON (" + why + ")");
    }
    if (!j.is_object()) {
      throw DataError(where() + ": expected a JSON object with a \"" + field + "\" field, got " + j.type_name());
    }
    auto it = j.find(field);
    if (it == j.end() || !it->is_string()) {
      const std::string why = it == j.end() ? "the object has no \"" + field + "\" field"
                                            : "\"" + field + "\" is " + it->type_name() + ", expected a string";
      if (!opt.skip_bad) throw DataError(where() + ": " + why + " (--skip-bad skips such documents)");
      if (summary.skipped == 0) summary.first_skipped = where() + ": " + why;
      ++summary.skipped;
      continue;
    }
    const std::string& text = it->get_ref<const std::string&>();
    if (text.empty()) continue;
    if (nul_is_eos && text.find('\0') != std::string::npos) {
      throw DataError(where() + ": \"" + field + "\" contains a NUL character, which the byte tokenizer uses as "
                      "the document separator; use --no-eos to allow it");
    }
    ShardWriter& out = (w.val != nullptr && is_val_document(first_doc + docs, opt.val_fraction)) ? *w.val : w.train;
    enc.add(text, out, true, Origin{path, 0, line_no});
    ++docs;
  }
  progress.current = nullptr;
  return docs;
}

// The token files of `dir`, each with its size (read_manifest checks it).
std::string manifest_text(const TokenizeOptions& opt, const Tokenizer& tok, TokenDtype dtype, const fs::path& dir,
                          const std::vector<std::string>& files) {
  std::ostringstream m;
  m << "# written by spes-engine tokenize: ";
  if (tok.name() == "bytes") m << "byte-level tokenizer";
  else m << "tokenizer " << tok.name();
  m << " (vocab " << tok.vocab_size();
  if (opt.append_eos) {
    m << ", each document ends with token " << tok.eos_id();
    if (tok.name() != "bytes") m << " " << tok.eos_text();
  }
  m << "), " << token_dtype_name(dtype) << " little-endian tokens; each file's size in bytes after a tab\n";
  for (const auto& f : files) m << f << "\t" << fs::file_size(dir / f) << "\n";
  return m.str();
}

void write_manifest(const fs::path& path, const std::string& text) {
  AtomicFile f(path);
  f.write(text.data(), text.size());
  f.commit();
}

}  // namespace

std::vector<std::string> list_inputs(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const auto& input : inputs) {
    std::error_code ec;
    if (!fs::is_directory(input, ec)) {
      files.push_back(input);
      continue;
    }
    std::vector<std::string> found;
    fs::recursive_directory_iterator it(input, ec), end;
    if (ec) throw DataError(input + ": cannot list the folder (" + ec.message() + ")");
    for (; it != end; it.increment(ec)) {
      if (ec) throw DataError(input + ": cannot list the folder (" + ec.message() + ")");
      if (it->is_regular_file(ec) && is_corpus_file_name(it->path().filename().string())) {
        found.push_back(it->path().generic_string());
      }
    }
    if (found.empty()) {
      throw DataError(input + ": the folder holds no .jsonl, .json or .txt files (plain, .gz or .zst)");
    }
    std::sort(found.begin(), found.end());  // byte order, as `LC_ALL=C sort`
    files.insert(files.end(), found.begin(), found.end());
  }
  return files;
}

TokenizeSummary run_tokenize(const TokenizeOptions& opt) {
  if (opt.inputs.empty()) throw DataError("tokenize: no input files");
  if (opt.out_dir.empty()) throw DataError("tokenize: no output folder");
  if (!(opt.val_fraction >= 0.0 && opt.val_fraction < 1.0)) {
    throw DataError("tokenize: val_fraction " + std::to_string(opt.val_fraction) + " must be in [0, 1)");
  }
  if (opt.text_field.empty()) throw DataError("tokenize: the text field name is empty");
  const std::vector<std::string> inputs = list_inputs(opt.inputs);
  for (const auto& path : inputs) {
    compression_of(path);  // an unread compression fails before any work
    std::error_code ec;
    if (!fs::exists(path, ec)) throw DataError(path + ": input file not found");
    if (!fs::is_regular_file(path, ec)) throw DataError(path + ": input is not a regular file");
  }
  const std::unique_ptr<Tokenizer> tok = open_tokenizer(opt.tokenizer);
  const bool fits_uint16 = tok->vocab_size() <= 65536;
  const TokenDtype dtype = opt.dtype.value_or(fits_uint16 ? TokenDtype::kUint16 : TokenDtype::kUint32);
  if (dtype == TokenDtype::kUint16 && !fits_uint16) {
    throw DataError("tokenize: " + tok->name() + " has " + std::to_string(tok->vocab_size()) +
                    " tokens, more than uint16 holds (65536); use --dtype uint32");
  }
  const uint64_t shard_tokens = opt.max_shard_bytes / token_width(dtype);
  if (shard_tokens == 0) {
    throw DataError("tokenize: max_shard_bytes " + std::to_string(opt.max_shard_bytes) + " holds no " +
                    token_dtype_name(dtype) + " token");
  }
  const fs::path out_dir(opt.out_dir);
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) throw DataError("tokenize: cannot create output folder " + opt.out_dir + " (" + ec.message() + ")");

  const bool split = opt.val_fraction > 0.0;
  ShardWriter val_writer(out_dir, "val", dtype, shard_tokens);
  Writers w{ShardWriter(out_dir, "train", dtype, shard_tokens), split ? &val_writer : nullptr};
  InputProgress progress;
  for (const auto& path : inputs) progress.total += fs::file_size(path, ec);
  BlockEncoder enc(*tok, opt.threads, opt.append_eos, opt.text_field, progress);

  TokenizeSummary summary;
  summary.dtype = dtype;
  summary.vocab_size = tok->vocab_size();
  summary.inputs = inputs.size();
  uint64_t jsonl_docs = 0;
  for (const auto& path : inputs) {
    const InputFormat format = opt.format == InputFormat::kAuto ? detect_format(path) : opt.format;
    if (format == InputFormat::kJsonl) {
      const uint64_t docs = tokenize_jsonl(path, opt, w, jsonl_docs, enc, *tok, progress, summary);
      jsonl_docs += docs;
      summary.documents += docs;
    } else {
      summary.documents += tokenize_text(path, opt, w, enc, *tok, progress);
    }
    progress.finished += fs::file_size(path, ec);
  }
  enc.flush();
  if (w.train.tokens() == 0) throw DataError("tokenize: the inputs hold no text; nothing to write");
  if (split && val_writer.tokens() == 0) {
    throw DataError("tokenize: val_fraction " + std::to_string(opt.val_fraction) + " of " +
                    std::to_string(summary.documents) + " documents leaves the validation split empty");
  }

  // Everything was read: put the token files in place, then the manifests.
  w.train.close();
  if (split) val_writer.close();
  summary.train_files = w.train.commit();
  summary.train_tokens = w.train.tokens();
  summary.train_manifest = (out_dir / "train.manifest").string();
  write_manifest(summary.train_manifest, manifest_text(opt, *tok, dtype, out_dir, summary.train_files));
  if (split) {
    summary.validation_files = val_writer.commit();
    summary.validation_tokens = val_writer.tokens();
    summary.validation_manifest = (out_dir / "val.manifest").string();
    write_manifest(summary.validation_manifest, manifest_text(opt, *tok, dtype, out_dir, summary.validation_files));
  }
  return summary;
}

}  // namespace spes
