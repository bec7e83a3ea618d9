// BPE tokenizer throughput on the shipped corpus (Tiny Shakespeare, 1.1 MB) with the
// shipped GPT-NeoX tokenizer.json, and the same tokenizer with Qwen2's pre-tokenizer
// regex: MB/s of UTF-8 in, on 1 thread and on all cores (the corpus cut into blocks
// as `spes-engine tokenize` cuts it), each over the corpus 8 times in a row so that
// starting threads does not dominate. When python3 has the `tokenizers` package, the
// same is measured for it: single-threaded (TOKENIZERS_PARALLELISM=false), both
// encode(whole text) and encode_batch(lines), the faster of the two taken; and
// encode_batch on all cores. Best of several runs each (warm caches on both sides).
//
// Then `spes-engine tokenize` end to end (run_tokenize, all cores) on the same text
// shipped three ways: a JSONL corpus (Tiny Shakespeare's paragraphs as documents, 32
// copies, copy c with its letters rotated by c places, so that no compressor finds
// whole earlier copies: real corpora do not repeat) plain, gzip (level 6, gzip's
// default) and zstd (level 3, zstd's default): MB/s of uncompressed JSONL, with the
// BPE and the byte tokenizer (the latter shows the decoding cost nearly alone), and
// compressed / plain. Each run includes loading the tokenizer (~0.1 s for NeoX).
//
//   bench_tokenizer [--reps N]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <zlib.h>
#include <zstd.h>

#include "data/bpe_tokenizer.hpp"
#include "data/tokenize.hpp"
#include "engine/base/parallel.hpp"

using namespace spes;
using Clock = std::chrono::steady_clock;

namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The corpus cut where the tokenizer allows, about `block` bytes apart.
std::vector<std::string_view> blocks_of(const Tokenizer& tok, std::string_view text, size_t block) {
  std::vector<std::string_view> out;
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t cut = begin + block < text.size() ? tok.next_cut(text, begin + block) : text.size();
    out.push_back(text.substr(begin, cut - begin));
    begin = cut;
  }
  return out;
}

// Best seconds over `reps` runs of f.
template <class F>
double best_of(int reps, F&& f) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

struct Ours {
  double mb_s_cold = 0, mb_s_1 = 0, mb_s_n = 0;
  size_t tokens = 0;
};

// `tok` must be fresh: the first encode shows the speed with an empty word cache.
Ours measure(const BpeTokenizer& tok, const std::string& corpus, int reps, int threads) {
  Ours r;
  std::vector<uint32_t> ids;
  r.mb_s_cold = double(corpus.size()) / 1e6 / best_of(1, [&] { tok.encode_into(corpus, ids); });
  r.tokens = ids.size();
  std::string text;
  for (int i = 0; i < 8; ++i) text += corpus;
  const double mb = double(text.size()) / 1e6;
  r.mb_s_1 = mb / best_of(reps, [&] {
    ids.clear();
    tok.encode_into(text, ids);
  });
  const size_t total = ids.size();
  const auto blocks = blocks_of(tok, text, size_t{64} << 10);
  std::vector<std::vector<uint32_t>> out(blocks.size());
  r.mb_s_n = mb / best_of(reps, [&] {
    parallel_for(int64_t(blocks.size()), threads, [&](int64_t i) {
      out[i].clear();
      tok.encode_into(blocks[i], out[i]);
    });
  });
  size_t n = 0;
  for (const auto& o : out) n += o.size();
  if (n != total || total != 8 * r.tokens)
    std::fprintf(stderr, "bench_tokenizer: blocks gave %zu tokens, whole text %zu, 8 x corpus %zu\n", n, total,
                 8 * r.tokens);
  return r;
}

// `tokenizers` on the same file: prints "single MB/s", "batch_all MB/s", "tokens".
const char* kPython = R"PY(
import os, sys, time
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import tokenizers
tok = tokenizers.Tokenizer.from_file(sys.argv[1])
text = open(sys.argv[2], encoding="utf-8").read()
reps = int(sys.argv[3])
mb = len(text.encode("utf-8")) / 1e6
lines = text.splitlines(keepends=True)
def best(f):
    b = 1e30
    for _ in range(reps):
        t0 = time.perf_counter(); f(); b = min(b, time.perf_counter() - t0)
    return b
whole = best(lambda: tok.encode(text))
batch = best(lambda: tok.encode_batch(lines))
print("single", mb / min(whole, batch), "whole", mb / whole, "batch", mb / batch)
print("tokens", len(tok.encode(text).ids))
)PY";

struct Theirs {
  bool ok = false;
  double single = 0, whole = 0, batch = 0, batch_all = 0;
  std::string why;
};

Theirs measure_tokenizers(const std::string& tokenizer_json, const std::string& corpus, int reps) {
  Theirs t;
  const auto script = std::filesystem::temp_directory_path() / ("bench_tokenizer_" + std::to_string(::getpid()) + ".py");
  std::ofstream(script) << kPython;
  auto run = [&](const std::string& env) {
    std::string out;
    const std::string cmd = env + " python3 " + script.string() + " " + tokenizer_json + " " + corpus + " " +
                            std::to_string(reps) + " 2>&1";
    if (FILE* p = ::popen(cmd.c_str(), "r")) {
      char buf[4096];
      for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
      if (::pclose(p) != 0) t.why = out.substr(0, out.find('\n'));
    }
    return out;
  };
  const std::string one = run("TOKENIZERS_PARALLELISM=false RAYON_NUM_THREADS=1");
  if (std::sscanf(one.c_str(), "single %lf whole %lf batch %lf", &t.single, &t.whole, &t.batch) == 3) {
    const std::string all = run("TOKENIZERS_PARALLELISM=true");
    double s = 0, w = 0;
    t.ok = std::sscanf(all.c_str(), "single %lf whole %lf batch %lf", &s, &w, &t.batch_all) == 3;
  }
  if (!t.ok && t.why.empty()) t.why = "python3 with `tokenizers` not available";
  std::filesystem::remove(script);
  return t;
}

std::string gzip_of(const std::string& data) {
  z_stream z{};
  deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&z, data.size()), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  z.avail_in = static_cast<uInt>(data.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(out.size() - z.avail_out);
  deflateEnd(&z);
  return out;
}

std::string zstd_of(const std::string& data) {
  std::string out(ZSTD_compressBound(data.size()), '\0');
  out.resize(ZSTD_compress(out.data(), out.size(), data.data(), data.size(), 3));
  return out;
}

// Copy c of the corpus: ASCII letters rotated by c places (copy 0 is the corpus).
std::string rotated(const std::string& text, int c) {
  std::string out = text;
  for (char& ch : out) {
    if (ch >= 'a' && ch <= 'z') ch = char('a' + (ch - 'a' + c) % 26);
    else if (ch >= 'A' && ch <= 'Z') ch = char('A' + (ch - 'A' + c) % 26);
  }
  return out;
}

// The corpus as JSONL, one paragraph (text between blank lines) per document.
std::string jsonl_of(const std::string& corpus, int copies) {
  std::string out;
  for (int c = 0; c < copies; ++c) {
    const std::string text = rotated(corpus, c);
    for (size_t at = 0; at < text.size();) {
      size_t end = text.find("\n\n", at);
      end = end == std::string::npos ? text.size() : end + 2;
      out += nlohmann::json({{"text", text.substr(at, end - at)}}).dump() + "\n";
      at = end;
    }
  }
  return out;
}

void measure_compressed_input(const std::string& corpus, const std::string& neox_path, int reps, int threads) {
  namespace fs = std::filesystem;
  if (corpus.empty()) {
    std::printf("\nspes-engine tokenize on compressed input: not measured (the corpus is missing)\n");
    return;
  }
  const fs::path dir = fs::temp_directory_path() / ("bench_tokenizer_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string jsonl = jsonl_of(corpus, 32);
  const std::string gz = gzip_of(jsonl), zs = zstd_of(jsonl);
  std::ofstream(dir / "c.jsonl", std::ios::binary) << jsonl;
  std::ofstream(dir / "c.jsonl.gz", std::ios::binary) << gz;
  std::ofstream(dir / "c.jsonl.zst", std::ios::binary) << zs;
  std::printf("\nspes-engine tokenize, %d threads: %.1f MB of JSONL (%.1f MB as .gz, %.1f MB as .zst), best of %d\n",
              threads, jsonl.size() / 1e6, gz.size() / 1e6, zs.size() / 1e6, reps);
  std::printf("%-10s %14s %14s %14s %10s %10s\n", "tokenizer", "plain", "gzip", "zstd", "gzip/plain", "zstd/plain");
  for (const std::string& tokenizer : {neox_path, std::string("bytes")}) {
    // The three in turn, best of reps each, so that a change in the machine's load
    // touches all three alike.
    double mb_s[3] = {0, 0, 0};
    const char* names[3] = {"c.jsonl", "c.jsonl.gz", "c.jsonl.zst"};
    for (int r = 0; r < reps; ++r) {
      for (int i = 0; i < 3; ++i) {
        TokenizeOptions o;
        o.inputs = {(dir / names[i]).string()};
        o.out_dir = (dir / "out").string();
        o.tokenizer = tokenizer;
        o.threads = threads;
        mb_s[i] = std::max(mb_s[i], jsonl.size() / 1e6 / best_of(1, [&] { run_tokenize(o); }));
      }
    }
    std::printf("%-10s %9.1f MB/s %9.1f MB/s %9.1f MB/s %9.0f%% %9.0f%%\n",
                tokenizer == "bytes" ? "bytes" : "gpt-neox", mb_s[0], mb_s[1], mb_s[2], 100 * mb_s[1] / mb_s[0],
                100 * mb_s[2] / mb_s[0]);
  }
  fs::remove_all(dir);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 5;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::max(1, std::atoi(argv[i + 1]));
  const std::string src = SPES_SOURCE_DIR;
  const std::string neox_path = src + "/data/tokenizers/gpt-neox-olmo-dolma-v1_5.json";
  const std::string corpus_path = src + "/data/corpus/tinyshakespeare.txt";
  const std::string corpus = read_all(corpus_path);
  const int threads = int(std::max(1u, std::thread::hardware_concurrency()));

  const BpeTokenizer neox(neox_path);
  // The NeoX vocabulary behind Qwen2's pre-tokenizer (the Split regex path).
  nlohmann::json j = nlohmann::json::parse(read_all(neox_path));
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"},
         {"pattern", {{"Regex", "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
                                "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}}},
         {"behavior", "Isolated"},
         {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}}}};
  const BpeTokenizer qwen2(j.dump(), "gpt-neox vocab + Qwen2 regex");

  std::printf("corpus: %s (%.2f MB; ours: 8 copies in a row), %d cores, best of %d\n", corpus_path.c_str(),
              corpus.size() / 1e6, threads, reps);
  const Ours a = measure(neox, corpus, reps, threads);
  const Ours b = measure(qwen2, corpus, reps, threads);
  std::printf("%-34s %10s %12s %12s\n", "tokenizer", "tokens", "1 thread", "all cores");
  std::printf("%-34s %10zu %9.2f MB/s %7.2f MB/s   (first encode, empty cache: %.2f MB/s)\n", "spes gpt-neox",
              a.tokens, a.mb_s_1, a.mb_s_n, a.mb_s_cold);
  std::printf("%-34s %10zu %9.2f MB/s %7.2f MB/s   (first encode, empty cache: %.2f MB/s)\n",
              "spes gpt-neox vocab + Qwen2 regex", b.tokens, b.mb_s_1, b.mb_s_n, b.mb_s_cold);

  const Theirs t = measure_tokenizers(neox_path, corpus_path, reps);
  if (!t.ok) {
    std::printf("tokenizers (HF): not measured (%s)\n", t.why.c_str());
  } else {
    std::printf("%-34s %10s %9.2f MB/s %7.2f MB/s   (1 thread: encode %.2f, encode_batch(lines) %.2f)\n",
                "tokenizers gpt-neox", "", t.single, t.batch_all, t.whole, t.batch);
    std::printf("ratio spes / tokenizers: %.1fx on 1 thread, %.1fx on all cores\n", a.mb_s_1 / t.single,
                a.mb_s_n / t.batch_all);
  }
  measure_compressed_input(corpus, neox_path, reps, threads);
  return 0;
}
