// Corpora as they ship: gzip and zstd input token for token equal to the decompressed
// file on any number of threads, folders in byte order, the JSONL text field and
// --skip-bad, shard rollover, and the SPES reference's file_list.txt of raw `.npy`
// memmaps as a training manifest.
#include <doctest/doctest.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/input_stream.hpp"
#include "data/token_file.hpp"
#include "data/tokenize.hpp"
#include "engine/base/error.hpp"
#include "engine/cli.hpp"
#include "engine/trainer.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using namespace spes;
using test::TempDir;

namespace {

void write_bytes(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string data_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

// `data` as gzip, cut into `members` concatenated members (as pigz or `cat a.gz b.gz` make).
std::string gzip(const std::string& data, int members = 1) {
  std::string out;
  const size_t per = data.size() / members + 1;
  for (size_t at = 0; at < data.size() || (at == 0 && data.empty()); at += per) {
    z_stream z{};
    REQUIRE(deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK);
    const std::string part = data.substr(at, per);
    std::string buf(deflateBound(&z, part.size()) + 64, '\0');
    z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(part.data()));
    z.avail_in = static_cast<uInt>(part.size());
    z.next_out = reinterpret_cast<Bytef*>(buf.data());
    z.avail_out = static_cast<uInt>(buf.size());
    REQUIRE(deflate(&z, Z_FINISH) == Z_STREAM_END);
    out.append(buf.data(), buf.size() - z.avail_out);
    deflateEnd(&z);
    if (data.empty()) break;
  }
  return out;
}

// `data` as zstd, cut into `frames` concatenated frames.
std::string zstd(const std::string& data, int frames = 1) {
  std::string out;
  const size_t per = data.size() / frames + 1;
  for (size_t at = 0; at < data.size(); at += per) {
    const std::string part = data.substr(at, per);
    std::string buf(ZSTD_compressBound(part.size()), '\0');
    const size_t n = ZSTD_compress(buf.data(), buf.size(), part.data(), part.size(), 3);
    REQUIRE_FALSE(ZSTD_isError(n));
    out.append(buf.data(), n);
  }
  return out;
}

// Deterministic text of varied words (ASCII, accented, CJK, emoji), with newlines.
std::string words(std::mt19937& g, size_t bytes) {
  static const char* kWords[] = {"the", "corpus", "ships", "as", "gzip", "caf\xc3\xa9", "na\xc3\xafve", "\xe4\xb8\xad\xe6\x96\x87",
                                 "data,", "tokens.", "  spaced", "\xf0\x9f\x99\x82", "2026", "it's", "MoE", "experts;"};
  std::string s;
  while (s.size() < bytes) {
    s += kWords[g() % 16];
    s += (g() % 9 == 0) ? "\n" : " ";
  }
  return s;
}

// A JSONL corpus: short and long documents (one past a 256 KiB block), other fields first.
std::string jsonl_corpus(size_t docs, size_t long_doc_bytes) {
  std::mt19937 g(7);
  std::string out;
  for (size_t d = 0; d < docs; ++d) {
    const size_t n = d == docs / 2 ? long_doc_bytes : 20 + g() % 2000;
    out += nlohmann::json({{"id", d}, {"meta", {{"source", "test"}}}, {"text", words(g, n)}}).dump() + "\n";
  }
  return out;
}

// Every output file of a tokenize run (names and contents), manifests included.
std::map<std::string, std::string> outputs(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) files[e.path().filename().string()] = read_bytes(e.path().string());
  return files;
}

TokenizeSummary tokenize(const std::vector<std::string>& inputs, const std::string& out, int64_t threads,
                         const std::string& tokenizer = "bytes", double val_fraction = 0.0) {
  TokenizeOptions o;
  o.inputs = inputs;
  o.out_dir = out;
  o.threads = threads;
  o.tokenizer = tokenizer;
  o.val_fraction = val_fraction;
  return run_tokenize(o);
}

const std::string kNeox = std::string(SPES_SOURCE_DIR) + "/data/tokenizers/gpt-neox-olmo-dolma-v1_5.json";

}  // namespace

TEST_CASE("input stream: gzip members and zstd frames read back exactly, through any read size") {
  TempDir dir;
  std::mt19937 g(1);
  // Poorly compressible, so the compressed files span several 1 MiB reads; exactly
  // 3 MiB, so the decoded text ends exactly at the end of a 1 MiB read-ahead chunk
  // (libzstd, asked for more there, answers as if inside a frame: once misread as a
  // truncated file).
  std::string data;
  for (int i = 0; i < (3 << 20); ++i) data.push_back(static_cast<char>(' ' + g() % 90));
  write_bytes(dir / "a.txt", data);
  write_bytes(dir / "a.txt.gz", gzip(data, 3));
  write_bytes(dir / "a.txt.zst", zstd(data, 2));
  REQUIRE(fs::file_size(dir / "a.txt.gz") > (2u << 20));
  for (const char* name : {"a.txt", "a.txt.gz", "a.txt.zst"}) {
    CAPTURE(name);
    InputStream in(dir / name);
    std::string got;
    std::vector<char> buf(1);
    size_t size = 1;
    for (size_t n; (n = in.read(buf.data(), buf.size())) > 0;) {
      got.append(buf.data(), n);
      size = size * 7 % 70001 + 1;  // read sizes from 1 byte to ~70 KB
      buf.resize(size);
    }
    CHECK(got == data);
    CHECK(in.file_bytes_read() == fs::file_size(dir / name));
    CHECK(content_size(dir / name) == data.size());
    InputStream skipping(dir / name);
    CHECK(skipping.skip(data.size() - 5));
    char tail[16];
    CHECK(skipping.read(tail, sizeof tail) == 5);
    CHECK(std::string(tail, 5) == data.substr(data.size() - 5));
  }
}

TEST_CASE("corrupt, truncated or unread compressed input: one line naming the file") {
  TempDir dir;
  const std::string data = jsonl_corpus(200, 5000);
  const std::string gz = gzip(data), zs = zstd(data);
  struct Case {
    std::string name, bytes, what;
  };
  std::string gz_bad = gz, zs_bad = zs;
  for (size_t i = gz.size() / 2; i < gz.size() / 2 + 64; ++i) gz_bad[i] = static_cast<char>(gz_bad[i] ^ 0x5a);
  for (size_t i = zs.size() / 2; i < zs.size() / 2 + 64; ++i) zs_bad[i] = static_cast<char>(zs_bad[i] ^ 0x5a);
  const std::vector<Case> cases = {
      {"cut.jsonl.gz", gz.substr(0, gz.size() - 100), "cut off at the end"},
      {"cut.jsonl.zst", zs.substr(0, zs.size() - 100), "cut off at the end"},
      {"bad.jsonl.gz", gz_bad, "not valid gzip data"},
      {"bad.jsonl.zst", zs_bad, "not valid zstd data"},
      {"plain.jsonl.gz", data, "not valid gzip data"},
      {"x.jsonl.xz", data, ".xz compression is not read"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    write_bytes(dir / c.name, c.bytes);
    const std::string msg = data_error_of([&] { tokenize({dir / c.name}, dir / "out", 2); });
    CHECK(contains(msg, dir / c.name));
    CHECK(contains(msg, c.what));
    CHECK(msg.find('\n') == std::string::npos);
    CHECK_FALSE(fs::exists(dir / "out/train.manifest"));
  }
  // A zstd frame declaring a 256 MiB window (zstd --long=28; streamed, so libzstd
  // cannot shrink the window to the input) is refused by what it needs.
  {
    ZSTD_CCtx* c = ZSTD_createCCtx();
    ZSTD_CCtx_setParameter(c, ZSTD_c_windowLog, 28);
    const std::string text = "{\"text\": \"a long-window frame\"}\n";
    std::string buf(ZSTD_compressBound(text.size()) + 64, '\0');
    ZSTD_inBuffer in{text.data(), text.size(), 0};
    ZSTD_outBuffer out{buf.data(), buf.size(), 0};
    REQUIRE_FALSE(ZSTD_isError(ZSTD_compressStream2(c, &out, &in, ZSTD_e_continue)));  // size unknown
    REQUIRE(ZSTD_compressStream2(c, &out, &in, ZSTD_e_end) == 0);
    ZSTD_freeCCtx(c);
    write_bytes(dir / "long.jsonl.zst", buf.substr(0, out.pos));
    const std::string msg = data_error_of([&] { tokenize({dir / "long.jsonl.zst"}, dir / "out", 1); });
    CHECK(contains(msg, dir / "long.jsonl.zst: the zstd frame needs a window above 128 MiB"));
  }
  // Bad text inside good compression: the line and byte of the decompressed text.
  write_bytes(dir / "u.txt.zst", zstd("fine\nstill fine\nbad \xff here\n"));
  TokenizeOptions o;
  o.inputs = {dir / "u.txt.zst"};
  o.out_dir = dir / "out";
  o.tokenizer = kNeox;
  CHECK(contains(data_error_of([&] { run_tokenize(o); }), dir / "u.txt.zst:3: byte 20 is not valid UTF-8 (0xFF)"));
  write_bytes(dir / "n.txt.gz", gzip(std::string("one\ntwo\0\n", 9)));
  o.inputs = {dir / "n.txt.gz"};
  o.tokenizer = "bytes";
  CHECK(contains(data_error_of([&] { run_tokenize(o); }), dir / "n.txt.gz:2: contains a NUL byte (byte 7)"));
}

TEST_CASE("gzip and zstd input give the decompressed file's tokens on 1, 2 and 5 threads (BPE), with a split on 3") {
  TempDir dir;
  const std::string jsonl = jsonl_corpus(120, 300 << 10);  // one document cut into blocks
  std::mt19937 g(11);
  const std::string text = words(g, 400 << 10);
  write_bytes(dir / "in/c.jsonl", jsonl);
  write_bytes(dir / "in/c.jsonl.gz", gzip(jsonl, 2));
  write_bytes(dir / "in/c.jsonl.zst", zstd(jsonl, 2));
  write_bytes(dir / "in/t.txt", text);
  write_bytes(dir / "in/t.txt.gz", gzip(text, 2));
  write_bytes(dir / "in/t.txt.zst", zstd(text, 2));
  for (const char* base : {"c.jsonl", "t.txt"}) {
    for (double val : {0.0, 0.1}) {
      CAPTURE(base);
      CAPTURE(val);
      const std::string ref_dir = dir / "ref";
      fs::remove_all(ref_dir);
      const TokenizeSummary ref = tokenize({dir / ("in/" + std::string(base))}, ref_dir, 1, kNeox, val);
      CHECK(ref.train_tokens > 50000);
      const auto want = outputs(ref_dir);
      for (const char* ext : {".gz", ".zst"}) {
        for (int threads : val > 0 ? std::vector<int>{3} : std::vector<int>{1, 2, 5}) {
          CAPTURE(ext);
          CAPTURE(threads);
          const std::string out = dir / "out";
          fs::remove_all(out);
          const TokenizeSummary s = tokenize({dir / ("in/" + std::string(base) + ext)}, out, threads, kNeox, val);
          CHECK(s.train_tokens == ref.train_tokens);
          CHECK(s.validation_tokens == ref.validation_tokens);
          CHECK(s.documents == ref.documents);
          CHECK(outputs(out) == want);  // every token file and manifest, byte for byte
        }
      }
    }
  }
}

TEST_CASE("a folder stands for its corpus files in byte order of their paths") {
  TempDir dir;
  const std::string root = dir / "corpus";
  auto doc = [](const std::string& t) { return nlohmann::json({{"text", t}}).dump() + "\n"; };
  write_bytes(root + "/b.jsonl", doc("b"));
  write_bytes(root + "/a.jsonl.gz", gzip(doc("a gz")));
  write_bytes(root + "/a/z.json.zst", zstd(doc("a/z")));
  write_bytes(root + "/a/B.txt", "a/B text");
  write_bytes(root + "/A.json", doc("A"));
  write_bytes(root + "/c.jsonl.zst", zstd(doc("c")));
  write_bytes(root + "/notes.md", "not a corpus file");
  write_bytes(root + "/x.parquet", "not read");
  write_bytes(root + "/.gz", "no name");
  const std::vector<std::string> want = {root + "/A.json", root + "/a.jsonl.gz", root + "/a/B.txt",
                                         root + "/a/z.json.zst", root + "/b.jsonl", root + "/c.jsonl.zst"};
  CHECK(list_inputs({root}) == want);
  // A file given by name stays where it is given.
  std::vector<std::string> mixed = {root + "/b.jsonl"};
  mixed.insert(mixed.end(), want.begin(), want.end());
  CHECK(list_inputs({root + "/b.jsonl", root}) == mixed);

  const TokenizeSummary s = tokenize({root}, dir / "out", 2);
  CHECK(s.inputs == 6);
  CHECK(s.documents == 6);
  std::string got;
  for (char c : read_bytes(dir / "out/train-00000.bin")) {
    if (c != '\0') got.push_back(c);  // uint16 LE, bytes < 256: the low bytes, EOS dropped
  }
  CHECK(got == "Aa gza/B texta/zbc");

  write_bytes(dir / "empty/notes.md", "x");
  CHECK(contains(data_error_of([&] { tokenize({dir / "empty"}, dir / "o2", 1); }), "holds no .jsonl"));
}

TEST_CASE("JSONL text field: missing or non-string is an error naming file and line, or skipped and counted") {
  TempDir dir;
  std::string jsonl;
  for (int i = 0; i < 30; ++i) {
    if (i == 4) jsonl += "{\"id\": 4}\n";                       // no field
    else if (i == 9) jsonl += "{\"content\": null}\n";          // null
    else if (i == 17) jsonl += "{\"content\": [\"a\"]}\n";      // an array
    else jsonl += nlohmann::json({{"content", "doc " + std::to_string(i)}, {"text", 5}}).dump() + "\n";
  }
  write_bytes(dir / "d.jsonl.gz", gzip(jsonl));
  TokenizeOptions o;
  o.inputs = {dir / "d.jsonl.gz"};
  o.out_dir = dir / "out";
  // The default field "text" holds a number here.
  std::string msg = data_error_of([&] { run_tokenize(o); });
  CHECK(contains(msg, dir / "d.jsonl.gz:1: \"text\" is number, expected a string"));
  o.text_field = "content";
  msg = data_error_of([&] { run_tokenize(o); });
  CHECK(contains(msg, dir / "d.jsonl.gz:5: the object has no \"content\" field"));
  CHECK(contains(msg, "--skip-bad"));
  CHECK(msg.find('\n') == std::string::npos);
  CHECK_FALSE(fs::exists(dir / "out/train.manifest"));

  o.skip_bad = true;
  const TokenizeSummary s = run_tokenize(o);
  CHECK(s.skipped == 3);
  CHECK(s.documents == 27);
  CHECK(s.first_skipped == dir / "d.jsonl.gz:5: the object has no \"content\" field");
  std::string want;
  for (int i = 0; i < 30; ++i)
    if (i != 4 && i != 9 && i != 17) want += "doc " + std::to_string(i) + std::string(1, '\0');
  std::string got;
  const std::string raw = read_bytes(dir / "out/train-00000.bin");
  for (size_t i = 0; i < raw.size(); i += 2) got.push_back(raw[i]);
  CHECK(got == want);
  // Invalid JSON is never skipped.
  write_bytes(dir / "e.jsonl", "{\"content\": \"ok\"}\n{\"content\": \"cut\n");
  o.inputs = {dir / "e.jsonl"};
  CHECK(contains(data_error_of([&] { run_tokenize(o); }), dir / "e.jsonl:2: not valid JSON"));
}

TEST_CASE("shards roll over at max_shard_bytes; their concatenation is the single-shard output") {
  TempDir dir;
  const std::string jsonl = jsonl_corpus(12, 3000);
  write_bytes(dir / "c.jsonl.zst", zstd(jsonl));
  for (TokenDtype dtype : {TokenDtype::kUint16, TokenDtype::kUint32}) {
    CAPTURE(token_dtype_name(dtype));
    auto run = [&](uint64_t max_bytes, const std::string& out) {
      TokenizeOptions o;
      o.inputs = {dir / "c.jsonl.zst"};
      o.out_dir = out;
      o.dtype = dtype;
      o.val_fraction = 0.2;
      o.max_shard_bytes = max_bytes;
      o.threads = 2;
      return run_tokenize(o);
    };
    const std::string one = dir / ("one_" + std::string(token_dtype_name(dtype)));
    const std::string many = dir / ("many_" + std::string(token_dtype_name(dtype)));
    const TokenizeSummary a = run(uint64_t{4} << 30, one);
    const TokenizeSummary b = run(1001, many);  // not a multiple of the width: 1000 bytes of tokens per shard
    REQUIRE(a.train_files.size() == 1);
    const uint64_t per = 1001 / token_width(dtype) * token_width(dtype);
    const uint64_t train_bytes = a.train_tokens * token_width(dtype);
    CHECK(b.train_files.size() == (train_bytes + per - 1) / per);
    CHECK(b.validation_files.size() > 1);
    for (const auto& [manifest, single] : {std::pair{b.train_manifest, one + "/train-00000.bin"},
                                           std::pair{b.validation_manifest, one + "/val-00000.bin"}}) {
      std::string concat;
      const auto files = read_manifest(manifest);
      for (size_t i = 0; i < files.size(); ++i) {
        const uint64_t size = fs::file_size(files[i]);
        if (i + 1 < files.size()) CHECK(size == per);
        CHECK(size <= 1001);
        concat += read_bytes(files[i]);
      }
      CHECK(concat == read_bytes(single));
    }
  }
  CHECK(contains(data_error_of([&] {
                   TokenizeOptions o;
                   o.inputs = {dir / "c.jsonl.zst"};
                   o.out_dir = dir / "x";
                   o.dtype = TokenDtype::kUint32;
                   o.max_shard_bytes = 3;
                   run_tokenize(o);
                 }),
                 "holds no uint32 token"));
}

TEST_CASE("spes-engine tokenize: folders, --text-field, --skip-bad, --max-shard-bytes on the command line") {
  TempDir dir;
  write_bytes(dir / "in/a.jsonl.gz", gzip("{\"body\": \"hello\"}\n{\"x\": 1}\n{\"body\": \"world\"}\n"));
  CHECK_THROWS_AS(run_cli({"tokenize", "--input", dir / "in", "--out", dir / "o", "--text-field", "body"}), DataError);
  CHECK_FALSE(fs::exists(dir / "o/train.manifest"));
  CHECK(run_cli({"tokenize", "--input", dir / "in", "--out", dir / "o", "--text-field", "body", "--skip-bad",
                 "--max-shard-bytes", "8", "--threads", "2"}) == 0);
  CHECK(read_manifest(dir / "o/train.manifest").size() == 3);  // 12 uint16 tokens, 4 per shard file
  CHECK(run_cli({"tokenize", "--input", dir / "in", "--out", dir / "q", "--max-shard-bytes", "0"}) == 2);
  CHECK(run_cli({"tokenize", "--input", dir / "in", "--out", dir / "q", "--text-field", ""}) == 2);
}

TEST_CASE("the SPES reference's file_list.txt of raw .npy memmaps trains as a manifest") {
  const auto dir = test::temp_dir("reference-file-list");
  // The reference's token files: raw little-endian uint32 arrays named .npy (np.memmap),
  // listed by absolute path in file_list.txt.
  std::mt19937 g(5);
  std::string manifest, file_list;
  for (int f = 0; f < 2; ++f) {
    std::string raw;
    for (int i = 0; i < 6000; ++i) {
      const uint32_t t = (g() % 8 == 0) ? g() % 64 : uint32_t(i * 7 + i / 5) % 64;
      for (int b = 0; b < 4; ++b) raw.push_back(static_cast<char>(t >> (8 * b)));
    }
    const std::string npy = (dir / "ref" / ("part_" + std::to_string(f) + ".npy")).string();
    write_bytes(npy, raw);
    write_bytes((dir / "ours" / ("part_" + std::to_string(f) + ".bin")).string(), raw);
    file_list += npy + "\n";
    manifest += "part_" + std::to_string(f) + ".bin\n";
  }
  write_bytes((dir / "ref/file_list.txt").string(), file_list);
  write_bytes((dir / "ours/train.manifest").string(), manifest);

  auto train = [&](const std::string& list, const std::string& name) {
    Config c = test::small_config(dir / name, {"data.train=\"" + list + "\"", "data.token_dtype=\"uint32\"",
                                               "train.steps=3", "optim.decay_steps=3"});
    Trainer t(c);
    std::ostringstream csv;
    t.run(csv, false);
    CHECK(t.step() == 3);
    return t.params();
  };
  const std::vector<float> from_reference = train((dir / "ref/file_list.txt").string(), "run_ref");
  const std::vector<float> from_ours = train((dir / "ours/train.manifest").string(), "run_ours");
  CHECK(from_reference == from_ours);  // the same tokens, the same run, bit for bit

  // A real NumPy file (np.save: a header before the array) is refused, not read as tokens.
  std::string npy_with_header = std::string("\x93NUMPY\x01\x00v\x00", 10) +
                                "{'descr': '<u4', 'fortran_order': False, 'shape': (6000,), }";
  npy_with_header.resize(128, ' ');
  npy_with_header.back() = '\n';
  npy_with_header += read_bytes((dir / "ref/part_0.npy").string());
  write_bytes((dir / "ref/saved.npy").string(), npy_with_header);
  const std::string msg = data_error_of([&] { TokenFile((dir / "ref/saved.npy").string(), TokenDtype::kUint32); });
  CHECK(contains(msg, (dir / "ref/saved.npy").string()));
  CHECK(contains(msg, "NumPy .npy header"));
}
