// data/bpe_tokenizer against the Hugging Face `tokenizers` package, token for token:
// tests/oracles/check_bpe.py writes what `tokenizers` makes of the corpus, a hostile
// Unicode text and random code points with the shipped GPT-NeoX tokenizer, a
// Qwen2-shaped tokenizer it trains on the corpus, and a NeoX variant with the options
// NeoX itself does not use; we encode the same texts and count mismatches (must be 0).
// Without python3 or the package this test prints "SKIPPED (oracle): why" and ctest
// reports it skipped (CMakeLists.txt: SKIP_REGULAR_EXPRESSION).
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/bpe_tokenizer.hpp"
#include "data/token_file.hpp"
#include "data/tokenize.hpp"

#include "test_util.hpp"

namespace fs = std::filesystem;
using namespace spes;

namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<uint32_t> read_u32(const std::string& path) {
  const std::string raw = read_all(path);
  std::vector<uint32_t> v(raw.size() / 4);
  for (size_t i = 0; i < v.size(); ++i) {
    const auto* b = reinterpret_cast<const unsigned char*>(raw.data() + 4 * i);
    v[i] = uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
  }
  return v;
}

// Runs a shell command; returns its exit code and output (stdout and stderr).
int run(const std::string& cmd, std::string& output) {
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) output.append(buf, n);
  const int status = ::pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Mismatching positions, plus the length difference.
size_t mismatches(const std::vector<uint32_t>& a, const std::vector<uint32_t>& b, size_t& first) {
  size_t bad = a.size() > b.size() ? a.size() - b.size() : b.size() - a.size();
  first = std::string::npos;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (a[i] != b[i]) {
      if (first == std::string::npos) first = i;
      ++bad;
    }
  }
  if (bad > 0 && first == std::string::npos) first = std::min(a.size(), b.size());
  return bad;
}

}  // namespace

TEST_CASE("BPE tokenizers equal the `tokenizers` package token for token") {
  std::string out;
  if (run("command -v python3", out) != 0) {
    std::printf("SKIPPED (oracle): no python3 on PATH\n");
    return;
  }
  test::TempDir dir("bpe_oracle");
  const std::string src = SPES_SOURCE_DIR;
  out.clear();
  const int rc = run("python3 " + src + "/tests/oracles/check_bpe.py " + dir.str() + " --unicode " +
                         bpe_unicode_versions().regex, out);
  if (rc == 77) {
    std::printf("%s", out.c_str());  // "SKIPPED (oracle): ..."
    return;
  }
  INFO(out);
  REQUIRE(rc == 0);
  std::printf("%s", out.c_str());

  const std::vector<std::pair<std::string, std::string>> tokenizers = {
      {"gpt-neox", src + "/data/tokenizers/gpt-neox-olmo-dolma-v1_5.json"},
      {"qwen2-style", dir / "qwen2-style.json"},
      {"neox-variant", dir / "neox-variant.json"},
  };
  const std::vector<std::pair<std::string, std::string>> texts = {
      {"tinyshakespeare", src + "/data/corpus/tinyshakespeare.txt"},
      {"hostile", dir / "hostile.txt"},
      {"random", dir / "random.txt"},
  };
  for (const auto& [tname, tpath] : tokenizers) {
    const BpeTokenizer tok(tpath);
    for (const auto& [xname, xpath] : texts) {
      if (!fs::exists(xpath)) continue;  // random.txt: see check_bpe.py
      CAPTURE(tname);
      CAPTURE(xname);
      const std::string text = read_all(xpath);
      const std::vector<uint32_t> ours = tok.encode(text);
      const std::vector<uint32_t> theirs = read_u32(dir / (tname + "." + xname + ".ids"));
      size_t first = 0;
      const size_t bad = mismatches(ours, theirs, first);
      std::printf("oracle %-12s x %-15s: %zu tokens compared, %zu mismatches\n", tname.c_str(), xname.c_str(),
                  theirs.size(), bad);
      if (bad > 0) {
        std::printf("  first mismatch at token %zu (ours/theirs):", first);
        for (size_t i = first; i < std::min(first + 8, std::min(ours.size(), theirs.size())); ++i)
          std::printf(" %u/%u", ours[i], theirs[i]);
        std::printf("\n");
      }
      CHECK(bad == 0);
      // decode: `tokenizers` returns a str; for ids of valid text both are the same bytes.
      CHECK(tok.decode(std::span<const uint32_t>(theirs)) == read_all(dir / (tname + "." + xname + ".decoded")));
    }
  }

  // The tokenize tool (blocks on threads, EOS after the document) gives the same ids.
  for (const auto& [tname, tpath] : std::vector<std::pair<std::string, std::string>>(tokenizers.begin(), tokenizers.begin() + 2)) {
    CAPTURE(tname);
    std::vector<uint32_t> want = read_u32(dir / (tname + ".tinyshakespeare.ids"));
    want.push_back(BpeTokenizer(tpath).eos_id());
    for (int threads : {1, 2, 3}) {
      TokenizeOptions o;
      o.inputs = {src + "/data/corpus/tinyshakespeare.txt"};
      o.out_dir = dir / (tname + "-t" + std::to_string(threads));
      o.tokenizer = tpath;
      o.dtype = TokenDtype::kUint32;
      o.threads = threads;
      const TokenizeSummary s = run_tokenize(o);
      size_t first = 0;
      const size_t bad = mismatches(read_u32(o.out_dir + "/train-00000.bin"), want, first);
      std::printf("oracle %-12s x tokenize --threads %d: %zu tokens compared, %zu mismatches\n", tname.c_str(),
                  threads, want.size(), bad);
      CHECK(bad == 0);
    }
  }
}
