// data/bpe_tokenizer and the tokenizer interface, without Python: pinned encodings of
// the shipped GPT-NeoX tokenizer (taken from the `tokenizers` package), round trips,
// invalid UTF-8, every refused tokenizer.json component, safe cut points, the
// tokenize tool on several threads, and the [data] tokenizer check of the config.
// tests/test_bpe_oracle.cpp compares with `tokenizers` itself, token for token.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "data/bpe_tokenizer.hpp"
#include "data/token_file.hpp"
#include "data/tokenize.hpp"
#include "data/tokenizer.hpp"
#include "engine/base/error.hpp"
#include "engine/base/parallel.hpp"
#include "engine/config.hpp"

#include "test_util.hpp"

namespace fs = std::filesystem;
using namespace spes;
using nlohmann::json;

namespace {

using test::TempDir;

const std::string kSource = SPES_SOURCE_DIR;
const std::string kNeox = kSource + "/data/tokenizers/gpt-neox-olmo-dolma-v1_5.json";
const std::string kCorpus = kSource + "/data/corpus/tinyshakespeare.txt";
const char* kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

const json& neox_json() {
  static const json j = json::parse(read_all(kNeox));
  return j;
}

const BpeTokenizer& neox() {
  static const BpeTokenizer t(kNeox);
  return t;
}

// The NeoX vocabulary behind Qwen2's normalizer and pre-tokenizer (the shape of
// Qwen2.5's tokenizer.json).
json qwen2_shaped_json() {
  json j = neox_json();
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"}, {"pattern", {{"Regex", kQwen2Regex}}}, {"behavior", "Isolated"}, {"invert", false}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}}}};
  j["model"]["continuing_subword_prefix"] = "";
  j["model"]["end_of_word_suffix"] = "";
  return j;
}

const BpeTokenizer& qwen2_shaped() {
  static const BpeTokenizer t(qwen2_shaped_json().dump(), "qwen2-shaped");
  return t;
}

// The DataError message of f, or "".
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

// A text with a bit of everything (valid UTF-8, NFC).
std::string mixed_text() {
  return "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
         "It's IT'S they'LL we'VE  two  spaces   three\t tabs\r\nCRLF\n\n\n"
         "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae\xe3\x83\x86\xe3\x82\xad\xe3\x82\xb9\xe3\x83\x88 "
         "\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7 \xf0\x9f\x87\xaf\xf0\x9f\x87\xb5\n"
         "\xd9\x85\xd8\xb1\xd8\xad\xd8\xa8\xd8\xa7 \xd7\xa9\xd7\x9c\xd7\x95\xd7\x9d 123 4567 3.14 \xc2\xbd\n"
         "<|endoftext|>next doc<|padding|>|||IP_ADDRESS|||" +
         std::string(30, ' ') + "end\x01\x7f\xc2\x85\xe2\x80\xa8x\n";
}

}  // namespace

TEST_CASE("the shipped GPT-NeoX tokenizer: vocabulary, EOS, encodings pinned from `tokenizers`") {
  const BpeTokenizer& t = neox();
  CHECK(t.vocab_size() == 50280);
  CHECK(t.eos_id() == 50279);
  CHECK(t.eos_text() == "<|endoftext|>");
  CHECK(t.token_text(50276) == "  ");
  using V = std::vector<uint32_t>;
  CHECK(t.encode("Hello  world <|endoftext|>   x\n\n y") == V{12092, 50276, 10186, 209, 50279, 50275, 89, 535, 340});
  CHECK(t.encode("The quick brown fox can't jump 3.14 times!") ==
        V{510, 3158, 8516, 30013, 476, 626, 6923, 495, 15, 1047, 2069, 2});
  // "cafe" + U+0301 is NFC-composed to "café" first.
  CHECK(t.encode("cafe\xcc\x81 caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80") ==
        V{68, 2320, 860, 36241, 209, 49868, 19119, 241, 49042, 211});
  CHECK(t.encode("|||IP_ADDRESS|||<|padding|>") == V{0, 1});
  CHECK(t.encode("").empty());

  // open_tokenizer picks by spec.
  auto bytes = open_tokenizer("bytes");
  CHECK(bytes->vocab_size() == 256);
  CHECK(bytes->eos_id() == 0);
  CHECK(bytes->encode("Hi") == V{72, 105});
  auto bpe = open_tokenizer(kNeox);
  CHECK(bpe->vocab_size() == 50280);
  CHECK(bpe->encode("Hello") == V{12092});
}

TEST_CASE("encode -> decode round trips, byte for byte") {
  const std::string corpus = read_all(kCorpus);
  for (const BpeTokenizer* t : {&neox(), &qwen2_shaped()}) {
    CAPTURE(t->name());
    CHECK(t->decode(t->encode(corpus)) == corpus);
    CHECK(t->decode(t->encode(mixed_text())) == mixed_text());
    // NFC text comes back as is; other text comes back in NFC.
    CHECK(t->decode(t->encode("cafe\xcc\x81")) == "caf\xc3\xa9");
    // int32 ids (what the data loader hands out) decode the same.
    const auto ids = t->encode(mixed_text());
    const std::vector<int32_t> i32(ids.begin(), ids.end());
    CHECK(t->decode(std::span<const int32_t>(i32)) == mixed_text());
    CHECK(contains(error_of([&] { t->decode(std::vector<uint32_t>{1, 99999999}); }), "99999999"));
    CHECK(contains(error_of([&] { t->decode(std::span<const int32_t>(std::vector<int32_t>{-1})); }), "negative"));
  }
  // Without a normalizer every valid UTF-8 string round-trips: random code points
  // from every plane (assigned or not), controls, NUL and special-token look-alikes.
  json j = neox_json();
  j["normalizer"] = nullptr;
  const BpeTokenizer raw(j.dump(), "neox-without-nfc");
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    std::string s;
    const int n = int(rng() % 200);
    for (int k = 0; k < n; ++k) {
      const uint32_t pick = rng() % 10;
      uint32_t cp = pick < 3 ? rng() % 0x80 : pick < 5 ? 0x80 + rng() % 0x780 : pick < 8 ? rng() % 0x10000 : rng() % 0x110000;
      if (cp >= 0xD800 && cp <= 0xDFFF) cp = ' ';
      if (pick == 9 && k % 7 == 0) {
        s += "<|endoftext|>";
        continue;
      }
      if (cp < 0x80) s.push_back(char(cp));
      else if (cp < 0x800) s += {char(0xC0 | cp >> 6), char(0x80 | (cp & 0x3F))};
      else if (cp < 0x10000) s += {char(0xE0 | cp >> 12), char(0x80 | (cp >> 6 & 0x3F)), char(0x80 | (cp & 0x3F))};
      else s += {char(0xF0 | cp >> 18), char(0x80 | (cp >> 12 & 0x3F)), char(0x80 | (cp >> 6 & 0x3F)), char(0x80 | (cp & 0x3F))};
    }
    REQUIRE(find_invalid_utf8(s) == s.size());
    CHECK(raw.decode(raw.encode(s)) == s);
  }
}

TEST_CASE("invalid UTF-8 is refused with the byte offset, never a crash") {
  struct Case {
    const char* what;
    std::string text;
    size_t offset;
  };
  const std::vector<Case> cases = {
      {"stray 0xFF", std::string("ok \xff rest"), 3},
      {"lone continuation byte", std::string("ab\x80"), 2},
      {"overlong '/'", std::string("x\xc0\xaf"), 1},
      {"overlong 3-byte", std::string("\xe0\x80\x80"), 0},
      {"surrogate U+D800", std::string("12\xed\xa0\x80"), 2},
      {"above U+10FFFF", std::string("\xf4\x90\x80\x80"), 0},
      {"truncated at the end", std::string("euro \xe2\x82"), 5},
      {"truncated before ASCII", std::string("\xe2\x82" "a"), 0},
      {"0xF5", std::string("\xf5\x80\x80\x80"), 0},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    CHECK(find_invalid_utf8(c.text) == c.offset);
    for (const BpeTokenizer* t : {&neox(), &qwen2_shaped()}) {
      try {
        t->encode(c.text);
        FAIL("no error");
      } catch (const InvalidUtf8Error& e) {
        CHECK(e.offset == c.offset);
        CHECK(contains(e.what(), t->name()));
        CHECK(contains(e.what(), "byte " + std::to_string(c.offset)));
      }
    }
  }
  const std::string valid = "plain ascii, caf\xc3\xa9, \xf0\x9f\x98\x80, \xf4\x8f\xbf\xbf (U+10FFFF)";
  CHECK(find_invalid_utf8(valid) == valid.size());

  // The tokenize tool names the file, the line and the byte.
  TempDir dir;
  write_all(dir / "bad.txt", "line one\nline two\nthree \xc3\x28 x\n");
  TokenizeOptions o;
  o.inputs = {dir / "bad.txt"};
  o.out_dir = dir / "out";
  o.tokenizer = kNeox;
  const std::string msg = error_of([&] { run_tokenize(o); });
  CHECK(contains(msg, dir / "bad.txt:3: byte 24"));
  CHECK(contains(msg, "not valid UTF-8"));
  CHECK(msg.find('\n') == std::string::npos);
  CHECK_FALSE(fs::exists(dir / "out/train.manifest"));
  // The byte tokenizer takes any bytes.
  o.tokenizer = "bytes";
  CHECK(run_tokenize(o).train_tokens == read_all(dir / "bad.txt").size() + 1);
}

TEST_CASE("unsupported tokenizer.json components are refused: one line naming the file and the component") {
  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"normalizer NFKC", [](json& j) { j["normalizer"] = {{"type", "NFKC"}}; }, "unsupported normalizer \"NFKC\""},
      {"normalizer Lowercase in a Sequence",
       [](json& j) { j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "Lowercase"}}}}}; },
       "unsupported normalizer \"Lowercase\""},
      {"pre-tokenizer Whitespace", [](json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; },
       "unsupported pre_tokenizer \"Whitespace\""},
      {"pre-tokenizer Metaspace", [](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; },
       "unsupported pre_tokenizer \"Metaspace\""},
      {"no pre-tokenizer", [](json& j) { j["pre_tokenizer"] = nullptr; }, "no pre_tokenizer"},
      {"ByteLevel not last",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers", {{{"type", "ByteLevel"}}, {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Isolated"}}}}};
       },
       "ByteLevel must come last"},
      {"Split behavior Removed",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Removed"}}, {{"type", "ByteLevel"}}}}};
       },
       "unsupported Split behavior \"Removed\""},
      {"Split invert",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Isolated"}, {"invert", true}}, {{"type", "ByteLevel"}}}}};
       },
       "unsupported Split invert"},
      {"regex with \\b",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"Regex", "\\bx"}}}, {"behavior", "Isolated"}}, {{"type", "ByteLevel"}}}}};
       },
       "regex uses \\b"},
      {"bad regex",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}}, {{"type", "ByteLevel"}}}}};
       },
       "cannot compile pre-tokenizer regex"},
      {"model WordPiece", [](json& j) { j["model"]["type"] = "WordPiece"; }, "unsupported model \"WordPiece\""},
      {"BPE dropout", [](json& j) { j["model"]["dropout"] = 0.1; }, "unsupported BPE dropout"},
      {"byte_fallback", [](json& j) { j["model"]["byte_fallback"] = true; }, "byte_fallback"},
      {"ignore_merges", [](json& j) { j["model"]["ignore_merges"] = true; }, "ignore_merges"},
      {"subword prefix", [](json& j) { j["model"]["continuing_subword_prefix"] = "##"; }, "continuing_subword_prefix"},
      {"decoder WordPiece", [](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }, "unsupported decoder \"WordPiece\""},
      {"no decoder", [](json& j) { j["decoder"] = nullptr; }, "unsupported decoder \"null\""},
      {"post-processor TemplateProcessing", [](json& j) { j["post_processor"] = {{"type", "TemplateProcessing"}}; },
       "unsupported post_processor \"TemplateProcessing\""},
      {"truncation", [](json& j) { j["truncation"] = {{"max_length", 512}}; }, "unsupported truncation"},
      {"padding", [](json& j) { j["padding"] = {{"pad_id", 1}}; }, "unsupported padding"},
      {"added token lstrip", [](json& j) { j["added_tokens"][1]["lstrip"] = true; }, "lstrip = true (token \"<|padding|>\")"},
      {"added token single_word", [](json& j) { j["added_tokens"][0]["single_word"] = true; }, "single_word"},
      {"no end-of-text token",
       [](json& j) {
         for (auto& t : j["added_tokens"])
           if (t["content"] == "<|endoftext|>") t["special"] = false;
       },
       "no end-of-document token"},
      {"a byte without a token", [](json& j) { j["model"]["vocab"].erase("a"); }, "byte 0x61 has no token"},
      {"merge of unknown tokens", [](json& j) { j["model"]["merges"].push_back("qqqq zzzz"); }, "not in the vocab"},
      {"merge that is not two tokens", [](json& j) { j["model"]["merges"].push_back("abc"); }, "not two tokens"},
      {"two tokens share an id", [](json& j) { j["model"]["vocab"]["zzzzzz"] = 5; }, "vocab gives id 5 to both"},
  };
  TempDir dir;
  for (const auto& c : cases) {
    CAPTURE(c.what);
    json j = neox_json();
    c.edit(j);
    const std::string path = dir / "tok.json";
    write_all(path, j.dump());
    const std::string msg = error_of([&] { BpeTokenizer t(path); });
    CHECK(contains(msg, path + ": "));
    CHECK(contains(msg, c.expect));
    CHECK(msg.find('\n') == std::string::npos);
  }
  // Missing file, not JSON, not a tokenizer.
  CHECK(contains(error_of([&] { open_tokenizer(dir / "missing.json"); }), dir / "missing.json: tokenizer file not found"));
  write_all(dir / "bad.json", "{\"model\": ");
  CHECK(contains(error_of([&] { open_tokenizer(dir / "bad.json"); }), dir / "bad.json: not valid JSON"));
  write_all(dir / "other.json", "{\"a\": 1}");
  CHECK(contains(error_of([&] { open_tokenizer(dir / "other.json"); }), "not a tokenizer.json"));
  CHECK(contains(error_of([&] { open_tokenizer(""); }), "empty"));
}

TEST_CASE("next_cut: the two sides encode to exactly the ids of the whole") {
  const std::string text = mixed_text() + read_all(kCorpus).substr(0, 3000) + mixed_text();
  for (const BpeTokenizer* t : {&neox(), &qwen2_shaped()}) {
    CAPTURE(t->name());
    const std::vector<uint32_t> whole = t->encode(text);
    size_t cuts = 0;
    for (size_t p = t->next_cut(text, 0); p < text.size(); p = t->next_cut(text, p + 1)) {
      CAPTURE(p);
      std::vector<uint32_t> parts = t->encode(std::string_view(text).substr(0, p));
      t->encode_into(std::string_view(text).substr(p), parts);
      REQUIRE(parts == whole);
      ++cuts;
    }
    CHECK(cuts > 300);
  }
  // Only the shapes the cut rule was worked out for are cut.
  json j = neox_json();
  j["pre_tokenizer"]["add_prefix_space"] = true;
  const BpeTokenizer prefixed(j.dump(), "prefixed");
  CHECK(prefixed.next_cut(text, 0) == text.size());
  // The byte tokenizer cuts anywhere.
  CHECK(ByteTokenizer().next_cut(text, 17) == 17);
}

TEST_CASE("encode is thread-safe: concurrent encodes give the sequential ids") {
  const std::string corpus = read_all(kCorpus);
  std::vector<std::string> lines;
  for (size_t b = 0, e; b < corpus.size(); b = e + 1) {
    e = corpus.find('\n', b);
    if (e == std::string::npos) e = corpus.size();
    lines.push_back(corpus.substr(b, e - b + 1) + mixed_text().substr(0, lines.size() % 140));  // ASCII part
  }
  const BpeTokenizer t(kNeox);  // fresh: the workspaces start cold on every thread
  std::vector<std::vector<uint32_t>> par(lines.size());
  parallel_for(int64_t(lines.size()), 4, [&](int64_t i) { par[i] = t.encode(lines[i]); });
  for (size_t i = 0; i < lines.size(); ++i) REQUIRE(par[i] == neox().encode(lines[i]));
}

TEST_CASE("tokenize with BPE: same files on 1, 2 and 4 threads, equal to encoding each document whole") {
  TempDir dir;
  const std::string corpus = read_all(kCorpus);
  std::string text;  // ~3.5 MB: several reading chunks and many blocks
  for (int i = 0; i < 3; ++i) text += corpus + mixed_text();
  write_all(dir / "big.txt", text);
  std::string jsonl;
  std::vector<std::string> docs;
  for (int i = 0; i < 40; ++i) {
    docs.push_back(i == 7 ? corpus : mixed_text().substr(size_t(i) * 7 % 140) + std::to_string(i));
    jsonl += json({{"text", docs.back()}}).dump() + "\n";
  }
  write_all(dir / "docs.jsonl", jsonl);

  auto run = [&](const std::string& input, int threads, double val) {
    TokenizeOptions o;
    o.inputs = {dir / input};
    o.out_dir = dir / (input + "-" + std::to_string(threads));
    o.tokenizer = kNeox;
    o.threads = threads;
    o.val_fraction = val;
    o.max_shard_bytes = 600000;
    return run_tokenize(o);
  };
  auto tokens_of = [](const std::string& manifest) {
    std::vector<uint32_t> all;
    for (const auto& f : read_manifest(manifest)) {
      const std::string raw = read_all(f);
      for (size_t i = 0; i + 1 < raw.size(); i += 2) all.push_back(uint8_t(raw[i]) | uint32_t(uint8_t(raw[i + 1])) << 8);
    }
    return all;
  };
  const uint32_t eos = neox().eos_id();
  for (const std::string input : {"big.txt", "docs.jsonl"}) {
    CAPTURE(input);
    const TokenizeSummary s1 = run(input, 1, 0.1);
    CHECK(s1.dtype == TokenDtype::kUint16);
    CHECK(s1.vocab_size == 50280);
    for (int threads : {2, 4}) {
      const TokenizeSummary s = run(input, threads, 0.1);
      REQUIRE(s.train_files == s1.train_files);
      for (const auto& f : s.train_files)
        CHECK(read_all(dir / (input + "-" + std::to_string(threads)) + "/" + f) == read_all(dir / (input + "-1") + "/" + f));
      CHECK(read_all(s.validation_manifest).size() > 0);
      CHECK(tokens_of(s.validation_manifest) == tokens_of(s1.validation_manifest));
    }
    // Each document (text: head and tail of the split) encoded whole, then EOS.
    std::vector<uint32_t> train, val;
    if (input == "big.txt") {
      const size_t cut = text.find('\n', size_t(double(text.size()) * 0.9) - 1) + 1;
      train = neox().encode(std::string_view(text).substr(0, cut));
      train.push_back(eos);
      val = neox().encode(std::string_view(text).substr(cut));
      val.push_back(eos);
    } else {
      for (size_t d = 0; d < docs.size(); ++d) {
        auto& out = (d + 1) / 10 > d / 10 ? val : train;  // floor((d+1)·0.1) > floor(d·0.1)
        neox().encode_into(docs[d], out);
        out.push_back(eos);
      }
    }
    CHECK(tokens_of(s1.train_manifest) == train);
    CHECK(tokens_of(s1.validation_manifest) == val);
    CHECK(contains(read_all(s1.train_manifest), "each document ends with token 50279 <|endoftext|>"));
  }
}

TEST_CASE("token width: uint16 is refused above 65536 tokens; auto picks uint32") {
  TempDir dir;
  json j = neox_json();
  j["added_tokens"].push_back({{"id", 70000}, {"content", "<|big|>"}, {"single_word", false}, {"lstrip", false},
                               {"rstrip", false}, {"normalized", false}, {"special", true}});
  write_all(dir / "big.json", j.dump());
  CHECK(BpeTokenizer(dir / "big.json").vocab_size() == 70001);
  write_all(dir / "in.txt", "hello <|big|> world\n");
  TokenizeOptions o;
  o.inputs = {dir / "in.txt"};
  o.out_dir = dir / "out";
  o.tokenizer = dir / "big.json";
  o.dtype = TokenDtype::kUint16;
  const std::string msg = error_of([&] { run_tokenize(o); });
  CHECK(contains(msg, "70001"));
  CHECK(contains(msg, "--dtype uint32"));
  o.dtype.reset();
  const TokenizeSummary s = run_tokenize(o);
  CHECK(s.dtype == TokenDtype::kUint32);
  const std::string raw = read_all(dir / "out/train-00000.bin");
  REQUIRE(raw.size() == 4 * s.train_tokens);
  std::vector<uint32_t> ids(s.train_tokens);
  for (size_t i = 0; i < ids.size(); ++i)
    for (int b = 0; b < 4; ++b) ids[i] |= uint32_t(uint8_t(raw[4 * i + b])) << (8 * b);
  std::vector<uint32_t> want = BpeTokenizer(dir / "big.json").encode("hello <|big|> world\n");
  want.push_back(50279);
  CHECK(ids == want);
  CHECK(std::count(ids.begin(), ids.end(), 70000u) == 1);
  CHECK(contains(read_all(s.train_manifest), "uint32"));
}

TEST_CASE("[data] tokenizer: resolved like the other data paths, vocabulary checked against [model] vocab_size") {
  TempDir dir;
  fs::create_directories(dir.path / "cfg" / "tok");
  fs::copy_file(kNeox, dir.path / "cfg" / "tok" / "neox.json");
  auto config = [&](const std::string& model, const std::string& data) {
    const std::string path = dir / "cfg/run.toml";
    write_all(path, "[model]\n" + model + "\n[data]\ntrain = \"train.manifest\"\n" + data + "\n");
    return load_config(path);
  };
  auto config_error = [&](const Config& c) {
    try {
      check_tokenizer(c);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  Config c = config("vocab_size = 50304", "tokenizer = \"tok/neox.json\"");
  CHECK(c.data.tokenizer == (dir.path / "cfg" / "tok" / "neox.json").string());
  CHECK(config_error(c).empty());  // a larger model vocabulary is padding
  CHECK(config_error(config("vocab_size = 50280", "tokenizer = \"tok/neox.json\"")).empty());

  const std::string small = config_error(config("vocab_size = 256", "tokenizer = \"tok/neox.json\""));
  CHECK(contains(small, dir / "cfg/run.toml: "));
  CHECK(contains(small, "vocab_size = 256"));
  CHECK(contains(small, "50280"));
  CHECK(contains(small, "neox.json"));
  CHECK(small.find('\n') == std::string::npos);

  const std::string missing = config_error(config("vocab_size = 50304", "tokenizer = \"tok/nope.json\""));
  CHECK(contains(missing, "[data] tokenizer"));
  CHECK(contains(missing, dir / "cfg/tok/nope.json"));

  CHECK(config_error(config("vocab_size = 256", "tokenizer = \"bytes\"")).empty());
  CHECK(config("", "tokenizer = \"bytes\"").data.tokenizer == "bytes");
  CHECK(contains(config_error(config("vocab_size = 200", "tokenizer = \"bytes\"")), "(256 tokens)"));
  CHECK(config_error(config("vocab_size = 64", "")).empty());  // not declared: nothing to check

  json j = neox_json();
  j["added_tokens"].push_back({{"id", 70000}, {"content", "<|big|>"}, {"normalized", false}, {"special", true}});
  write_all(dir / "cfg/tok/big.json", j.dump());
  const std::string width = config_error(config("vocab_size = 70016", "tokenizer = \"tok/big.json\""));
  CHECK(contains(width, "token_dtype = \"uint16\""));
  CHECK(config_error(config("vocab_size = 70016", "tokenizer = \"tok/big.json\"\ntoken_dtype = \"uint32\"")).empty());

  // Checkpoints store the config as TOML: the key survives the round trip.
  CHECK(parse_config_text(config_to_toml(c), "again.toml").data.tokenizer == c.data.tokenizer);
}
