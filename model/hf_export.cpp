#include "model/hf_export.hpp"

#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/base/atomic_file.hpp"
#include "engine/base/error.hpp"

namespace spes {

namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

std::vector<int64_t> hf_shape(const ParamTensor& t) {
  // Our norms are [1, C] rows of the flat buffer; HF's OlmoeRMSNorm weight is 1-D.
  if (t.is_norm()) return {t.cols};
  return {t.rows, t.cols};
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw CheckpointError(path + ": cannot open");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

ojson token_id(const std::optional<int64_t>& id) { return id ? ojson(*id) : ojson(nullptr); }

}  // namespace

std::string hf_config_json(const ModelConfig& m, const HfExportOptions& opts) {
  if (!m.qk_norm)
    throw ConfigError("export-hf: HF OLMoE always applies QK-norm; a model trained with qk_norm = false cannot be "
                      "exported as OlmoeForCausalLM");
  if (opts.dtype != "F32" && opts.dtype != "BF16")
    throw ConfigError("export-hf: dtype must be F32 or BF16, not '" + opts.dtype + "'");
  const char* torch_dtype = opts.dtype == "F32" ? "float32" : "bfloat16";
  ojson j;
  j["architectures"] = {"OlmoeForCausalLM"};
  j["model_type"] = "olmoe";
  j["vocab_size"] = m.vocab_size;
  j["hidden_size"] = m.d_model;
  j["intermediate_size"] = m.expert_hidden;
  j["num_hidden_layers"] = m.n_layers;
  j["num_attention_heads"] = m.n_heads;
  j["num_key_value_heads"] = m.n_kv_heads;
  j["num_experts"] = m.n_experts;
  j["num_experts_per_tok"] = m.top_k;
  j["norm_topk_prob"] = m.norm_topk_prob;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = m.seq_len;
  j["rms_norm_eps"] = m.norm_eps;
  j["rope_theta"] = m.rope_theta;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["clip_qkv"] = nullptr;
  j["tie_word_embeddings"] = m.tie_embeddings;
  j["initializer_range"] = m.init_std;
  j["router_aux_loss_coef"] = opts.router_aux_loss_coef;
  j["output_router_logits"] = false;
  j["use_cache"] = true;
  j["pad_token_id"] = token_id(opts.pad_token_id);
  j["bos_token_id"] = token_id(opts.bos_token_id);
  j["eos_token_id"] = token_id(opts.eos_token_id);
  j["torch_dtype"] = torch_dtype;  // transformers 4.x
  j["dtype"] = torch_dtype;        // transformers 5.x
  return j.dump(2) + "\n";
}

ModelConfig model_config_from_hf_json(const std::string& text, const std::string& where) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    std::string why = e.what();
    if (auto p = why.find("] "); p != std::string::npos) why = why.substr(p + 2);
    throw ConfigError(where + ": not valid JSON: " + why);
  }
  if (!j.is_object()) throw ConfigError(where + ": not a JSON object");
  auto bad = [&](const std::string& key, const std::string& what) -> ConfigError {
    return ConfigError(where + ": " + key + ": " + what);
  };
  if (!j.contains("model_type") || j["model_type"] != "olmoe")
    throw bad("model_type", "expected \"olmoe\"" +
                                (j.contains("model_type") ? ", found " + j["model_type"].dump() : std::string()));
  auto get_int = [&](const char* key, std::optional<int64_t> def, int64_t min) -> int64_t {
    if (!j.contains(key) || j[key].is_null()) {
      if (def) return *def;
      throw bad(key, "missing");
    }
    if (!j[key].is_number_integer()) throw bad(key, "expected an integer, found " + j[key].dump());
    const int64_t v = j[key].get<int64_t>();
    if (v < min) throw bad(key, "expected an integer >= " + std::to_string(min) + ", found " + std::to_string(v));
    return v;
  };
  auto get_num = [&](const char* key, double def) -> double {
    if (!j.contains(key)) return def;
    if (!j[key].is_number()) throw bad(key, "expected a number, found " + j[key].dump());
    return j[key].get<double>();
  };
  auto get_bool = [&](const char* key, bool def) -> bool {
    if (!j.contains(key)) return def;
    if (!j[key].is_boolean()) throw bad(key, "expected true or false, found " + j[key].dump());
    return j[key].get<bool>();
  };

  ModelConfig m;
  m.vocab_size = get_int("vocab_size", std::nullopt, 1);
  m.d_model = get_int("hidden_size", std::nullopt, 1);
  m.expert_hidden = get_int("intermediate_size", std::nullopt, 1);
  m.n_layers = get_int("num_hidden_layers", std::nullopt, 1);
  m.n_heads = get_int("num_attention_heads", std::nullopt, 1);
  m.n_kv_heads = get_int("num_key_value_heads", m.n_heads, 1);
  m.n_experts = get_int("num_experts", std::nullopt, 1);
  m.top_k = get_int("num_experts_per_tok", std::nullopt, 1);
  m.seq_len = get_int("max_position_embeddings", 4096, 1);
  m.norm_topk_prob = get_bool("norm_topk_prob", false);
  m.tie_embeddings = get_bool("tie_word_embeddings", false);
  m.norm_eps = get_num("rms_norm_eps", 1e-5);
  m.init_std = get_num("initializer_range", 0.02);
  m.qk_norm = true;
  m.rope_theta = get_num("rope_theta", 10000.0);
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {  // transformers 5.x spelling
    const auto& rp = j["rope_parameters"];
    if (rp.contains("rope_type") && rp["rope_type"] != "default")
      throw bad("rope_parameters.rope_type", "only \"default\" RoPE is supported, found " + rp["rope_type"].dump());
    if (rp.contains("rope_theta")) {
      if (!rp["rope_theta"].is_number()) throw bad("rope_parameters.rope_theta", "expected a number");
      m.rope_theta = rp["rope_theta"].get<double>();
    }
  }
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
    throw bad("rope_scaling", "RoPE scaling is not supported, found " + j["rope_scaling"].dump());
  if (j.contains("clip_qkv") && !j["clip_qkv"].is_null())
    throw bad("clip_qkv", "QKV clipping is not supported, found " + j["clip_qkv"].dump());
  if (get_bool("attention_bias", false)) throw bad("attention_bias", "attention biases are not supported");
  if (j.contains("hidden_act") && j["hidden_act"] != "silu")
    throw bad("hidden_act", "only \"silu\" (SwiGLU experts) is supported, found " + j["hidden_act"].dump());
  if (m.d_model % m.n_heads != 0)
    throw bad("hidden_size", std::to_string(m.d_model) + " is not a multiple of num_attention_heads " +
                                 std::to_string(m.n_heads));
  if (m.n_heads % m.n_kv_heads != 0)
    throw bad("num_key_value_heads", std::to_string(m.n_kv_heads) + " does not divide num_attention_heads " +
                                         std::to_string(m.n_heads));
  if (m.top_k > m.n_experts)
    throw bad("num_experts_per_tok", std::to_string(m.top_k) + " exceeds num_experts " + std::to_string(m.n_experts));
  if (!(m.norm_eps > 0)) throw bad("rms_norm_eps", "expected a positive number");
  if (!(m.rope_theta > 0)) throw bad("rope_theta", "expected a positive number");
  return m;
}

std::vector<SafeTensorView> hf_tensor_views(const ParamLayout& layout, const float* params, const std::string& dtype) {
  std::vector<SafeTensorView> views;
  views.reserve(layout.tensors.size());
  for (const ParamTensor& t : layout.tensors) views.push_back({t.name, dtype, hf_shape(t), params + t.offset});
  return views;
}

void write_hf_safetensors(const std::string& path, const ParamLayout& layout, const float* params,
                          const std::string& dtype) {
  const auto views = hf_tensor_views(layout, params, dtype);
  write_safetensors(path, std::span<const SafeTensorView>(views), {{"format", "pt"}});
}

std::vector<float> read_hf_safetensors(const std::string& path, const ParamLayout& layout) {
  SafeTensorsReader r(path);
  auto fail = [&](const std::string& what) -> CheckpointError {
    return CheckpointError("safetensors " + path + ": " + what);
  };
  // Names and shapes first, so a mismatched file allocates nothing.
  for (const ParamTensor& t : layout.tensors) {
    const auto* e = r.find(t.name);
    if (!e) throw fail("missing tensor '" + t.name + "'");
    const auto want = hf_shape(t);
    if (e->shape != want)
      throw fail("tensor '" + t.name + "' has shape " + shape_str(e->shape) + ", the model needs " + shape_str(want));
    if (e->dtype != "F32" && e->dtype != "BF16" && e->dtype != "F16")
      throw fail("tensor '" + t.name + "' has dtype " + e->dtype + "; F32, BF16 or F16 expected");
  }
  if (r.entries().size() != layout.tensors.size()) {
    for (const auto& e : r.entries())
      if (!layout.find(e.name)) throw fail("unexpected tensor '" + e.name + "' (not in the model's layout)");
  }
  std::vector<float> params(static_cast<size_t>(layout.total));
  for (const ParamTensor& t : layout.tensors) r.read(*r.find(t.name), params.data() + t.offset);
  return params;
}

void export_hf(const ModelConfig& m, const ParamLayout& layout, const float* params, const std::string& out_dir,
               const HfExportOptions& opts) {
  const std::string config = hf_config_json(m, opts);  // refuses what OLMoE cannot express, before writing
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) throw CheckpointError(out_dir + ": cannot create folder: " + ec.message());
  // Weights first, config last: a folder whose config.json is new has new weights.
  write_hf_safetensors((fs::path(out_dir) / "model.safetensors").string(), layout, params, opts.dtype);
  write_file_atomic((fs::path(out_dir) / "config.json").string(), config);
}

HfModel import_hf(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  if (!fs::is_directory(d, ec)) throw CheckpointError(dir + ": not a folder (expected an HF export)");
  const std::string config_path = (d / "config.json").string();
  const std::string weights_path = (d / "model.safetensors").string();
  if (!fs::exists(config_path, ec)) throw CheckpointError(config_path + ": missing");
  if (!fs::exists(weights_path, ec)) {
    if (fs::exists(d / "model.safetensors.index.json", ec))
      throw CheckpointError(weights_path + ": missing (sharded safetensors are not supported)");
    throw CheckpointError(weights_path + ": missing");
  }
  HfModel out;
  out.config = model_config_from_hf_json(read_text(config_path), config_path);
  // A config describing a huge model must not build a huge layout: compare the
  // tensor count it implies with the file's first.
  {
    SafeTensorsReader r(weights_path);
    const ModelConfig& m = out.config;
    const long double want = 2.0L + (m.tie_embeddings ? 0 : 1) + (long double)m.n_layers * (9 + 3.0L * m.n_experts);
    if (want != (long double)r.entries().size())
      throw CheckpointError("safetensors " + weights_path + ": holds " + std::to_string(r.entries().size()) +
                            " tensors but " + config_path + " describes " +
                            std::to_string(static_cast<unsigned long long>(want)));
  }
  const ParamLayout layout = make_layout(out.config);
  out.params = read_hf_safetensors(weights_path, layout);
  return out;
}

}  // namespace spes
