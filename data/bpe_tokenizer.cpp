#include "data/bpe_tokenizer.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

namespace spes {

namespace {

using nlohmann::json;

constexpr uint32_t kNoId = 0xffffffffu;

// ---- UTF-8 -----------------------------------------------------------------------

// Decodes the code point at text[i] (which must be valid UTF-8); sets `len`.
uint32_t decode_at(std::string_view text, size_t i, size_t& len) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(text[i + k])); };
  const uint32_t c = b(0);
  if (c < 0x80) return len = 1, c;
  if (c < 0xE0) return len = 2, ((c & 0x1F) << 6) | (b(1) & 0x3F);
  if (c < 0xF0) return len = 3, ((c & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
  return len = 4, ((c & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Oniguruma's \s for Unicode text, which `tokenizers` patterns are written against.
bool is_onig_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_ascii_letter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

// ---- the GPT-2 byte <-> character table of ByteLevel ------------------------------

// Printable Latin-1 bytes stand for themselves; the other 68 bytes map, in order, to
// U+0100.. (GPT-2's bytes_to_unicode).
struct ByteLevelTable {
  std::array<uint32_t, 256> char_of{};
  std::array<int16_t, 512> byte_of{};  // code point -> byte, -1 if none
  ByteLevelTable() {
    byte_of.fill(-1);
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      char_of[b] = printable ? b : next++;
      byte_of[char_of[b]] = static_cast<int16_t>(b);
    }
  }
  std::string chars(std::string_view bytes) const {
    std::string s;
    for (unsigned char b : bytes) append_utf8(s, char_of[b]);
    return s;
  }
  // The ByteLevel decoder on one token: its characters back to bytes, or the token's
  // own UTF-8 when a character is not in the table (added tokens such as "  ").
  std::string bytes(const std::string& token) const {
    std::string out;
    for (size_t i = 0, len = 0; i < token.size(); i += len) {
      const uint32_t c = decode_at(token, i, len);
      if (c >= byte_of.size() || byte_of[c] < 0) return token;
      out.push_back(static_cast<char>(byte_of[c]));
    }
    return out;
  }
};

const ByteLevelTable& byte_level() {
  static const ByteLevelTable t;
  return t;
}

// Bytes that occur in valid UTF-8 (not C0, C1, F5..FF): each needs a vocab entry.
bool occurs_in_utf8(unsigned b) { return b != 0xC0 && b != 0xC1 && b < 0xF5; }

// ---- regexes ----------------------------------------------------------------------

// The regex of ByteLevel's use_regex (GPT-2's).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Qwen2's Split regex.
constexpr const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// `tokenizers` compiles patterns with Oniguruma; PCRE2 reads the same syntax but its
// \s, \d, \w differ outside ASCII (e.g. PCRE2's \s also matches U+180E MONGOLIAN
// VOWEL SEPARATOR, Oniguruma's does not), so they are spelled out as Oniguruma's sets. Constructs whose meaning differs and that the
// supported files do not use are refused.
std::string onig_to_pcre2(const std::string& p, const std::function<void(const std::string&)>& fail) {
  const std::string space = R"(\t\n\x{0B}\f\r\x{85}\p{Zs}\p{Zl}\p{Zp})";
  const std::string word = R"(\p{L}\p{M}\p{Nd}\p{Pc})";
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char d = p[++i];
      switch (d) {
        case 's': out += in_class ? space : "[" + space + "]"; break;
        case 'S':
          if (in_class) fail("regex uses \\S inside a character class (not supported)");
          out += "[^" + space + "]";
          break;
        case 'd': out += R"(\p{Nd})"; break;
        case 'w': out += in_class ? word : "[" + word + "]"; break;
        case 'D': case 'W': case 'b': case 'B': case 'h': case 'H': case 'R': case 'X': case 'K': case 'G':
          fail(std::string("regex uses \\") + d + " (not supported)");
          break;
        default: out += c; out += d;
      }
      continue;
    }
    if (in_class && c == '[') fail("regex uses a nested character class (not supported)");
    if (in_class && c == '&' && i + 1 < p.size() && p[i + 1] == '&')
      fail("regex uses && in a character class (not supported)");
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // a leading ']' is literal
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

struct Regex {
  pcre2_code* code = nullptr;
  bool jit = false;
  Regex() = default;
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() {
    if (code) pcre2_code_free(code);
  }
};

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

// ---- added tokens -----------------------------------------------------------------

// The added tokens of one kind (normalized or not) as a byte trie; split() cuts them
// out of a text leftmost-longest, as aho-corasick's LeftmostLongest in `tokenizers`.
class AddedTokenMatcher {
 public:
  void add(const std::string& content, uint32_t id) {
    int32_t node = 0;
    for (unsigned char c : content) {
      int32_t next = child(node, c);
      if (next < 0) {
        next = static_cast<int32_t>(nodes_.size());
        nodes_[node].kids.emplace_back(c, next);
        nodes_.emplace_back();
      }
      node = next;
    }
    nodes_[node].id = id;
    first_[static_cast<unsigned char>(content[0])] = true;
    any_ = true;
  }
  bool empty() const { return !any_; }

  // Calls emit(piece, id) for every piece in order: id is the added token's, or
  // kNoId for the text between tokens (never empty).
  template <class F>
  void split(std::string_view text, F&& emit) const {
    if (!any_) {
      if (!text.empty()) emit(text, kNoId);
      return;
    }
    size_t start = 0, i = 0;
    const size_t n = text.size();
    while (i < n) {
      if (!first_[static_cast<unsigned char>(text[i])]) {
        ++i;
        continue;
      }
      size_t best = 0;
      uint32_t best_id = kNoId;
      int32_t node = 0;
      for (size_t j = i; j < n; ++j) {
        node = child(node, static_cast<unsigned char>(text[j]));
        if (node < 0) break;
        if (nodes_[node].id != kNoId) {
          best = j + 1 - i;
          best_id = nodes_[node].id;
        }
      }
      if (best == 0) {
        ++i;
        continue;
      }
      if (i > start) emit(text.substr(start, i - start), kNoId);
      emit(text.substr(i, best), best_id);
      i += best;
      start = i;
    }
    if (start < n) emit(text.substr(start), kNoId);
  }

 private:
  struct Node {
    uint32_t id = kNoId;
    std::vector<std::pair<unsigned char, int32_t>> kids;
  };
  int32_t child(int32_t node, unsigned char c) const {
    for (const auto& [k, n] : nodes_[node].kids)
      if (k == c) return n;
    return -1;
  }
  std::vector<Node> nodes_ = std::vector<Node>(1);
  std::array<bool, 256> first_{};
  bool any_ = false;
};

// ---- merges -----------------------------------------------------------------------

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

// (left id, right id) -> (rank, merged id): open addressing, linear probing.
class MergeMap {
 public:
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    slots_.assign(cap, Slot{kEmpty, 0, 0});
    mask_ = cap - 1;
  }
  // False if the pair is already there (a duplicate merge keeps its first rank).
  bool insert(uint32_t left, uint32_t right, uint32_t rank, uint32_t merged) {
    const uint64_t key = (uint64_t(left) << 32) | right;
    for (size_t i = mix64(key) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return false;
      if (slots_[i].key == kEmpty) {
        slots_[i] = Slot{key, rank, merged};
        return true;
      }
    }
  }
  // The merge of (left, right), or nullptr.
  struct Slot {
    uint64_t key;
    uint32_t rank;
    uint32_t merged;
  };
  const Slot* find(uint32_t left, uint32_t right) const {
    const uint64_t key = (uint64_t(left) << 32) | right;
    for (size_t i = mix64(key) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return &slots_[i];
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

// ---- per-thread state -------------------------------------------------------------

uint64_t hash_bytes(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (s.size() * 0xff51afd7ed558ccdull);
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t v;
    std::memcpy(&v, s.data() + i, 8);
    h = (h ^ v) * 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
  }
  uint64_t v = 0;
  std::memcpy(&v, s.data() + i, s.size() - i);
  h = mix64(h ^ v);
  return h | 1;  // 0 marks an empty slot
}

// Recently seen words -> their ids. Bounded: cleared when full.
class WordCache {
 public:
  static constexpr size_t kMaxWordBytes = 255;

  WordCache() { slots_.assign(kSlots, Slot{}); }

  bool find(std::string_view word, uint64_t h, std::vector<uint32_t>& out) const {
    for (size_t i = h & (kSlots - 1);; i = (i + 1) & (kSlots - 1)) {
      const Slot& s = slots_[i];
      if (s.hash == 0) return false;
      if (s.hash == h && s.key_len == word.size() && std::memcmp(keys_.data() + s.key_off, word.data(), word.size()) == 0) {
        out.insert(out.end(), ids_.begin() + s.ids_off, ids_.begin() + s.ids_off + s.n_ids);
        return true;
      }
    }
  }
  void insert(std::string_view word, uint64_t h, const uint32_t* ids, size_t n) {
    if (used_ >= kSlots / 2) clear();
    size_t i = h & (kSlots - 1);
    while (slots_[i].hash != 0) i = (i + 1) & (kSlots - 1);
    slots_[i] = Slot{h, static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(ids_.size()),
                     static_cast<uint16_t>(word.size()), static_cast<uint16_t>(n)};
    keys_.append(word);
    ids_.insert(ids_.end(), ids, ids + n);
    ++used_;
  }

 private:
  static constexpr size_t kSlots = size_t{1} << 18;
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_off = 0;
    uint32_t ids_off = 0;
    uint16_t key_len = 0;
    uint16_t n_ids = 0;
  };
  void clear() {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    keys_.clear();
    ids_.clear();
    used_ = 0;
  }
  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<uint32_t> ids_;
  size_t used_ = 0;
};

struct Symbol {
  uint32_t id;
  int32_t prev;
  int32_t next;
};
struct QueuedMerge {
  uint64_t key;  // rank << 32 | position: the lowest rank first, then the leftmost
  uint32_t merged;
  bool operator>(const QueuedMerge& o) const { return key > o.key; }
};

}  // namespace

// ---- the tokenizer ----------------------------------------------------------------

struct BpeTokenizer::Impl {
  std::string name;
  int64_t vocab_size = 0;
  uint32_t eos = kNoId;
  std::vector<std::string> token_text;   // by id ("" for an id nothing uses)
  std::vector<std::string> token_bytes;  // by id: what decode writes
  std::vector<uint8_t> has_id;
  std::array<uint32_t, 256> byte_id{};
  MergeMap merges;
  AddedTokenMatcher raw_added, normalized_added;
  bool nfc = false;

  // The pre-tokenizer as a chain of steps, applied piece by piece.
  struct Step {
    bool prefix_space = false;      // ByteLevel add_prefix_space
    std::unique_ptr<Regex> regex;   // Split / ByteLevel use_regex; null: no split
  };
  std::vector<Step> steps;
  // next_cut: which cuts are safe (set at the end of load()); an added token
  // holding "\n" or "<letter> " could span one.
  bool cut_at_newline = false, cut_at_space = false;
  bool added_has_newline = false, added_has_letter_space = false;

  struct Workspace {
    std::vector<pcre2_match_data*> match_data;
    pcre2_match_context* match_context = nullptr;
    pcre2_jit_stack* jit_stack = nullptr;
    std::vector<std::string> prefixed;  // per step
    std::vector<int32_t> nfc;           // utf8proc's buffer (code points, then UTF-8)
    std::vector<Symbol> symbols;
    std::vector<QueuedMerge> queue;
    std::vector<uint32_t> word_ids;
    WordCache cache;
    ~Workspace() {
      for (auto* m : match_data) pcre2_match_data_free(m);
      if (match_context) pcre2_match_context_free(match_context);
      if (jit_stack) pcre2_jit_stack_free(jit_stack);
    }
  };
  mutable std::mutex pool_mutex;
  mutable std::vector<std::unique_ptr<Workspace>> pool;

  [[noreturn]] void fail(const std::string& what) const { throw DataError(name + ": " + what); }

  void load(const std::string& text);
  void load_model(const json& model);
  void load_added_tokens(const json& added);
  void load_normalizer(const json& n);
  void load_pre_tokenizer(const json& p);
  std::unique_ptr<Regex> compile(const std::string& pattern, bool literal) const;

  std::unique_ptr<Workspace> acquire() const;
  void release(std::unique_ptr<Workspace> ws) const;

  std::string_view normalize(std::string_view piece, Workspace& ws) const;
  void pre_tokenize(size_t step, std::string_view piece, Workspace& ws, std::vector<uint32_t>& out) const;
  void encode_word(std::string_view word, Workspace& ws, std::vector<uint32_t>& out) const;
  void bpe(std::string_view word, Workspace& ws) const;
};

namespace {

std::string type_of(const json& j) {
  if (!j.is_object()) return "?";
  auto t = j.find("type");
  return (t != j.end() && t->is_string()) ? t->get<std::string>() : "?";
}

bool flag(const json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  return it->is_boolean() ? it->get<bool>() : fallback;
}

}  // namespace

std::unique_ptr<Regex> BpeTokenizer::Impl::compile(const std::string& pattern, bool literal) const {
  const std::string p = literal ? pattern : onig_to_pcre2(pattern, [&](const std::string& w) { fail(w); });
  int err = 0;
  PCRE2_SIZE at = 0;
  auto r = std::make_unique<Regex>();
  r->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(),
                          literal ? (PCRE2_UTF | PCRE2_LITERAL) : (PCRE2_UTF | PCRE2_UCP), &err, &at, nullptr);
  if (!r->code) fail("cannot compile pre-tokenizer regex /" + pattern + "/: " + pcre2_message(err));
  r->jit = pcre2_jit_compile(r->code, PCRE2_JIT_COMPLETE) == 0;
  return r;
}

void BpeTokenizer::Impl::load(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    std::string why = e.what();
    if (auto p = why.find("] "); p != std::string::npos) why = why.substr(p + 2);
    fail("not valid JSON (" + why + ")");
  }
  if (!j.is_object() || !j.contains("model")) fail("not a tokenizer.json (no \"model\")");
  if (j.contains("truncation") && !j["truncation"].is_null()) fail("unsupported truncation (must be null)");
  if (j.contains("padding") && !j["padding"].is_null()) fail("unsupported padding (must be null)");
  load_normalizer(j.value("normalizer", json()));
  load_model(j["model"]);
  load_added_tokens(j.value("added_tokens", json::array()));
  load_pre_tokenizer(j.value("pre_tokenizer", json()));

  const json post = j.value("post_processor", json());
  if (!post.is_null() && type_of(post) != "ByteLevel")
    fail("unsupported post_processor \"" + type_of(post) + "\" (supported: null, ByteLevel)");
  const json dec = j.value("decoder", json());
  if (type_of(dec) != "ByteLevel")
    fail("unsupported decoder \"" + (dec.is_null() ? std::string("null") : type_of(dec)) + "\" (supported: ByteLevel)");

  // Decoding table.
  const ByteLevelTable& bl = byte_level();
  token_bytes.resize(token_text.size());
  for (size_t id = 0; id < token_text.size(); ++id)
    if (has_id[id]) token_bytes[id] = bl.bytes(token_text[id]);

  // The end-of-document token.
  for (const char* candidate : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"}) {
    if (eos != kNoId) break;
    for (const auto& t : j.value("added_tokens", json::array())) {
      if (t.value("content", "") == candidate && flag(t, "special", false)) {
        eos = t["id"].get<uint32_t>();
        break;
      }
    }
  }
  if (eos == kNoId)
    fail("no end-of-document token: no special added token named <|endoftext|>, <|end_of_text|>, </s> or <eos>");
}

void BpeTokenizer::Impl::load_normalizer(const json& n) {
  if (n.is_null()) return;
  const std::string t = type_of(n);
  if (t == "NFC") {
    nfc = true;
    return;
  }
  if (t == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array()) {
    for (const auto& s : n["normalizers"]) {
      if (type_of(s) != "NFC")
        fail("unsupported normalizer \"" + type_of(s) + "\" in a Sequence (supported: NFC)");
      nfc = true;
    }
    return;
  }
  fail("unsupported normalizer \"" + t + "\" (supported: null, NFC)");
}

void BpeTokenizer::Impl::load_model(const json& m) {
  const std::string t = type_of(m);
  if (t != "BPE") fail("unsupported model \"" + t + "\" (supported: BPE)");
  if (m.contains("dropout") && !m["dropout"].is_null()) fail("unsupported BPE dropout (must be null)");
  if (flag(m, "byte_fallback", false)) fail("unsupported BPE byte_fallback = true");
  if (flag(m, "ignore_merges", false)) fail("unsupported BPE ignore_merges = true");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (m.contains(k) && !m[k].is_null() && !(m[k].is_string() && m[k].get<std::string>().empty()))
      fail(std::string("unsupported BPE ") + k + " (must be null or empty)");
  }
  const auto vit = m.find("vocab");
  if (vit == m.end() || !vit->is_object() || vit->empty()) fail("BPE model has no vocab");

  std::unordered_map<std::string, uint32_t> vocab;
  vocab.reserve(vit->size());
  uint64_t max_id = 0;
  for (const auto& [key, v] : vit->items()) {
    if (!v.is_number_unsigned() || v.get<uint64_t>() >= (uint64_t{1} << 31))
      fail("vocab entry \"" + key + "\" has no valid id");
    max_id = std::max(max_id, v.get<uint64_t>());
    vocab.emplace(key, v.get<uint32_t>());
  }
  token_text.assign(max_id + 1, "");
  has_id.assign(max_id + 1, 0);
  for (const auto& [key, id] : vocab) {
    if (has_id[id]) fail("vocab gives id " + std::to_string(id) + " to both \"" + token_text[id] + "\" and \"" + key + "\"");
    token_text[id] = key;
    has_id[id] = 1;
  }
  vocab_size = static_cast<int64_t>(max_id + 1);

  const ByteLevelTable& bl = byte_level();
  for (unsigned b = 0; b < 256; ++b) {
    auto it = vocab.find(bl.chars(std::string(1, static_cast<char>(b))));
    byte_id[b] = it == vocab.end() ? kNoId : it->second;
    if (byte_id[b] == kNoId && occurs_in_utf8(b)) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02X", b);
      fail(std::string("not a byte-level vocabulary: byte ") + hex + " has no token");
    }
  }

  const auto mit = m.find("merges");
  if (mit == m.end() || !mit->is_array()) fail("BPE model has no merges list");
  merges.reserve(mit->size());
  uint32_t rank = 0;
  for (const auto& e : *mit) {
    std::string a, b;
    if (e.is_string()) {
      const std::string& s = e.get_ref<const std::string&>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        fail("merge " + std::to_string(rank) + " \"" + s + "\" is not two tokens separated by a space");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      fail("merge " + std::to_string(rank) + " is neither \"a b\" nor [\"a\", \"b\"]");
    }
    auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    if (ia == vocab.end() || ib == vocab.end())
      fail("merge " + std::to_string(rank) + " (" + a + " " + b + ") uses a token not in the vocab");
    if (iab == vocab.end())
      fail("merge " + std::to_string(rank) + " (" + a + " " + b + ") makes a token not in the vocab");
    merges.insert(ia->second, ib->second, rank, iab->second);
    ++rank;
  }
}

void BpeTokenizer::Impl::load_added_tokens(const json& added) {
  if (!added.is_array()) fail("added_tokens is not a list");
  for (const auto& t : added) {
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_unsigned() || !t.contains("content") ||
        !t["content"].is_string())
      fail("an added token lacks an id or content");
    const std::string content = t["content"].get<std::string>();
    const uint64_t id = t["id"].get<uint64_t>();
    if (content.empty()) fail("an added token has empty content");
    if (id >= (uint64_t{1} << 31)) fail("added token \"" + content + "\" has an id out of range");
    for (const char* k : {"single_word", "lstrip", "rstrip"})
      if (flag(t, k, false)) fail("unsupported added token option " + std::string(k) + " = true (token \"" + content + "\")");
    if (id < has_id.size() && has_id[id] && token_text[id] != content)
      fail("added token \"" + content + "\" has id " + std::to_string(id) + ", which the vocab gives to \"" +
           token_text[id] + "\"");
    if (id >= token_text.size()) {
      token_text.resize(id + 1);
      has_id.resize(id + 1, 0);
    }
    token_text[id] = content;
    has_id[id] = 1;
    vocab_size = std::max<int64_t>(vocab_size, static_cast<int64_t>(id) + 1);
    const bool normalized = flag(t, "normalized", !flag(t, "special", false));
    if (!normalized) {
      raw_added.add(content, static_cast<uint32_t>(id));
    } else {
      // Matched on normalized text, so the pattern is normalized too.
      std::string pattern = content;
      if (nfc) {
        utf8proc_uint8_t* out = nullptr;
        const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(content.data()),
                                    static_cast<utf8proc_ssize_t>(content.size()), &out,
                                    static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
        if (n < 0) fail("added token \"" + content + "\" is not valid UTF-8");
        pattern.assign(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
        std::free(out);
      }
      normalized_added.add(pattern, static_cast<uint32_t>(id));
    }
    added_has_newline = added_has_newline || content.find('\n') != std::string::npos;
    for (size_t i = 0; i + 1 < content.size(); ++i)
      if (is_ascii_letter(content[i]) && content[i + 1] == ' ') added_has_letter_space = true;
  }
}

void BpeTokenizer::Impl::load_pre_tokenizer(const json& p) {
  if (p.is_null()) fail("no pre_tokenizer (a byte-level tokenizer needs ByteLevel)");
  std::vector<json> parts;
  if (type_of(p) == "Sequence") {
    if (!p.contains("pretokenizers") || !p["pretokenizers"].is_array()) fail("pre_tokenizer Sequence without a list");
    for (const auto& s : p["pretokenizers"]) parts.push_back(s);
  } else {
    parts.push_back(p);
  }
  std::vector<std::string> shape;  // to recognise the configurations next_cut knows
  for (size_t i = 0; i < parts.size(); ++i) {
    const json& s = parts[i];
    const std::string t = type_of(s);
    Step step;
    if (t == "ByteLevel") {
      if (i + 1 != parts.size()) fail("unsupported pre_tokenizer: ByteLevel must come last");
      step.prefix_space = flag(s, "add_prefix_space", true);
      if (flag(s, "use_regex", true)) {
        step.regex = compile(kGpt2Pattern, false);
        shape.push_back("ByteLevel(gpt2)");
      } else {
        shape.push_back("ByteLevel");
      }
      if (step.prefix_space) shape.push_back("prefix_space");
    } else if (t == "Split") {
      const std::string behavior = s.value("behavior", "");
      if (behavior != "Isolated")
        fail("unsupported Split behavior \"" + behavior + "\" (supported: Isolated)");
      if (flag(s, "invert", false)) fail("unsupported Split invert = true");
      const json pat = s.value("pattern", json());
      if (pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string()) {
        step.regex = compile(pat["Regex"].get<std::string>(), false);
        shape.push_back(pat["Regex"].get<std::string>() == kQwen2Pattern ? "Split(qwen2)" : "Split(other)");
      } else if (pat.is_object() && pat.contains("String") && pat["String"].is_string()) {
        if (pat["String"].get<std::string>().empty()) fail("Split with an empty String pattern");
        step.regex = compile(pat["String"].get<std::string>(), true);
        shape.push_back("Split(other)");
      } else {
        fail("Split pattern is neither {\"Regex\": ...} nor {\"String\": ...}");
      }
    } else {
      fail("unsupported pre_tokenizer \"" + t + "\" (supported: ByteLevel, Split, Sequence of them)");
    }
    steps.push_back(std::move(step));
  }
  if (type_of(parts.back()) != "ByteLevel") fail("unsupported pre_tokenizer: no ByteLevel (not a byte-level tokenizer)");
  // next_cut's argument holds for exactly these (see its comment).
  const bool known = shape == std::vector<std::string>{"ByteLevel(gpt2)"} ||
                     shape == std::vector<std::string>{"Split(qwen2)", "ByteLevel"};
  cut_at_newline = known && !added_has_newline;
  cut_at_space = known && !added_has_letter_space;
}

std::unique_ptr<BpeTokenizer::Impl::Workspace> BpeTokenizer::Impl::acquire() const {
  {
    std::lock_guard<std::mutex> lock(pool_mutex);
    if (!pool.empty()) {
      auto ws = std::move(pool.back());
      pool.pop_back();
      return ws;
    }
  }
  auto ws = std::make_unique<Workspace>();
  ws->match_context = pcre2_match_context_create(nullptr);
  ws->jit_stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
  if (!ws->match_context || !ws->jit_stack) throw DataError(name + ": out of memory for the regex matcher");
  pcre2_jit_stack_assign(ws->match_context, nullptr, ws->jit_stack);
  for (const Step& s : steps) {
    ws->match_data.push_back(s.regex ? pcre2_match_data_create_from_pattern(s.regex->code, nullptr) : nullptr);
    if (s.regex && !ws->match_data.back()) throw DataError(name + ": out of memory for the regex matcher");
  }
  ws->prefixed.resize(steps.size());
  return ws;
}

void BpeTokenizer::Impl::release(std::unique_ptr<Workspace> ws) const {
  std::lock_guard<std::mutex> lock(pool_mutex);
  pool.push_back(std::move(ws));
}

// NFC through utf8proc's own two steps (decompose into our buffer, then compose and
// re-encode in place), so no allocation per piece. ASCII is always NFC.
std::string_view BpeTokenizer::Impl::normalize(std::string_view piece, Workspace& ws) const {
  if (!nfc) return piece;
  bool ascii = true;
  for (char c : piece) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
  if (ascii) return piece;
  const auto opts = static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
  const auto* s = reinterpret_cast<const utf8proc_uint8_t*>(piece.data());
  const auto len = static_cast<utf8proc_ssize_t>(piece.size());
  if (ws.nfc.size() < piece.size() + 1) ws.nfc.resize(piece.size() + 1);
  utf8proc_ssize_t n = utf8proc_decompose(s, len, ws.nfc.data(), static_cast<utf8proc_ssize_t>(ws.nfc.size()), opts);
  if (n > static_cast<utf8proc_ssize_t>(ws.nfc.size())) {
    ws.nfc.resize(static_cast<size_t>(n));
    n = utf8proc_decompose(s, len, ws.nfc.data(), n, opts);
  }
  if (n < 0) throw DataError(name + ": NFC failed: " + utf8proc_errmsg(n));
  const utf8proc_ssize_t bytes = utf8proc_reencode(ws.nfc.data(), n, opts);
  if (bytes < 0) throw DataError(name + ": NFC failed: " + utf8proc_errmsg(bytes));
  return std::string_view(reinterpret_cast<const char*>(ws.nfc.data()), static_cast<size_t>(bytes));
}

void BpeTokenizer::Impl::pre_tokenize(size_t k, std::string_view piece, Workspace& ws,
                                      std::vector<uint32_t>& out) const {
  if (k == steps.size()) {
    encode_word(piece, ws, out);
    return;
  }
  const Step& step = steps[k];
  if (step.prefix_space && piece.front() != ' ') {
    ws.prefixed[k].assign(1, ' ');
    ws.prefixed[k].append(piece);
    piece = ws.prefixed[k];
  }
  if (!step.regex) {
    pre_tokenize(k + 1, piece, ws, out);
    return;
  }
  // Split, behavior Isolated: every match is a piece, and so is every gap between.
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
  const size_t n = piece.size();
  pcre2_match_data* md = ws.match_data[k];
  size_t pos = 0, gap = 0;
  while (pos <= n) {
    const int rc = step.regex->jit
                       ? pcre2_jit_match(step.regex->code, subject, n, pos, 0, md, ws.match_context)
                       : pcre2_match(step.regex->code, subject, n, pos, PCRE2_NO_UTF_CHECK, md, ws.match_context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) throw DataError(name + ": pre-tokenizer regex failed: " + pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t s = ov[0], e = ov[1];
    if (s > gap) pre_tokenize(k + 1, piece.substr(gap, s - gap), ws, out);
    if (e > s) {
      pre_tokenize(k + 1, piece.substr(s, e - s), ws, out);
      pos = e;
    } else {  // an empty match: step over one character
      size_t len = 1;
      if (e < n) decode_at(piece, e, len);
      pos = e + len;
    }
    gap = e;
  }
  if (gap < n) pre_tokenize(k + 1, piece.substr(gap), ws, out);
}

void BpeTokenizer::Impl::encode_word(std::string_view word, Workspace& ws, std::vector<uint32_t>& out) const {
  if (word.size() == 1) {
    out.push_back(byte_id[static_cast<unsigned char>(word[0])]);
    return;
  }
  const bool cacheable = word.size() <= WordCache::kMaxWordBytes;
  uint64_t h = 0;
  if (cacheable) {
    h = hash_bytes(word);
    if (ws.cache.find(word, h, out)) return;
  }
  bpe(word, ws);
  if (cacheable && ws.word_ids.size() <= 0xffff) ws.cache.insert(word, h, ws.word_ids.data(), ws.word_ids.size());
  out.insert(out.end(), ws.word_ids.begin(), ws.word_ids.end());
}

// `tokenizers`' merge order: a queue of (rank, position), the lowest rank first and
// the leftmost among equals; an entry whose pair has changed since it was queued is
// dropped unless the pair now there merges into the same token.
void BpeTokenizer::Impl::bpe(std::string_view word, Workspace& ws) const {
  const int32_t n = static_cast<int32_t>(word.size());
  auto& sym = ws.symbols;
  auto& q = ws.queue;
  sym.resize(static_cast<size_t>(n));
  q.clear();
  for (int32_t i = 0; i < n; ++i) sym[i] = Symbol{byte_id[static_cast<unsigned char>(word[i])], i - 1, i + 1 < n ? i + 1 : -1};
  auto queue_pair = [&](int32_t pos) {
    const int32_t next = sym[pos].next;
    if (next < 0) return;
    if (const auto* m = merges.find(sym[pos].id, sym[next].id)) {
      q.push_back(QueuedMerge{(uint64_t(m->rank) << 32) | uint32_t(pos), m->merged});
      std::push_heap(q.begin(), q.end(), std::greater<>());
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) queue_pair(i);
  while (!q.empty()) {
    std::pop_heap(q.begin(), q.end(), std::greater<>());
    const QueuedMerge top = q.back();
    q.pop_back();
    const int32_t pos = static_cast<int32_t>(top.key & 0xffffffffu);
    if (sym[pos].id == kNoId) continue;  // merged into its left neighbour
    const int32_t next = sym[pos].next;
    if (next < 0) continue;
    const auto* m = merges.find(sym[pos].id, sym[next].id);
    if (!m || m->merged != top.merged) continue;
    sym[pos].id = top.merged;
    sym[pos].next = sym[next].next;
    if (sym[next].next >= 0) sym[sym[next].next].prev = pos;
    sym[next].id = kNoId;
    if (sym[pos].prev >= 0) queue_pair(sym[pos].prev);
    queue_pair(pos);
  }
  ws.word_ids.clear();
  for (int32_t i = 0; i >= 0; i = sym[i].next) ws.word_ids.push_back(sym[i].id);
}

// ---- public -----------------------------------------------------------------------

size_t find_invalid_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    // ASCII runs, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t v;
      std::memcpy(&v, s + i, 8);
      if (v & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const unsigned c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;       // overlong
      else if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;       // overlong
      else if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return i;
    }
    if (i + len > n) return i;
    if (s[i + 1] < lo || s[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k)
      if ((s[i + k] & 0xC0) != 0x80) return i;
    i += len;
  }
  return n;
}

UnicodeVersions bpe_unicode_versions() {
  char buf[64] = {};
  pcre2_config(PCRE2_CONFIG_UNICODE_VERSION, buf);
  return UnicodeVersions{buf, utf8proc_unicode_version()};
}

BpeTokenizer::BpeTokenizer(const std::string& path) : impl_(std::make_unique<Impl>()) {
  impl_->name = path;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(path + ": tokenizer file not found or not readable");
  std::ostringstream ss;
  ss << in.rdbuf();
  impl_->load(ss.str());
}

BpeTokenizer::BpeTokenizer(const std::string& json_text, const std::string& name) : impl_(std::make_unique<Impl>()) {
  impl_->name = name;
  impl_->load(json_text);
}

BpeTokenizer::~BpeTokenizer() = default;

const std::string& BpeTokenizer::name() const { return impl_->name; }
int64_t BpeTokenizer::vocab_size() const { return impl_->vocab_size; }
uint32_t BpeTokenizer::eos_id() const { return impl_->eos; }
std::string BpeTokenizer::eos_text() const { return impl_->token_text[impl_->eos]; }
const std::string& BpeTokenizer::token_text(uint32_t id) const {
  if (id >= impl_->token_text.size() || !impl_->has_id[id])
    throw DataError(impl_->name + ": token id " + std::to_string(id) + " is not in the vocabulary");
  return impl_->token_text[id];
}

void BpeTokenizer::encode_into(std::string_view text, std::vector<uint32_t>& out) const {
  const Impl& im = *impl_;
  const size_t bad = find_invalid_utf8(text);
  if (bad < text.size()) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned char>(text[bad]));
    throw InvalidUtf8Error(im.name + ": input is not valid UTF-8 at byte " + std::to_string(bad) + " (" + hex + ")",
                           bad);
  }
  auto ws = im.acquire();
  struct Release {
    const Impl& im;
    std::unique_ptr<Impl::Workspace>& ws;
    ~Release() { im.release(std::move(ws)); }
  } release{im, ws};
  im.raw_added.split(text, [&](std::string_view piece, uint32_t id) {
    if (id != kNoId) {
      out.push_back(id);
      return;
    }
    im.normalized_added.split(im.normalize(piece, *ws), [&](std::string_view sub, uint32_t sub_id) {
      if (sub_id != kNoId) out.push_back(sub_id);
      else im.pre_tokenize(0, sub, *ws, out);
    });
  });
}

std::string BpeTokenizer::decode(std::span<const uint32_t> ids) const {
  const Impl& im = *impl_;
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    const uint32_t id = ids[i];
    if (id >= im.token_bytes.size() || !im.has_id[id]) {
      throw DataError(im.name + ": token id " + std::to_string(id) + " at position " + std::to_string(i) +
                      " is not in the vocabulary (size " + std::to_string(im.vocab_size) + ")");
    }
    text += im.token_bytes[id];
  }
  return text;
}

// Why these cuts are safe (for the GPT-2 and Qwen2 regexes, without add_prefix_space):
// - "X\nY" with X, Y not white space: no regex alternative crosses from a "\n" into a
//   non-space (the space alternatives stop there, and ` ?[^\s\p{L}\p{N}]+[\r\n]*`
//   ends with the newlines), the "\n" is one piece whether or not Y follows (GPT-2's
//   `\s+(?!\S)` fails before Y and `\s+` takes the same "\n"), nothing before X
//   reaches past it, and "\n" composes with nothing under NFC.
// - "a b" (ASCII letters): letters end at the space, " b..." starts the next piece
//   either way, and neither the space nor an ASCII letter composes under NFC.
// An added token could still span the cut if it contained "\n" or "<letter> ": such
// files disable the cut (load_added_tokens).
size_t BpeTokenizer::next_cut(std::string_view text, size_t from) const {
  const Impl& im = *impl_;
  const size_t n = text.size();
  if (!im.cut_at_newline && !im.cut_at_space) return n;
  for (size_t p = std::max<size_t>(from, 2); p + 1 < n; ++p) {
    const char c = text[p];
    if (im.cut_at_space && c == ' ' && is_ascii_letter(text[p - 1]) && is_ascii_letter(text[p + 1])) return p;
    if (im.cut_at_newline && text[p - 1] == '\n') {
      // The character before the '\n' (walk back over continuation bytes) and at p.
      size_t q = p - 2;
      while (q > 0 && (static_cast<unsigned char>(text[q]) & 0xC0) == 0x80) --q;
      if (find_invalid_utf8(text.substr(q, p - 1 - q)) != p - 1 - q) continue;
      size_t len = 0;
      const uint32_t before = decode_at(text, q, len);
      if (len != p - 1 - q || is_onig_space(before)) continue;
      const size_t lead = std::min<size_t>(4, n - p);
      size_t valid = find_invalid_utf8(text.substr(p, lead));
      if (valid == 0) continue;
      const uint32_t after = decode_at(text, p, len);
      if (len > valid || is_onig_space(after)) continue;
      return p;
    }
  }
  return n;
}

}  // namespace spes
