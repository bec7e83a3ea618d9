// TOML → Config with every key checked, Config → TOML, and the reference table:
// three visitors of the one key list (engine/config_keys.hpp). Errors name the file,
// the line (where toml11 knows it), the key and what was expected, on one line.
#include "engine/config.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <toml.hpp>

#include "data/tokenizer.hpp"
#include "engine/base/error.hpp"
#include "engine/config_keys.hpp"
#include "net/address.hpp"

namespace spes {
namespace {

using config_keys::Interval;
using config_keys::kMaxInt;

std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}
std::string num(int64_t x) { return std::to_string(x); }

// What each kind of key allows, as the reader's errors ("expected ...") and the
// reference table say it.
std::string allowed_integer(int64_t lo, int64_t hi) {
  return "an integer in [" + num(lo) + ", " + (hi == kMaxInt ? "inf" : num(hi)) + "]";
}
std::string allowed_real(Interval r) {
  return std::string("a number in ") + (r.lo_open ? "(" : "[") + num(r.lo) + ", " +
         (std::isinf(r.hi) ? "inf" : num(r.hi)) + (r.hi_open || std::isinf(r.hi) ? ")" : "]");
}
std::string allowed_integer_list(int64_t lo, int64_t hi) {
  return "a list of integers in [" + num(lo) + ", " + num(hi) + "]";
}
const char* const kAllowedBoolean = "true or false";
const char* const kAllowedString = "a string";
template <class E, size_t N>
std::string allowed_choice(const EnumName<E> (&names)[N]) {
  return "one of " + join_names(names, "\"", " ", " ");
}

// Where a key's value came from: "file:line" or "--set model.x=1".
struct Origins {
  std::string file;
  std::map<std::string, std::string> set_by;          // "section.key" -> the --set argument
  std::map<std::string, std::string> section_set_by;  // a section no file wrote -> the --set that made it

  std::string where(const std::string& section, const std::string& key, const toml::value& v) const {
    auto it = set_by.find(section + "." + key);
    if (it != set_by.end()) return "--set " + it->second;
    return where(v);
  }
  // Where a whole section came from: the file, or the --set that made it.
  std::string section_where(const std::string& section, const toml::value& v) const {
    auto it = section_set_by.find(section);
    return it != section_set_by.end() ? "--set " + it->second : where(v);
  }
  std::string where(const toml::value& v) const {
    const auto line = v.location().line();
    return line > 0 ? file + ":" + std::to_string(line) : file;
  }
};

// A value as its file or --set wrote it (so 1e99 stays 1e99, and an integer past the
// 64-bit range is not shown as the limit the parser clamped it to), on one line.
std::string show(const toml::value& v) {
  const auto& loc = v.location();
  std::string s;
  const size_t column = loc.column(), region = loc.region();
  if (loc.line() > 0 && column > 0 && region > 0 && column - 1 + region <= loc.line_str().size()) {
    s = loc.line_str().substr(column - 1, region);
  } else {
    std::ostringstream os;
    os << v;
    s = os.str();
  }
  std::string one_line;
  for (char ch : s) {
    const bool space = ch == '\n' || ch == '\r' || ch == '\t' || ch == ' ';
    if (!space) one_line += ch;
    else if (!one_line.empty() && one_line.back() != ' ') one_line += ' ';
  }
  while (!one_line.empty() && one_line.back() == ' ') one_line.pop_back();
  if (one_line.size() > 40) one_line = one_line.substr(0, 37) + "...";
  return one_line;
}

std::string resolve(const std::filesystem::path& base, const std::string& p) {
  if (p.empty() || std::filesystem::path(p).is_absolute()) return p;
  return (base / p).lexically_normal().string();
}

// The parser clamps an integer past the 64-bit range to the range's ends, so neither
// end is taken as a value.
bool in_range(const toml::value& v, int64_t lo, int64_t hi) {
  if (!v.is_integer()) return false;
  const int64_t x = v.as_integer();
  return x >= lo && x <= hi && x != std::numeric_limits<int64_t>::max() && x != std::numeric_limits<int64_t>::min();
}

// The key-list visitor that reads a TOML document into a Config: checks each key's
// type and range, resolves path keys against `base`, and reports any key of a
// section that is not in its list as unknown.
class Reader {
 public:
  Reader(const toml::table& root, const Origins& origins, std::filesystem::path base)
      : root_(root), origins_(origins), base_(std::move(base)) {}

  template <class Body>
  void section(const char* name, Body body) {
    section_ = name;
    auto it = root_.find(name);
    table_ = it == root_.end() ? nullptr : &it->second.as_table();
    read_order_.clear();
    body();
    reject_unknown();
  }

  void integer(const char* key, int64_t& out, int64_t lo, int64_t hi, const char*) {
    const toml::value* v = find(key);
    if (!v) return;
    if (!in_range(*v, lo, hi)) fail(key, *v, allowed_integer(lo, hi));
    out = v->as_integer();
  }
  void unsigned_integer(const char* key, uint64_t& out, const char* doc) {
    int64_t x = static_cast<int64_t>(out);
    integer(key, x, 0, kMaxInt, doc);
    out = static_cast<uint64_t>(x);
  }
  void real(const char* key, double& out, Interval r, const char*) {
    const toml::value* v = find(key);
    if (!v) return;
    double x = 0;
    bool ok = v->is_floating() || v->is_integer();
    if (ok) x = v->is_floating() ? v->as_floating() : double(v->as_integer());
    ok = ok && std::isfinite(x) && (r.lo_open ? x > r.lo : x >= r.lo) && (r.hi_open ? x < r.hi : x <= r.hi);
    if (!ok) fail(key, *v, allowed_real(r));
    out = x;
  }
  void integer_list(const char* key, std::vector<int64_t>& out, int64_t lo, int64_t hi, const char*) {
    const toml::value* v = find(key);
    if (!v) return;
    std::vector<int64_t> xs;
    bool ok = v->is_array();
    if (ok)
      for (const toml::value& x : v->as_array()) {
        ok = ok && in_range(x, lo, hi);
        if (ok) xs.push_back(x.as_integer());
      }
    if (!ok) fail(key, *v, allowed_integer_list(lo, hi));
    out = xs;
  }
  void boolean(const char* key, bool& out, const char*) {
    const toml::value* v = find(key);
    if (!v) return;
    if (!v->is_boolean()) fail(key, *v, kAllowedBoolean);
    out = v->as_boolean();
  }
  void string(const char* key, std::string& out, const char*) {
    const toml::value* v = find(key);
    if (!v) return;
    if (!v->is_string()) fail(key, *v, kAllowedString);
    out = v->as_string().str;
  }
  void path(const char* key, std::string& out, const char* doc) {
    string(key, out, doc);
    out = resolve(base_, out);
  }
  template <class E, size_t N>
  void choice(const char* key, E& out, const EnumName<E> (&names)[N], const char*) {
    const toml::value* v = find(key);
    if (!v) return;
    std::optional<E> e;
    if (v->is_string()) e = enum_from_name(names, v->as_string().str);
    if (!e) fail(key, *v, allowed_choice(names));
    out = *e;
  }

 private:
  const toml::value* find(const char* key) {
    read_order_.push_back(key);
    if (!table_) return nullptr;
    auto it = table_->find(key);
    return it == table_->end() ? nullptr : &it->second;
  }
  // Every key present but not in the section's list is a typo or a key of another version.
  void reject_unknown() const {
    if (!table_) return;
    for (const auto& [key, v] : *table_) {
      if (std::find(read_order_.begin(), read_order_.end(), key) != read_order_.end()) continue;
      std::string known;
      for (const auto& k : read_order_) known += (known.empty() ? "" : ", ") + k;
      throw ConfigError(origins_.where(section_, key, v) + ": unknown key [" + section_ + "] " + key +
                        " (known keys: " + known + ")");
    }
  }
  [[noreturn]] void fail(const char* key, const toml::value& v, const std::string& expected) const {
    throw ConfigError(origins_.where(section_, key, v) + ": [" + section_ + "] " + key + " = " + show(v) +
                      ": expected " + expected);
  }

  const toml::table& root_;
  const Origins& origins_;
  std::filesystem::path base_;
  std::string section_;
  const toml::table* table_ = nullptr;
  std::vector<std::string> read_order_;
};

// The section names of the key list, in order; the keys themselves are skipped.
struct SectionNames {
  std::vector<std::string> names;
  template <class Body>
  void section(const char* name, Body) {
    names.push_back(name);
  }
  template <class... A> void integer(const A&...) {}
  template <class... A> void unsigned_integer(const A&...) {}
  template <class... A> void real(const A&...) {}
  template <class... A> void integer_list(const A&...) {}
  template <class... A> void boolean(const A&...) {}
  template <class... A> void string(const A&...) {}
  template <class... A> void path(const A&...) {}
  template <class... A> void choice(const A&...) {}
};

std::vector<std::string> section_names() {
  SectionNames v;
  Config c;
  config_keys::config_sections(v, c);
  return v.names;
}

// Checks that involve several keys; each names every key involved.
void check_consistency(const Config& c) {
  auto fail = [&](const std::string& msg) { throw ConfigError(c.path + ": " + msg); };
  try {
    net::parse_host_port(c.spes.coordinator);
  } catch (const NetError& e) {
    fail(std::string("[spes] coordinator: ") + e.what());
  }
  if (c.spes.tls_ca.empty() && (!c.spes.tls_cert.empty() || !c.spes.tls_key.empty()))
    fail("[spes] tls_cert / tls_key need tls_ca (the run's CA certificate, from `spes-engine certs`)");
  const ModelConfig& m = c.model;
  if (m.head_dim_key == 0 && m.d_model % m.n_heads != 0)
    fail("[model] d_model = " + std::to_string(m.d_model) + " must be a multiple of n_heads = " +
         std::to_string(m.n_heads) + " (or set head_dim)");
  if (m.head_dim() % 2 != 0)
    fail(std::string("[model] ") + (m.head_dim_key ? "head_dim" : "d_model / n_heads") + " = " +
         std::to_string(m.head_dim()) + " must be even (RoPE rotates pairs)");
  if (m.qk_norm_per_head && !m.qk_norm) fail("[model] qk_norm_per_head = true needs qk_norm = true");
  if (m.n_heads % m.n_kv_heads != 0)
    fail("[model] n_heads = " + std::to_string(m.n_heads) + " must be a multiple of n_kv_heads = " +
         std::to_string(m.n_kv_heads));
  if (m.top_k > m.n_experts)
    fail("[model] top_k = " + std::to_string(m.top_k) + " exceeds n_experts = " + std::to_string(m.n_experts));
  if (c.train.global_batch % c.train.micro_batch != 0)
    fail("[train] global_batch = " + std::to_string(c.train.global_batch) +
         " must be a multiple of micro_batch = " + std::to_string(c.train.micro_batch));
  const SpesConfig& s = c.spes;
  if (s.node_id >= s.n_nodes)
    fail("[spes] node_id = " + std::to_string(s.node_id) + " must be < n_nodes = " + std::to_string(s.n_nodes));
  if (s.ownership == OwnershipMode::partitioned) {
    int64_t k = s.experts_per_node ? s.experts_per_node : m.n_experts / s.n_nodes;
    if (s.experts_per_node == 0 && m.n_experts % s.n_nodes != 0)
      fail("[spes] n_nodes = " + std::to_string(s.n_nodes) + " does not divide [model] n_experts = " +
           std::to_string(m.n_experts) + "; set [spes] experts_per_node");
    if (k > m.n_experts)
      fail("[spes] experts_per_node = " + std::to_string(k) + " exceeds [model] n_experts = " +
           std::to_string(m.n_experts));
    if (k * s.n_nodes < m.n_experts)
      fail("[spes] n_nodes × experts_per_node = " + std::to_string(k * s.n_nodes) +
           " leaves experts without an owner ([model] n_experts = " + std::to_string(m.n_experts) + ")");
  }
  if (s.overlap_steps > 0 && (!s.overlap || s.overlap_steps >= s.sync_steps))
    fail("[spes] overlap_steps = " + std::to_string(s.overlap_steps) + " needs overlap = true and must be below "
         "sync_steps = " + std::to_string(s.sync_steps));
  if (s.min_nodes > s.n_nodes)
    fail("[spes] min_nodes = " + std::to_string(s.min_nodes) + " exceeds n_nodes = " + std::to_string(s.n_nodes));
  if (s.merge_alpha > 0 && (s.merge_interval == 0 || s.merge_decay_steps == 0))
    fail("[spes] merge_alpha > 0 needs merge_interval > 0 and merge_decay_steps > 0");
  if (s.outer_optimizer == net::OuterKind::average && s.outer_momentum != 0) {
    char v[32];
    std::snprintf(v, sizeof v, "%g", s.outer_momentum);
    fail("[spes] outer_momentum = " + std::string(v) + " needs outer_optimizer = \"nesterov\" (average has none)");
  }
  if (c.data.train.empty()) fail("[data] train: a manifest path is required");
}

// "--set section.key=value": the value is TOML (1, 0.5, true, "x"); a bare word
// that is not valid TOML is taken as a string so `--set train.device=cpu` works.
void apply_override(toml::value& root, const std::string& arg, Origins& origins) {
  const auto eq = arg.find('=');
  const auto dot = arg.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq || dot == 0 || dot + 1 == eq)
    throw ConfigError("--set " + arg + ": expected section.key=value");
  const std::string section = arg.substr(0, dot), key = arg.substr(dot + 1, eq - dot - 1);
  const std::string text = arg.substr(eq + 1);
  toml::value v;
  try {
    std::istringstream is("v = " + text);
    v = toml::parse(is, "--set").as_table().at("v");
  } catch (const std::exception&) {
    v = toml::value(text);
  }
  if (!root.is_table()) root = toml::table{};
  auto& table = root.as_table();
  auto it = table.find(section);
  if (it == table.end()) {
    it = table.emplace(section, toml::table{}).first;
    origins.section_set_by[section] = arg;
  }
  if (!it->second.is_table()) throw ConfigError("--set " + arg + ": [" + section + "] is not a section");
  it->second.as_table()[key] = v;
  origins.set_by[section + "." + key] = arg;
}

// nesterov's outer_lr and outer_momentum default to DiLoCo's 0.7 and 0.9 where the
// config does not set them (the key list's defaults are average's, 1 and 0).
void apply_nesterov_defaults(const toml::table& root, SpesConfig& s) {
  if (s.outer_optimizer != net::OuterKind::nesterov) return;
  auto it = root.find("spes");
  auto given = [&](const char* key) { return it != root.end() && it->second.as_table().count(key) > 0; };
  if (!given("outer_lr")) s.outer_lr = 0.7;
  if (!given("outer_momentum")) s.outer_momentum = 0.9;
}

Config build_config(toml::value root, const std::string& name, const std::filesystem::path& base,
                    const std::vector<std::string>& overrides) {
  Origins origins{name, {}, {}};
  for (const auto& o : overrides) apply_override(root, o, origins);
  if (!root.is_table()) root = toml::table{};
  const std::vector<std::string> sections = section_names();
  for (const auto& [section, v] : root.as_table()) {
    const std::string where = origins.section_where(section, v);
    if (std::find(sections.begin(), sections.end(), section) == sections.end()) {
      std::string known;
      for (const auto& s : sections) known += (known.empty() ? "[" : " [") + s + "]";
      throw ConfigError(where + ": unknown section [" + section + "] (known: " + known + ")");
    }
    if (!v.is_table()) throw ConfigError(where + ": " + section + " must be a section [" + section + "]");
  }
  Config c;
  c.path = name;
  Reader reader(root.as_table(), origins, base);
  config_keys::config_sections(reader, c);
  apply_nesterov_defaults(root.as_table(), c.spes);
  check_consistency(c);
  if (c.data.tokenizer != "bytes") c.data.tokenizer = resolve(base, c.data.tokenizer);
  return c;
}

toml::value parse_toml(std::istream& is, const std::string& name) {
  try {
    return toml::parse(is, name);
  } catch (const toml::syntax_error& e) {
    // toml11's first line, without its "[error] toml::parse_key: " prefix (the
    // parser's function names mean nothing to a user).
    std::string first = e.what();
    first = first.substr(0, first.find('\n'));
    if (first.starts_with("[error] ")) first.erase(0, 8);
    if (const auto colon = first.find(": "); first.starts_with("toml::") && colon != std::string::npos)
      first.erase(0, colon + 2);
    const auto line = e.location().line();
    throw ConfigError(name + (line > 0 ? ":" + std::to_string(line) : "") + ": TOML syntax error: " + first);
  }
}

}  // namespace

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw ConfigError(path + ": is a folder, not a TOML config file");
  std::ifstream is(path, std::ios::binary);
  if (!is) throw ConfigError(path + ": cannot open config file");
  std::filesystem::path base = std::filesystem::absolute(path).parent_path();
  return build_config(parse_toml(is, path), path, base, overrides);
}

Config parse_config_text(const std::string& text, const std::string& name,
                         const std::vector<std::string>& overrides) {
  std::istringstream is(text);
  return build_config(parse_toml(is, name), name, std::filesystem::current_path(), overrides);
}

namespace {

// TOML spellings of values (the writer); a double keeps all its bits.
std::string toml_value(double x) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  std::string s = buf;
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // stay a TOML float
  return s;
}
std::string toml_value(int64_t x) { return std::to_string(x); }
std::string toml_value(uint64_t x) { return std::to_string(x); }
std::string toml_value(bool x) { return x ? "true" : "false"; }
std::string toml_value(const std::vector<int64_t>& xs) {
  std::string out = "[";
  for (size_t i = 0; i < xs.size(); ++i) out += (i ? ", " : "") + std::to_string(xs[i]);
  return out + "]";
}
std::string toml_value(const std::string& x) {
  std::string out = "\"";
  for (char ch : x) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "\"";
}

// The key-list visitor that writes a Config as TOML, every key with its value.
class Writer {
 public:
  template <class Body>
  void section(const char* name, Body body) {
    os_ << (os_.tellp() > 0 ? "\n[" : "[") << name << "]\n";
    body();
  }
  void integer(const char* key, int64_t x, int64_t, int64_t, const char*) { put(key, toml_value(x)); }
  void unsigned_integer(const char* key, uint64_t x, const char*) { put(key, toml_value(x)); }
  void real(const char* key, double x, Interval, const char*) { put(key, toml_value(x)); }
  void integer_list(const char* key, const std::vector<int64_t>& xs, int64_t, int64_t, const char*) {
    put(key, toml_value(xs));
  }
  void boolean(const char* key, bool x, const char*) { put(key, toml_value(x)); }
  void string(const char* key, const std::string& x, const char*) { put(key, toml_value(x)); }
  void path(const char* key, const std::string& x, const char*) { put(key, toml_value(x)); }
  template <class E, size_t N>
  void choice(const char* key, E x, const EnumName<E> (&names)[N], const char*) {
    put(key, toml_value(std::string(name_of(names, x))));
  }
  std::string str() const { return os_.str(); }

 private:
  void put(const char* key, const std::string& value) { os_ << key << " = " << value << "\n"; }
  std::ostringstream os_;
};

// The key-list visitor that prints the markdown reference: one row per key with its
// default (the value the key list's members start with), what it allows and its doc.
class ReferenceTable {
 public:
  ReferenceTable() { os_ << "| key | default | allowed | meaning |\n| --- | --- | --- | --- |\n"; }
  template <class Body>
  void section(const char* name, Body body) {
    os_ << "| **[" << name << "]** | | | |\n";
    body();
  }
  void integer(const char* key, int64_t x, int64_t lo, int64_t hi, const char* doc) {
    row(key, toml_value(x), allowed_integer(lo, hi), doc);
  }
  void unsigned_integer(const char* key, uint64_t x, const char* doc) {
    row(key, toml_value(x), allowed_integer(0, kMaxInt), doc);
  }
  void real(const char* key, double x, Interval r, const char* doc) { row(key, num(x), allowed_real(r), doc); }
  void integer_list(const char* key, const std::vector<int64_t>& xs, int64_t lo, int64_t hi, const char* doc) {
    row(key, toml_value(xs), allowed_integer_list(lo, hi), doc);
  }
  void boolean(const char* key, bool x, const char* doc) { row(key, toml_value(x), kAllowedBoolean, doc); }
  void string(const char* key, const std::string& x, const char* doc) {
    row(key, toml_value(x), kAllowedString, doc);
  }
  void path(const char* key, const std::string& x, const char* doc) {
    row(key, toml_value(x), "a path", doc);
  }
  template <class E, size_t N>
  void choice(const char* key, E x, const EnumName<E> (&names)[N], const char* doc) {
    row(key, toml_value(std::string(name_of(names, x))), allowed_choice(names), doc);
  }
  std::string str() const { return os_.str(); }

 private:
  void row(const char* key, const std::string& value, const std::string& allowed, const char* doc) {
    os_ << "| `" << key << "` | " << value << " | " << allowed << " | " << doc << " |\n";
  }
  std::ostringstream os_;
};

}  // namespace

std::string config_to_toml(const Config& c) {
  Writer w;
  config_keys::config_sections(w, c);
  return w.str();
}

std::string config_reference_markdown() {
  ReferenceTable t;
  const Config defaults;
  config_keys::config_sections(t, defaults);
  return t.str();
}

void check_tokenizer(const Config& c) {
  if (c.data.tokenizer.empty()) return;
  std::unique_ptr<Tokenizer> tok;
  try {
    tok = open_tokenizer(c.data.tokenizer);
  } catch (const DataError& e) {
    throw ConfigError(c.path + ": [data] tokenizer: " + e.what());
  }
  const int64_t n = tok->vocab_size();
  if (c.model.vocab_size < n) {
    throw ConfigError(c.path + ": [model] vocab_size = " + std::to_string(c.model.vocab_size) +
                      " is smaller than the vocabulary of [data] tokenizer " + tok->name() + " (" + std::to_string(n) +
                      " tokens); set vocab_size >= " + std::to_string(n));
  }
  if (c.data.token_dtype == TokenDtype::kUint16 && n > 65536) {
    throw ConfigError(c.path + ": [data] token_dtype = \"uint16\" cannot hold the ids of [data] tokenizer " +
                      tok->name() + " (" + std::to_string(n) + " tokens); use \"uint32\"");
  }
}

}  // namespace spes
