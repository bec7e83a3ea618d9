// safetensors read/write (round trips, BF16 rounding, malformed files) and the
// HF export: export -> import gives the same config and bitwise the same params.
#include <doctest/doctest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "engine/base/error.hpp"
#include "model/hf_export.hpp"
#include "model/layout.hpp"
#include "model/safetensors.hpp"

#include "test_util.hpp"

namespace fs = std::filesystem;
using namespace spes;

namespace {

using test::TempDir;

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

// A safetensors file from raw parts: header JSON text and `data_bytes` of data.
void write_raw(const fs::path& p, const std::string& json, size_t data_bytes, int64_t declared = -1) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  const uint64_t n = declared >= 0 ? static_cast<uint64_t>(declared) : json.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << json;
  f << std::string(data_bytes, '\0');
}

std::string read_error(const fs::path& p) {
  try {
    read_safetensors(p.string());
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "(no error)";
}

ModelConfig tiny_model() {
  ModelConfig m;
  m.vocab_size = 37;
  m.d_model = 16;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.n_experts = 4;
  m.top_k = 2;
  m.expert_hidden = 24;
  m.seq_len = 64;
  m.rope_theta = 500000.0;
  m.norm_eps = 1e-6;
  m.norm_topk_prob = true;
  m.init_std = 0.015;
  return m;
}

void check_same_config(const ModelConfig& a, const ModelConfig& b) {
  CHECK(a.vocab_size == b.vocab_size);
  CHECK(a.d_model == b.d_model);
  CHECK(a.n_layers == b.n_layers);
  CHECK(a.n_heads == b.n_heads);
  CHECK(a.n_kv_heads == b.n_kv_heads);
  CHECK(a.n_experts == b.n_experts);
  CHECK(a.top_k == b.top_k);
  CHECK(a.expert_hidden == b.expert_hidden);
  CHECK(a.seq_len == b.seq_len);
  CHECK(a.rope_theta == b.rope_theta);
  CHECK(a.qk_norm == b.qk_norm);
  CHECK(a.norm_eps == b.norm_eps);
  CHECK(a.norm_topk_prob == b.norm_topk_prob);
  CHECK(a.tie_embeddings == b.tie_embeddings);
  CHECK(a.init_std == b.init_std);
}

}  // namespace

TEST_CASE("safetensors: F32 round trip with metadata, scalars and empty tensors") {
  TempDir dir;
  const fs::path p = dir.path / "a.safetensors";
  std::vector<SafeTensor> in = {
      {"w", "F32", {3, 5}, random_floats(15, 1)},
      {"scalar", "F32", {}, {2.5f}},
      {"empty", "F32", {0, 4}, {}},
      {"v", "F32", {7}, random_floats(7, 2)},
  };
  in[0].data[3] = -0.0f;
  in[0].data[4] = std::numeric_limits<float>::infinity();
  write_safetensors(p.string(), in, {{"format", "pt"}, {"note", "test"}});

  // Layout: 8-byte length, JSON padded with spaces so data starts 8-aligned.
  std::ifstream f(p, std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  CHECK((8 + n) % 8 == 0);
  std::string json(n, '\0');
  f.read(json.data(), static_cast<std::streamsize>(n));
  CHECK(json.front() == '{');
  CHECK(nlohmann::json::parse(json)["w"]["data_offsets"] == nlohmann::json::array({0, 60}));

  SafeTensorsFile out = read_safetensors(p.string());
  CHECK(out.metadata == std::map<std::string, std::string>{{"format", "pt"}, {"note", "test"}});
  REQUIRE(out.tensors.size() == in.size());
  for (const auto& t : in) {
    CAPTURE(t.name);
    const SafeTensor* o = out.find(t.name);
    REQUIRE(o != nullptr);
    CHECK(o->dtype == "F32");
    CHECK(o->shape == t.shape);
    CHECK(same_bits(o->data, t.data));
  }
  CHECK(fs::file_size(p) == 8 + n + 4 * (15 + 1 + 0 + 7));
  CHECK_FALSE(fs::exists(dir.path / "a.safetensors.tmp"));
}

TEST_CASE("safetensors: BF16 write rounds to nearest even and reads back exactly") {
  CHECK(float_to_bf16(1.0f) == 0x3F80);
  CHECK(float_to_bf16(std::bit_cast<float>(0x3F808000u)) == 0x3F80);  // tie -> even
  CHECK(float_to_bf16(std::bit_cast<float>(0x3F818000u)) == 0x3F82);  // tie -> even (up)
  CHECK(float_to_bf16(std::bit_cast<float>(0x3F808001u)) == 0x3F81);  // above tie
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  CHECK(float_to_bf16(std::numeric_limits<float>::max()) == 0x7F80);  // past bf16 max + half ulp: inf
  TempDir dir;
  const fs::path p = dir.path / "b.safetensors";
  auto vals = random_floats(100, 3);
  std::vector<SafeTensor> in = {{"x", "BF16", {10, 10}, vals}, {"y", "F32", {3}, {1, 2, 3}}};
  write_safetensors(p.string(), in);
  auto out = read_safetensors(p.string());
  // F32 (larger elements) is placed first so every tensor stays aligned.
  CHECK(out.tensors[0].name == "y");
  const SafeTensor* x = out.find("x");
  REQUIRE(x);
  CHECK(x->dtype == "BF16");
  for (size_t i = 0; i < vals.size(); ++i) CHECK(x->data[i] == bf16_to_float(float_to_bf16(vals[i])));
  // Re-writing what was read (already bf16-exact) is lossless.
  write_safetensors(p.string(), out.tensors);
  CHECK(same_bits(read_safetensors(p.string()).find("x")->data, x->data));
}

TEST_CASE("safetensors: malformed files give one clear error naming the file") {
  TempDir dir;
  const fs::path p = dir.path / "bad.safetensors";
  struct Case {
    std::string label, json;
    size_t data_bytes;
    int64_t declared;
    std::string expect;
  };
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::vector<Case> cases = {
      {"header length beyond file", ok, 8, 10000, "runs past the end"},
      {"absurd header length", ok, 8, int64_t(1) << 40, "exceeds the 100 MB limit"},
      {"bad JSON", R"({"a":{"dtype":"F32",)", 8, -1, "not valid JSON"},
      {"not an object", R"([1, 2])", 0, -1, "does not start with '{'"},
      {"offsets out of bounds", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4, -1,
       "out of bounds"},
      {"begin after end", R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8, -1, "out of bounds"},
      {"dtype/shape mismatch", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, -1,
       "is F32 [3] but spans 8 bytes"},
      {"BF16 length mismatch", R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}})", 8, -1,
       "is BF16 [2] but spans 8 bytes"},
      {"unknown dtype", R"({"a":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})", 8, -1, "unknown dtype 'F31'"},
      {"negative dim", R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, -1, "not a size"},
      {"fractional offset", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8.5]}})", 8, -1,
       "not a non-negative integer"},
      {"missing data_offsets", R"({"a":{"dtype":"F32","shape":[2]}})", 8, -1, "data_offsets"},
      {"unknown field", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8, -1,
       "unknown field 'x'"},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12, -1, "overlaps"},
      {"hole",
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
       12, -1, "hole"},
      {"unindexed tail", ok, 12, -1, "belong to no tensor"},
      {"duplicate name",
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       8, -1, "duplicate tensor name 'a'"},
      {"metadata not strings", R"({"__metadata__":{"k":1},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       8, -1, "is not a string"},
      {"tensor not an object", R"({"a":[1,2]})", 0, -1, "is not a JSON object"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.label);
    write_raw(p, c.json, c.data_bytes, c.declared);
    const std::string msg = read_error(p);
    CAPTURE(msg);
    CHECK(msg.find(p.string()) != std::string::npos);
    CHECK(msg.find(c.expect) != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
  }
  SUBCASE("short and empty files") {
    { std::ofstream(p, std::ios::trunc) << "abc"; }
    CHECK(read_error(p).find("truncated") != std::string::npos);
    { std::ofstream(p, std::ios::trunc); }
    CHECK(read_error(p).find("truncated") != std::string::npos);
    CHECK(read_error(dir.path / "missing.safetensors").find("cannot open") != std::string::npos);
  }
  SUBCASE("a dtype that does not convert to fp32") {
    write_raw(p, R"({"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", 8);
    CHECK(read_error(p).find("only F32, BF16 and F16") != std::string::npos);
  }
  SUBCASE("F16 converts") {
    write_raw(p, R"({"a":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}})", 0);
    std::ofstream f(p, std::ios::binary | std::ios::app);
    const uint16_t h[4] = {0x3C00, 0xC000, 0x0001, 0x7C00};  // 1, -2, smallest subnormal, inf
    f.write(reinterpret_cast<const char*>(h), 8);
    f.close();
    auto t = read_safetensors(p.string()).tensors.at(0);
    CHECK(t.data == std::vector<float>{1.0f, -2.0f, std::ldexp(1.0f, -24), std::numeric_limits<float>::infinity()});
  }
}

TEST_CASE("hf export: config.json carries every OlmoeConfig key") {
  ModelConfig m = tiny_model();
  HfExportOptions opts;
  opts.router_aux_loss_coef = 0.02;
  auto j = nlohmann::json::parse(hf_config_json(m, opts));
  CHECK(j["model_type"] == "olmoe");
  CHECK(j["architectures"] == nlohmann::json::array({"OlmoeForCausalLM"}));
  CHECK(j["hidden_size"] == 16);
  CHECK(j["intermediate_size"] == 24);
  CHECK(j["num_hidden_layers"] == 2);
  CHECK(j["num_attention_heads"] == 4);
  CHECK(j["num_key_value_heads"] == 2);
  CHECK(j["num_experts"] == 4);
  CHECK(j["num_experts_per_tok"] == 2);
  CHECK(j["norm_topk_prob"] == true);
  CHECK(j["rms_norm_eps"] == 1e-6);
  CHECK(j["rope_theta"] == 500000.0);
  CHECK(j["vocab_size"] == 37);
  CHECK(j["max_position_embeddings"] == 64);
  CHECK(j["tie_word_embeddings"] == false);
  CHECK(j["router_aux_loss_coef"] == 0.02);
  CHECK(j["hidden_act"] == "silu");
  CHECK(j["attention_bias"] == false);
  CHECK(j["clip_qkv"].is_null());
  CHECK(j["output_router_logits"] == false);
  CHECK(j["torch_dtype"] == "float32");
  CHECK(j["initializer_range"] == 0.015);
  for (const char* k : {"pad_token_id", "bos_token_id", "eos_token_id"}) CHECK(j.contains(k));

  m.qk_norm = false;
  CHECK_THROWS_AS(hf_config_json(m), ConfigError);
}

TEST_CASE("hf export -> import: same config, params bitwise") {
  for (bool tied : {false, true}) {
    CAPTURE(tied);
    TempDir dir;
    ModelConfig m = tiny_model();
    m.tie_embeddings = tied;
    const ParamLayout layout = make_layout(m);
    const std::vector<float> params = random_floats(static_cast<size_t>(layout.total), 7);
    const std::string out = (dir.path / "export").string();
    export_hf(m, layout, params.data(), out);
    CHECK(fs::exists(dir.path / "export" / "config.json"));

    HfModel back = import_hf(out);
    check_same_config(back.config, m);
    CHECK(same_bits(back.params, params));

    // Names, shapes and count in the file are the HF ones.
    SafeTensorsReader r((dir.path / "export" / "model.safetensors").string());
    CHECK(r.entries().size() == layout.tensors.size());
    CHECK((r.find("lm_head.weight") != nullptr) == !tied);
    CHECK(r.find("model.layers.1.mlp.experts.3.down_proj.weight")->shape == std::vector<int64_t>{16, 24});
    CHECK(r.find("model.layers.0.self_attn.k_proj.weight")->shape == std::vector<int64_t>{8, 16});
    CHECK(r.find("model.layers.0.self_attn.k_norm.weight")->shape == std::vector<int64_t>{8});
    CHECK(r.find("model.norm.weight")->shape == std::vector<int64_t>{16});
    CHECK(r.find("model.layers.1.mlp.gate.weight")->shape == std::vector<int64_t>{4, 16});
    CHECK(r.metadata().at("format") == "pt");
  }
}

TEST_CASE("hf import: wrong, missing and extra tensors are refused clearly") {
  TempDir dir;
  const ModelConfig m = tiny_model();
  const ParamLayout layout = make_layout(m);
  const std::vector<float> params = random_floats(static_cast<size_t>(layout.total), 8);
  const fs::path ex = dir.path / "export";
  export_hf(m, layout, params.data(), ex.string());
  const std::string st = (ex / "model.safetensors").string();
  auto tensors = read_safetensors(st).tensors;

  auto import_error = [&]() -> std::string {
    try {
      import_hf(ex.string());
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };

  SUBCASE("extra tensor") {
    auto t = tensors;
    t[0].name = "model.layers.0.mlp.experts.9.up_proj.weight";
    write_safetensors(st, t);
    CHECK(import_error().find("missing tensor") != std::string::npos);
    t = tensors;
    t.push_back({"bogus.weight", "F32", {1}, {0.f}});
    write_safetensors(st, t);
    CHECK(import_error().find("holds " + std::to_string(tensors.size() + 1) + " tensors") != std::string::npos);
  }
  SUBCASE("missing tensor") {
    auto t = tensors;
    t.erase(t.begin() + 3);
    write_safetensors(st, t);
    CHECK(import_error().find(st) != std::string::npos);
  }
  SUBCASE("wrong shape") {
    auto t = tensors;
    for (auto& x : t)
      if (x.name == "model.layers.0.self_attn.q_proj.weight") x.shape = {8, 32};
    write_safetensors(st, t);
    CHECK(import_error().find("q_proj.weight' has shape [8, 32], the model needs [16, 16]") != std::string::npos);
  }
  SUBCASE("BF16 export imports as rounded fp32") {
    HfExportOptions o;
    o.dtype = "BF16";
    export_hf(m, layout, params.data(), ex.string(), o);
    HfModel back = import_hf(ex.string());
    REQUIRE(back.params.size() == params.size());
    bool all = true;
    for (size_t i = 0; i < params.size(); ++i) all = all && back.params[i] == bf16_to_float(float_to_bf16(params[i]));
    CHECK(all);
  }
  SUBCASE("config.json problems") {
    const fs::path cfg = ex / "config.json";
    auto j = nlohmann::json::parse(hf_config_json(m));
    auto with = [&](const char* key, nlohmann::json v) {
      auto k = j;
      k[key] = v;
      std::ofstream(cfg, std::ios::trunc) << k.dump();
      return import_error();
    };
    CHECK(with("model_type", "llama").find("expected \"olmoe\"") != std::string::npos);
    CHECK(with("hidden_size", "16").find("hidden_size: expected an integer") != std::string::npos);
    CHECK(with("clip_qkv", 8.0).find("clip_qkv") != std::string::npos);
    CHECK(with("num_hidden_layers", 3).find("describes") != std::string::npos);
    CHECK(with("num_hidden_layers", int64_t(1) << 40).find("describes") != std::string::npos);
    CHECK(with("num_experts_per_tok", 9).find("exceeds num_experts") != std::string::npos);
    std::ofstream(cfg, std::ios::trunc) << "{ not json";
    CHECK(import_error().find(cfg.string() + ": not valid JSON") != std::string::npos);
    fs::remove(cfg);
    CHECK(import_error().find("config.json: missing") != std::string::npos);
  }
}
