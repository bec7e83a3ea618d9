#include "model/hf_config.hpp"

#include <nlohmann/json.hpp>

#include "engine/base/error.hpp"

namespace spes {

namespace {

using ojson = nlohmann::ordered_json;

struct ArchInfo {
  HfArch arch;
  const char* class_name;
  const char* model_type;
  bool dense;
};
constexpr ArchInfo kArchs[] = {{HfArch::olmoe, "OlmoeForCausalLM", "olmoe", false},
                               {HfArch::qwen3, "Qwen3ForCausalLM", "qwen3", true},
                               {HfArch::qwen3_moe, "Qwen3MoeForCausalLM", "qwen3_moe", false},
                               {HfArch::olmo2, "Olmo2ForCausalLM", "olmo2", true}};

const ArchInfo& info(HfArch a) {
  for (const ArchInfo& i : kArchs)
    if (i.arch == a) return i;
  return kArchs[0];
}

ojson token_id(const std::optional<int64_t>& id) { return id ? ojson(*id) : ojson(nullptr); }

}  // namespace

const char* hf_arch_class(HfArch a) { return info(a).class_name; }
bool hf_arch_dense(HfArch a) { return info(a).dense; }

HfArch hf_arch_of(const ModelConfig& m) {
  const bool dense = m.n_experts == 1 && m.top_k == 1;
  if (!m.qk_norm)
    throw ConfigError("export-hf: [model] qk_norm = false: every supported HF architecture (OLMoE, Qwen3, OLMo-2) "
                      "applies QK-norm");
  if (m.post_norm) {
    if (!dense)
      throw ConfigError("export-hf: [model] post_norm = true with n_experts = " + std::to_string(m.n_experts) +
                        ": Olmo2ForCausalLM is dense and no supported HF MoE architecture is post-norm");
    if (m.qk_norm_per_head)
      throw ConfigError("export-hf: [model] qk_norm_per_head = true with post_norm = true: Olmo2ForCausalLM "
                        "normalizes the whole projection");
    return HfArch::olmo2;
  }
  if (m.qk_norm_per_head) return dense ? HfArch::qwen3 : HfArch::qwen3_moe;
  return HfArch::olmoe;
}

std::optional<std::string> hf_tensor_name(HfArch a, const ParamTensor& t) {
  if (!hf_arch_dense(a)) return t.name;
  if (t.kind == ParamKind::router) return std::nullopt;
  if (t.kind != ParamKind::expert) return t.name;
  // model.layers.L.mlp.experts.0.gate_proj.weight -> model.layers.L.mlp.gate_proj.weight
  const std::string mark = ".mlp.experts.0.";
  const size_t p = t.name.find(mark);
  return t.name.substr(0, p) + ".mlp." + t.name.substr(p + mark.size());
}

std::string hf_config_json(const ModelConfig& m, const HfExportOptions& opts) {
  const HfArch arch = hf_arch_of(m);
  if (opts.dtype != "F32" && opts.dtype != "BF16")
    throw ConfigError("export-hf: dtype must be F32 or BF16, not '" + opts.dtype + "'");
  const char* torch_dtype = opts.dtype == "F32" ? "float32" : "bfloat16";
  const bool moe = !hf_arch_dense(arch);
  ojson j;
  j["architectures"] = {hf_arch_class(arch)};
  j["model_type"] = info(arch).model_type;
  j["vocab_size"] = m.vocab_size;
  j["hidden_size"] = m.d_model;
  j["intermediate_size"] = m.expert_hidden;
  if (arch == HfArch::qwen3_moe) j["moe_intermediate_size"] = m.expert_hidden;
  j["num_hidden_layers"] = m.n_layers;
  j["num_attention_heads"] = m.n_heads;
  j["num_key_value_heads"] = m.n_kv_heads;
  if (arch == HfArch::qwen3 || arch == HfArch::qwen3_moe || m.head_dim() * m.n_heads != m.d_model)
    j["head_dim"] = m.head_dim();
  if (moe) {
    j["num_experts"] = m.n_experts;
    j["num_experts_per_tok"] = m.top_k;
    j["norm_topk_prob"] = m.norm_topk_prob;
    j["router_aux_loss_coef"] = opts.router_aux_loss_coef;
    j["output_router_logits"] = false;
  }
  if (arch == HfArch::qwen3_moe) {
    j["decoder_sparse_step"] = 1;
    j["mlp_only_layers"] = ojson::array();
  }
  if (arch == HfArch::qwen3 || arch == HfArch::qwen3_moe) {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = m.n_layers;
  }
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = m.seq_len;
  j["rms_norm_eps"] = m.norm_eps;
  j["rope_theta"] = m.rope_theta;
  j["rope_scaling"] = nullptr;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  if (arch == HfArch::olmoe) j["clip_qkv"] = nullptr;
  j["tie_word_embeddings"] = m.tie_embeddings;
  j["initializer_range"] = m.init_std;
  j["use_cache"] = true;
  j["pad_token_id"] = token_id(opts.pad_token_id);
  j["bos_token_id"] = token_id(opts.bos_token_id);
  j["eos_token_id"] = token_id(opts.eos_token_id);
  j["torch_dtype"] = torch_dtype;  // transformers 4.x
  j["dtype"] = torch_dtype;        // transformers 5.x
  return j.dump(2) + "\n";
}

HfConfig hf_config_from_json(const std::string& text, const std::string& where) {
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
  auto found = [&](const char* key) { return j.contains(key) ? ", found " + j[key].dump() : std::string(); };

  HfConfig out;
  const ArchInfo* arch = nullptr;
  if (j.contains("model_type") && j["model_type"].is_string())
    for (const ArchInfo& i : kArchs)
      if (j["model_type"] == i.model_type) arch = &i;
  if (!arch)
    throw bad("model_type", "expected \"olmoe\", \"qwen3\", \"qwen3_moe\" or \"olmo2\"" + found("model_type"));
  out.arch = arch->arch;
  if (j.contains("architectures")) {
    const auto& a = j["architectures"];
    if (!a.is_array() || a.size() != 1 || a[0] != arch->class_name)
      throw bad("architectures", std::string("expected [\"") + arch->class_name + "\" ] for model_type \"" +
                                     arch->model_type + "\", found " + a.dump());
  }
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
    if (!j.contains(key) || j[key].is_null()) return def;
    if (!j[key].is_number()) throw bad(key, "expected a number, found " + j[key].dump());
    return j[key].get<double>();
  };
  auto get_bool = [&](const char* key, bool def) -> bool {
    if (!j.contains(key) || j[key].is_null()) return def;
    if (!j[key].is_boolean()) throw bad(key, "expected true or false, found " + j[key].dump());
    return j[key].get<bool>();
  };
  const bool qwen = out.arch == HfArch::qwen3 || out.arch == HfArch::qwen3_moe;

  ModelConfig& m = out.model;
  m.vocab_size = get_int("vocab_size", std::nullopt, 1);
  m.d_model = get_int("hidden_size", std::nullopt, 1);
  m.n_layers = get_int("num_hidden_layers", std::nullopt, 1);
  m.n_heads = get_int("num_attention_heads", std::nullopt, 1);
  m.n_kv_heads = get_int("num_key_value_heads", m.n_heads, 1);
  // Qwen3Config defaults head_dim to 128; the others to hidden_size / num_attention_heads.
  if (j.contains("head_dim") || qwen) {
    const int64_t head_dim = get_int("head_dim", 128, 1);
    if (head_dim * m.n_heads != m.d_model) m.head_dim_key = head_dim;
  } else if (m.d_model % m.n_heads != 0) {
    throw bad("hidden_size", std::to_string(m.d_model) + " is not a multiple of num_attention_heads " +
                                 std::to_string(m.n_heads) + " (and no head_dim is given)");
  }
  if (arch->dense) {
    m.expert_hidden = get_int("intermediate_size", std::nullopt, 1);
    m.n_experts = m.top_k = 1;
    m.norm_topk_prob = false;
  } else {
    m.expert_hidden = get_int(out.arch == HfArch::qwen3_moe ? "moe_intermediate_size" : "intermediate_size",
                              std::nullopt, 1);
    // transformers 5 writes Qwen3-MoE's expert count as num_local_experts.
    const char* experts_key = !j.contains("num_experts") && j.contains("num_local_experts") ? "num_local_experts"
                                                                                            : "num_experts";
    m.n_experts = get_int(experts_key, std::nullopt, 1);
    m.top_k = get_int("num_experts_per_tok", std::nullopt, 1);
    m.norm_topk_prob = get_bool("norm_topk_prob", false);
  }
  m.seq_len = get_int("max_position_embeddings", 4096, 1);
  m.tie_embeddings = get_bool("tie_word_embeddings", false);
  m.norm_eps = get_num("rms_norm_eps", qwen ? 1e-6 : 1e-5);
  m.init_std = get_num("initializer_range", 0.02);
  m.qk_norm = true;
  m.qk_norm_per_head = qwen;
  m.post_norm = out.arch == HfArch::olmo2;
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
  if (get_bool("attention_bias", false)) throw bad("attention_bias", "attention biases are not supported, found true");
  if (j.contains("hidden_act") && j["hidden_act"] != "silu")
    throw bad("hidden_act", "only \"silu\" (SwiGLU) is supported, found " + j["hidden_act"].dump());
  if (get_bool("use_sliding_window", false))
    throw bad("use_sliding_window", "sliding-window attention is not supported, found true");
  if (j.contains("layer_types") && j["layer_types"].is_array())
    for (const auto& t : j["layer_types"])
      if (t != "full_attention")
        throw bad("layer_types", "only \"full_attention\" layers are supported, found " + t.dump());
  if (out.arch == HfArch::qwen3_moe) {
    if (get_int("decoder_sparse_step", 1, 1) != 1)
      throw bad("decoder_sparse_step", "only 1 (every layer MoE) is supported, found " + j["decoder_sparse_step"].dump());
    if (j.contains("mlp_only_layers") && !(j["mlp_only_layers"].is_array() && j["mlp_only_layers"].empty()))
      throw bad("mlp_only_layers", "only [] (every layer MoE) is supported, found " + j["mlp_only_layers"].dump());
    if (j.contains("shared_expert_intermediate_size") && !j["shared_expert_intermediate_size"].is_null() &&
        j["shared_expert_intermediate_size"] != 0)
      throw bad("shared_expert_intermediate_size", "shared experts are not supported, found " +
                                                       j["shared_expert_intermediate_size"].dump());
  }
  if (m.n_heads % m.n_kv_heads != 0)
    throw bad("num_key_value_heads", std::to_string(m.n_kv_heads) + " does not divide num_attention_heads " +
                                         std::to_string(m.n_heads));
  if (m.head_dim() % 2 != 0)
    throw bad("head_dim", std::to_string(m.head_dim()) + " is odd (RoPE rotates pairs)");
  if (m.top_k > m.n_experts)
    throw bad("num_experts_per_tok", std::to_string(m.top_k) + " exceeds num_experts " + std::to_string(m.n_experts));
  if (!(m.norm_eps > 0)) throw bad("rms_norm_eps", "expected a positive number");
  if (!(m.rope_theta > 0)) throw bad("rope_theta", "expected a positive number");
  return out;
}

}  // namespace spes
