// The Hugging Face architectures the engine reads and writes, and how each maps to
// ModelConfig and to the layout's tensor names (model/hf_export.hpp does the I/O):
//
//   OlmoeForCausalLM     MoE, pre-norm, QK-norm over the whole projection
//   Qwen3MoeForCausalLM  MoE, pre-norm, QK-norm per head (qk_norm_per_head), head_dim key
//   Qwen3ForCausalLM     dense Qwen3
//   Olmo2ForCausalLM     dense, post-norm (post_norm), QK-norm over the whole projection
//
// A dense model is the engine's one-expert MoE (n_experts = top_k = 1): its HF MLP
// mlp.{gate,up,down}_proj is the layout's mlp.experts.0.*, and its router (one
// logit, softmax 1 whatever its value) is not in the HF file: imported as zeros.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "model/layout.hpp"
#include "model/model_config.hpp"

namespace spes {

enum class HfArch { olmoe, qwen3, qwen3_moe, olmo2 };

const char* hf_arch_class(HfArch a);  // "OlmoeForCausalLM", ...
bool hf_arch_dense(HfArch a);

// The architecture that expresses m; ConfigError (one line naming the [model] key)
// when none does (e.g. qk_norm = false, or a post-norm MoE).
HfArch hf_arch_of(const ModelConfig& m);

// The HF name of a layout tensor in architecture a; nullopt for the dense router.
std::optional<std::string> hf_tensor_name(HfArch a, const ParamTensor& t);

struct HfExportOptions {
  std::string dtype = "F32";          // stored dtype: "F32" | "BF16"
  double router_aux_loss_coef = 0.01;  // LossConfig::lb_coef of the run
  // The byte-level vocab has no special tokens (ids 0..255 are bytes), so these
  // are null unless a tokenizer with special tokens says otherwise.
  std::optional<int64_t> pad_token_id, bos_token_id, eos_token_id;
};

// config.json text for m in the architecture hf_arch_of(m) (throws its ConfigError).
std::string hf_config_json(const ModelConfig& m, const HfExportOptions& opts = {});

struct HfConfig {
  HfArch arch = HfArch::olmoe;
  ModelConfig model;
};
// The architecture and ModelConfig a config.json describes; `where` names the file.
// Anything the engine does not compute the same way: ConfigError naming the
// config.json key and its value.
HfConfig hf_config_from_json(const std::string& text, const std::string& where);

}  // namespace spes
