// TOML → Config with every key checked. Errors name the file, the line (where
// toml11 knows it), the key and what was expected, on one line.
#include "engine/config.hpp"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <toml.hpp>

#include "data/tokenizer.hpp"
#include "engine/base/error.hpp"

namespace spes {
namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();

// Where a key's value came from: "file:line" or "--set model.x=1".
struct Origins {
  std::string file;
  std::map<std::string, std::string> set_by;  // "section.key" -> the --set argument

  std::string where(const std::string& section, const std::string& key, const toml::value& v) const {
    auto it = set_by.find(section + "." + key);
    if (it != set_by.end()) return "--set " + it->second;
    const auto line = v.location().line();
    return line > 0 ? file + ":" + std::to_string(line) : file;
  }
};

std::string show(const toml::value& v) {
  std::ostringstream os;
  os << v;
  std::string s = os.str();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

// Reads the keys of one section, checking type and range, and remembers which keys
// were read so that anything left over is reported as unknown.
class SectionReader {
 public:
  SectionReader(const toml::table* table, std::string section, const Origins& origins)
      : table_(table), section_(std::move(section)), origins_(origins) {}

  void integer(const char* key, int64_t& out, int64_t lo, int64_t hi) {
    const toml::value* v = find(key);
    if (!v) return;
    if (!v->is_integer() || v->as_integer() < lo || v->as_integer() > hi)
      fail(key, *v, "an integer in [" + num(lo) + ", " + (hi == kMaxInt ? "inf" : num(hi)) + "]");
    out = v->as_integer();
  }
  void unsigned_integer(const char* key, uint64_t& out) {
    int64_t x = static_cast<int64_t>(out);
    integer(key, x, 0, kMaxInt);
    out = static_cast<uint64_t>(x);
  }
  // lo_open / hi_open make the bound exclusive.
  void real(const char* key, double& out, double lo, double hi, bool lo_open = false, bool hi_open = false) {
    const toml::value* v = find(key);
    if (!v) return;
    double x = 0;
    bool ok = v->is_floating() || v->is_integer();
    if (ok) x = v->is_floating() ? v->as_floating() : double(v->as_integer());
    ok = ok && std::isfinite(x) && (lo_open ? x > lo : x >= lo) && (hi_open ? x < hi : x <= hi);
    if (!ok)
      fail(key, *v, std::string("a number in ") + (lo_open ? "(" : "[") + num(lo) + ", " +
                        (std::isinf(hi) ? "inf" : num(hi)) + (hi_open || std::isinf(hi) ? ")" : "]"));
    out = x;
  }
  void integer_list(const char* key, std::vector<int64_t>& out, int64_t lo, int64_t hi) {
    const toml::value* v = find(key);
    if (!v) return;
    std::vector<int64_t> xs;
    bool ok = v->is_array();
    if (ok)
      for (const toml::value& x : v->as_array()) {
        ok = ok && x.is_integer() && x.as_integer() >= lo && x.as_integer() <= hi;
        if (ok) xs.push_back(x.as_integer());
      }
    if (!ok) fail(key, *v, "a list of integers in [" + num(lo) + ", " + num(hi) + "]");
    out = xs;
  }
  void boolean(const char* key, bool& out) {
    const toml::value* v = find(key);
    if (!v) return;
    if (!v->is_boolean()) fail(key, *v, "true or false");
    out = v->as_boolean();
  }
  void string(const char* key, std::string& out, const std::vector<std::string>& allowed = {}) {
    const toml::value* v = find(key);
    if (!v) return;
    bool ok = v->is_string();
    if (ok && !allowed.empty()) {
      ok = false;
      for (const auto& a : allowed) ok = ok || a == v->as_string().str;
    }
    if (!ok) {
      std::string want = "a string";
      if (!allowed.empty()) {
        want = "one of";
        for (const auto& a : allowed) want += " \"" + a + "\"";
      }
      fail(key, *v, want);
    }
    out = v->as_string().str;
  }

  // Every key present but never read is a typo or a key of another version.
  void reject_unknown() const {
    if (!table_) return;
    for (const auto& [key, v] : *table_) {
      if (read_.count(key)) continue;
      std::string known;
      for (const auto& k : read_order_) known += (known.empty() ? "" : ", ") + k;
      throw ConfigError(origins_.where(section_, key, v) + ": unknown key [" + section_ + "] " + key +
                        " (known keys: " + known + ")");
    }
  }

 private:
  const toml::value* find(const char* key) {
    read_.insert(key);
    read_order_.push_back(key);
    if (!table_) return nullptr;
    auto it = table_->find(key);
    return it == table_->end() ? nullptr : &it->second;
  }
  [[noreturn]] void fail(const char* key, const toml::value& v, const std::string& expected) const {
    throw ConfigError(origins_.where(section_, key, v) + ": [" + section_ + "] " + key + " = " + show(v) +
                      ": expected " + expected);
  }
  static std::string num(double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", x);
    return buf;
  }
  static std::string num(int64_t x) { return std::to_string(x); }

  const toml::table* table_;
  std::string section_;
  const Origins& origins_;
  std::set<std::string> read_;
  std::vector<std::string> read_order_;
};

const std::vector<std::string> kSections = {"model", "train", "optim", "data", "spes", "checkpoint"};

void read_model(SectionReader r, ModelConfig& m) {
  r.integer("vocab_size", m.vocab_size, 2, int64_t(1) << 31);
  r.integer("d_model", m.d_model, 2, 65536);
  r.integer("n_layers", m.n_layers, 1, 1024);
  r.integer("n_heads", m.n_heads, 1, 1024);
  r.integer("n_kv_heads", m.n_kv_heads, 1, 1024);
  r.integer("n_experts", m.n_experts, 1, 4096);
  r.integer("top_k", m.top_k, 1, 4096);
  r.integer("expert_hidden", m.expert_hidden, 1, 1 << 20);
  r.integer("seq_len", m.seq_len, 1, 1 << 20);
  r.real("rope_theta", m.rope_theta, 0, INFINITY, true);
  r.boolean("qk_norm", m.qk_norm);
  r.real("norm_eps", m.norm_eps, 0, 1, true);
  r.boolean("norm_topk_prob", m.norm_topk_prob);
  r.boolean("tie_embeddings", m.tie_embeddings);
  r.real("init_std", m.init_std, 0, 1, true);
  r.reject_unknown();
}

void read_train(SectionReader r, TrainConfig& t) {
  r.string("device", t.device, {"auto", "cuda", "cpu"});
  r.unsigned_integer("seed", t.seed);
  r.integer("steps", t.steps, 1, kMaxInt);
  r.integer("micro_batch", t.micro_batch, 1, 1 << 20);
  r.integer("global_batch", t.global_batch, 1, 1 << 24);
  r.integer("threads", t.threads, 0, 4096);
  r.integer_list("gpus", t.gpus, 0, 1023);
  r.integer("eval_every", t.eval_every, 0, kMaxInt);
  r.integer("eval_batches", t.eval_batches, 0, 1 << 20);
  r.integer("max_steps_this_run", t.max_steps_this_run, 0, kMaxInt);
  r.string("init", t.init);
  r.real("lb_coef", t.loss.lb_coef, 0, INFINITY);
  r.real("router_z_coef", t.loss.router_z_coef, 0, INFINITY);
  r.real("lm_z_coef", t.loss.lm_z_coef, 0, INFINITY);
  r.boolean("decayed_aux_loss", t.loss.decayed_aux_loss);
  r.reject_unknown();
}

void read_optim(SectionReader r, OptimConfig& o) {
  r.real("lr", o.lr, 0, 10, true);
  r.real("beta1", o.beta1, 0, 1, false, true);
  r.real("beta2", o.beta2, 0, 1, false, true);
  r.real("eps", o.eps, 0, 1, true);
  r.real("weight_decay", o.weight_decay, 0, 10);
  r.boolean("decay_norms_and_embeddings", o.decay_norms_and_embeddings);
  r.integer("warmup_steps", o.warmup_steps, 0, kMaxInt);
  r.integer("decay_steps", o.decay_steps, 1, kMaxInt);
  r.real("lr_floor", o.lr_floor, 0, 1);
  r.real("grad_clip", o.grad_clip, 0, INFINITY);
  r.reject_unknown();
}

void read_data(SectionReader r, DataConfig& d) {
  r.string("train", d.train);
  r.string("validation", d.validation);
  r.real("val_fraction", d.val_fraction, 0, 0.5);
  r.string("token_dtype", d.token_dtype, {"uint16", "uint32"});
  r.string("tokenizer", d.tokenizer);
  r.reject_unknown();
}

void read_spes(SectionReader r, SpesConfig& s) {
  r.integer("node_id", s.node_id, 0, 1 << 16);
  r.integer("n_nodes", s.n_nodes, 1, 1 << 16);
  r.string("ownership", s.ownership, {"partitioned", "all"});
  r.integer("experts_per_node", s.experts_per_node, 0, 4096);
  r.integer("sync_steps", s.sync_steps, 0, kMaxInt);
  r.string("run_id", s.run_id);
  r.string("coordinator", s.coordinator);
  r.string("codec", s.codec, {"fp32", "bf16", "int8", "sparse"});
  r.boolean("overlap", s.overlap);
  r.string("secret_file", s.secret_file);
  r.boolean("allow_insecure", s.allow_insecure);
  r.string("tls_ca", s.tls_ca);
  r.string("tls_cert", s.tls_cert);
  r.string("tls_key", s.tls_key);
  r.real("round_timeout_s", s.round_timeout_s, 0, INFINITY, true);
  r.integer("min_nodes", s.min_nodes, 1, 1 << 16);
  r.string("state_dir", s.state_dir);
  r.real("merge_alpha", s.merge_alpha, 0, 1);
  r.integer("merge_topk", s.merge_topk, 1, 4096);
  r.integer("merge_interval", s.merge_interval, 0, kMaxInt);
  r.integer("merge_decay_steps", s.merge_decay_steps, 0, kMaxInt);
  r.string("outer_optimizer", s.outer_optimizer, {"average", "nesterov"});
  if (s.outer_optimizer == "nesterov") s.outer_lr = 0.7, s.outer_momentum = 0.9;  // DiLoCo's, unless given
  r.real("outer_lr", s.outer_lr, 0, 10, true);
  r.real("outer_momentum", s.outer_momentum, 0, 1, false, true);
  r.reject_unknown();
}

void read_checkpoint(SectionReader r, CheckpointConfig& c) {
  r.string("dir", c.dir);
  r.integer("every", c.every, 0, kMaxInt);
  r.integer("keep", c.keep, 1, 1 << 20);
  r.reject_unknown();
}

// Checks that involve several keys; each names every key involved.
void check_consistency(const Config& c) {
  auto fail = [&](const std::string& msg) { throw ConfigError(c.path + ": " + msg); };
  if (c.spes.tls_ca.empty() && (!c.spes.tls_cert.empty() || !c.spes.tls_key.empty()))
    fail("[spes] tls_cert / tls_key need tls_ca (the run's CA certificate, from `spes-engine certs`)");
  const ModelConfig& m = c.model;
  if (m.d_model % m.n_heads != 0)
    fail("[model] d_model = " + std::to_string(m.d_model) + " must be a multiple of n_heads = " +
         std::to_string(m.n_heads));
  if (m.head_dim() % 2 != 0)
    fail("[model] d_model / n_heads = " + std::to_string(m.head_dim()) + " must be even (RoPE rotates pairs)");
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
  if (s.ownership == "partitioned") {
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
  if (s.min_nodes > s.n_nodes)
    fail("[spes] min_nodes = " + std::to_string(s.min_nodes) + " exceeds n_nodes = " + std::to_string(s.n_nodes));
  if (s.merge_alpha > 0 && (s.merge_interval == 0 || s.merge_decay_steps == 0))
    fail("[spes] merge_alpha > 0 needs merge_interval > 0 and merge_decay_steps > 0");
  if (s.outer_optimizer == "average" && s.outer_momentum != 0) {
    char v[32];
    std::snprintf(v, sizeof v, "%g", s.outer_momentum);
    fail("[spes] outer_momentum = " + std::string(v) + " needs outer_optimizer = \"nesterov\" (average has none)");
  }
  if (c.data.train.empty()) fail("[data] train: a manifest path is required");
}

std::string resolve(const std::filesystem::path& base, const std::string& p) {
  if (p.empty() || std::filesystem::path(p).is_absolute()) return p;
  return (base / p).lexically_normal().string();
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
  if (it == table.end()) it = table.emplace(section, toml::table{}).first;
  if (!it->second.is_table()) throw ConfigError("--set " + arg + ": [" + section + "] is not a section");
  it->second.as_table()[key] = v;
  origins.set_by[section + "." + key] = arg;
}

Config build_config(toml::value root, const std::string& name, const std::filesystem::path& base,
                    const std::vector<std::string>& overrides) {
  Origins origins{name, {}};
  for (const auto& o : overrides) apply_override(root, o, origins);
  if (!root.is_table()) root = toml::table{};
  for (const auto& [section, v] : root.as_table()) {
    bool known = false;
    for (const auto& s : kSections) known = known || s == section;
    const auto line = v.location().line();
    const std::string where = line > 0 ? name + ":" + std::to_string(line) : name;
    if (!known)
      throw ConfigError(where + ": unknown section [" + section +
                        "] (known: [model] [train] [optim] [data] [spes] [checkpoint])");
    if (!v.is_table()) throw ConfigError(where + ": " + section + " must be a section [" + section + "]");
  }
  auto section = [&](const char* s) -> const toml::table* {
    auto it = root.as_table().find(s);
    return it == root.as_table().end() ? nullptr : &it->second.as_table();
  };
  Config c;
  c.path = name;
  read_model(SectionReader(section("model"), "model", origins), c.model);
  read_train(SectionReader(section("train"), "train", origins), c.train);
  read_optim(SectionReader(section("optim"), "optim", origins), c.optim);
  read_data(SectionReader(section("data"), "data", origins), c.data);
  read_spes(SectionReader(section("spes"), "spes", origins), c.spes);
  read_checkpoint(SectionReader(section("checkpoint"), "checkpoint", origins), c.checkpoint);
  check_consistency(c);
  c.data.train = resolve(base, c.data.train);
  c.data.validation = resolve(base, c.data.validation);
  if (c.data.tokenizer != "bytes") c.data.tokenizer = resolve(base, c.data.tokenizer);
  c.checkpoint.dir = resolve(base, c.checkpoint.dir);
  c.train.init = resolve(base, c.train.init);
  c.spes.secret_file = resolve(base, c.spes.secret_file);
  c.spes.tls_ca = resolve(base, c.spes.tls_ca);
  c.spes.tls_cert = resolve(base, c.spes.tls_cert);
  c.spes.tls_key = resolve(base, c.spes.tls_key);
  c.spes.state_dir = resolve(base, c.spes.state_dir);
  return c;
}

toml::value parse_toml(std::istream& is, const std::string& name) {
  try {
    return toml::parse(is, name);
  } catch (const toml::syntax_error& e) {
    std::string first = e.what();
    first = first.substr(0, first.find('\n'));
    const auto line = e.location().line();
    throw ConfigError(name + (line > 0 ? ":" + std::to_string(line) : "") + ": TOML syntax error: " + first);
  }
}

}  // namespace

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
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
std::string fmt(double x) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  std::string s = buf;
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // stay a TOML float
  return s;
}
std::string fmt(int64_t x) { return std::to_string(x); }
std::string fmt(uint64_t x) { return std::to_string(x); }
std::string fmt(bool x) { return x ? "true" : "false"; }
std::string fmt(const std::vector<int64_t>& xs) {
  std::string out = "[";
  for (size_t i = 0; i < xs.size(); ++i) out += (i ? ", " : "") + std::to_string(xs[i]);
  return out + "]";
}
std::string fmt(const std::string& x) {
  std::string out = "\"";
  for (char ch : x) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "\"";
}
}  // namespace

std::string config_to_toml(const Config& c) {
  std::ostringstream os;
  auto kv = [&](const char* k, const auto& v) { os << k << " = " << fmt(v) << "\n"; };
  const ModelConfig& m = c.model;
  os << "[model]\n";
  kv("vocab_size", m.vocab_size); kv("d_model", m.d_model); kv("n_layers", m.n_layers);
  kv("n_heads", m.n_heads); kv("n_kv_heads", m.n_kv_heads); kv("n_experts", m.n_experts);
  kv("top_k", m.top_k); kv("expert_hidden", m.expert_hidden); kv("seq_len", m.seq_len);
  kv("rope_theta", m.rope_theta); kv("qk_norm", m.qk_norm); kv("norm_eps", m.norm_eps);
  kv("norm_topk_prob", m.norm_topk_prob); kv("tie_embeddings", m.tie_embeddings); kv("init_std", m.init_std);
  const TrainConfig& t = c.train;
  os << "\n[train]\n";
  kv("device", t.device); kv("seed", t.seed); kv("steps", t.steps); kv("micro_batch", t.micro_batch);
  kv("global_batch", t.global_batch); kv("threads", t.threads); kv("gpus", t.gpus); kv("eval_every", t.eval_every);
  kv("eval_batches", t.eval_batches); kv("max_steps_this_run", t.max_steps_this_run);
  kv("init", t.init);
  kv("lb_coef", t.loss.lb_coef); kv("router_z_coef", t.loss.router_z_coef); kv("lm_z_coef", t.loss.lm_z_coef);
  kv("decayed_aux_loss", t.loss.decayed_aux_loss);
  const OptimConfig& o = c.optim;
  os << "\n[optim]\n";
  kv("lr", o.lr); kv("beta1", o.beta1); kv("beta2", o.beta2); kv("eps", o.eps);
  kv("weight_decay", o.weight_decay); kv("decay_norms_and_embeddings", o.decay_norms_and_embeddings);
  kv("warmup_steps", o.warmup_steps); kv("decay_steps", o.decay_steps); kv("lr_floor", o.lr_floor);
  kv("grad_clip", o.grad_clip);
  const DataConfig& d = c.data;
  os << "\n[data]\n";
  kv("train", d.train); kv("validation", d.validation); kv("val_fraction", d.val_fraction);
  kv("token_dtype", d.token_dtype); kv("tokenizer", d.tokenizer);
  const SpesConfig& s = c.spes;
  os << "\n[spes]\n";
  kv("node_id", s.node_id); kv("n_nodes", s.n_nodes); kv("ownership", s.ownership);
  kv("experts_per_node", s.experts_per_node); kv("sync_steps", s.sync_steps); kv("run_id", s.run_id);
  kv("coordinator", s.coordinator); kv("codec", s.codec); kv("overlap", s.overlap); kv("secret_file", s.secret_file);
  kv("allow_insecure", s.allow_insecure); kv("tls_ca", s.tls_ca); kv("tls_cert", s.tls_cert);
  kv("tls_key", s.tls_key); kv("round_timeout_s", s.round_timeout_s);
  kv("min_nodes", s.min_nodes); kv("state_dir", s.state_dir);
  kv("merge_alpha", s.merge_alpha); kv("merge_topk", s.merge_topk); kv("merge_interval", s.merge_interval);
  kv("merge_decay_steps", s.merge_decay_steps); kv("outer_optimizer", s.outer_optimizer);
  kv("outer_lr", s.outer_lr); kv("outer_momentum", s.outer_momentum);
  const CheckpointConfig& k = c.checkpoint;
  os << "\n[checkpoint]\n";
  kv("dir", k.dir); kv("every", k.every); kv("keep", k.keep);
  return os.str();
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
  if (c.data.token_dtype == "uint16" && n > 65536) {
    throw ConfigError(c.path + ": [data] token_dtype = \"uint16\" cannot hold the ids of [data] tokenizer " +
                      tok->name() + " (" + std::to_string(n) + " tokens); use \"uint32\"");
  }
}

}  // namespace spes
