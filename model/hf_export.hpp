// HF export: a folder that `transformers` loads as OlmoeForCausalLM — config.json
// (every OlmoeConfig key) and model.safetensors holding the layout's tensors under
// their HF names ([out, in]; norms 1-D [C]; lm_head omitted when tied). Also the
// way back (import_hf) and the flat-buffer <-> HF-safetensors helpers that
// merge-experts and the coordinator's --dump-state use.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/layout.hpp"
#include "model/model_config.hpp"
#include "model/safetensors.hpp"

namespace spes {

struct HfExportOptions {
  std::string dtype = "F32";          // stored dtype: "F32" | "BF16"
  double router_aux_loss_coef = 0.01;  // LossConfig::lb_coef of the run
  // The byte-level vocab has no special tokens (ids 0..255 are bytes), so these
  // are null unless a tokenizer with special tokens says otherwise.
  std::optional<int64_t> pad_token_id, bos_token_id, eos_token_id;
};

// config.json text for `m` (throws ConfigError for models HF OLMoE cannot express:
// OLMoE always applies QK-norm).
std::string hf_config_json(const ModelConfig& m, const HfExportOptions& opts = {});
// ModelConfig from config.json text; `where` names the file in errors.
ModelConfig model_config_from_hf_json(const std::string& text, const std::string& where);

// Writes <out_dir>/model.safetensors then <out_dir>/config.json, each atomically
// (temp + fsync + rename); creates out_dir.
void export_hf(const ModelConfig& m, const ParamLayout& layout, const float* params, const std::string& out_dir,
               const HfExportOptions& opts = {});

struct HfModel {
  ModelConfig config;
  std::vector<float> params;  // flat buffer in make_layout(config) order
};
// Reads an export back: every layout tensor present with the right shape, no
// extras. Throws CheckpointError (files) or ConfigError (config.json values).
HfModel import_hf(const std::string& dir);

// The layout's tensors as safetensors views of `params` (HF names and shapes).
std::vector<SafeTensorView> hf_tensor_views(const ParamLayout& layout, const float* params,
                                            const std::string& dtype = "F32");
void write_hf_safetensors(const std::string& path, const ParamLayout& layout, const float* params,
                          const std::string& dtype = "F32");
// Reads HF-named safetensors into a flat buffer for `layout` (strict: same names,
// shapes, no extras); F32, BF16 and F16 files convert to fp32.
std::vector<float> read_hf_safetensors(const std::string& path, const ParamLayout& layout);

}  // namespace spes
