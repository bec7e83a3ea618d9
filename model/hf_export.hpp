// HF export and import: a folder `transformers` loads as the architecture the model is
// (model/hf_config.hpp: OlmoeForCausalLM, Qwen3MoeForCausalLM, Qwen3ForCausalLM,
// Olmo2ForCausalLM) — config.json and model.safetensors holding the layout's tensors under
// their HF names ([out, in]; norms 1-D [C]; lm_head omitted when tied; a dense model's
// router omitted). Import reads those four from one model.safetensors or a sharded
// model.safetensors.index.json, F32/BF16/F16. Also the flat-buffer <-> HF-safetensors
// helpers (layout names, OLMoE) that merge-experts and the coordinator's --dump-state use.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/hf_config.hpp"
#include "model/layout.hpp"
#include "model/model_config.hpp"
#include "model/safetensors.hpp"

namespace spes {

// Writes <out_dir>/model.safetensors then <out_dir>/config.json, each atomically
// (temp + fsync + rename); creates out_dir.
void export_hf(const ModelConfig& m, const ParamLayout& layout, const float* params, const std::string& out_dir,
               const HfExportOptions& opts = {});

struct HfModel {
  HfArch arch = HfArch::olmoe;
  ModelConfig config;
  std::vector<float> params;  // flat buffer in make_layout(config) order
};
// Reads an HF folder: every tensor the architecture has present with the right shape, no
// extras (a dense router is zeros). Throws CheckpointError (files) or ConfigError
// (config.json keys, one line naming the key and its value).
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
