#include "model/hf_export.hpp"

#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/base/atomic_file.hpp"
#include "engine/base/error.hpp"
#include "engine/base/finite.hpp"

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

// Reads tensor `name` of r into dst: a model's weights are finite (a checkpoint holds
// nothing else), so a NaN or inf stops the import naming the file and the tensor.
void read_finite(const SafeTensorsReader& r, const std::string& name, float* dst) {
  const SafeTensorsReader::Entry& e = *r.find(name);
  r.read(e, dst);
  if (const std::string why = describe_non_finite(dst, e.numel); !why.empty())
    throw CheckpointError("safetensors " + r.path() + ": tensor '" + name + "' " + why + " (weights must be finite)");
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw CheckpointError(path + ": cannot open");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

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
  for (const ParamTensor& t : layout.tensors) read_finite(r, t.name, params.data() + t.offset);
  return params;
}

void export_hf(const ModelConfig& m, const ParamLayout& layout, const float* params, const std::string& out_dir,
               const HfExportOptions& opts) {
  const std::string config = hf_config_json(m, opts);  // refuses what no HF architecture expresses, before writing
  const HfArch arch = hf_arch_of(m);
  std::vector<SafeTensorView> views;
  for (const ParamTensor& t : layout.tensors)
    if (auto name = hf_tensor_name(arch, t)) views.push_back({*name, opts.dtype, hf_shape(t), params + t.offset});
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) throw CheckpointError(out_dir + ": cannot create folder: " + ec.message());
  // Weights first, config last: a folder whose config.json is new has new weights.
  write_safetensors((fs::path(out_dir) / "model.safetensors").string(), std::span<const SafeTensorView>(views),
                    {{"format", "pt"}});
  write_file_atomic((fs::path(out_dir) / "config.json").string(), config);
}

namespace {

// The safetensors files of an HF folder: model.safetensors, or the shards a
// model.safetensors.index.json names (its weight_map), each opened once.
struct HfWeights {
  std::vector<std::unique_ptr<SafeTensorsReader>> files;
  std::map<std::string, const SafeTensorsReader*> by_name;  // tensor -> the file holding it

  explicit HfWeights(const fs::path& d) {
    std::error_code ec;
    const fs::path single = d / "model.safetensors", index = d / "model.safetensors.index.json";
    if (fs::exists(single, ec)) {
      files.push_back(std::make_unique<SafeTensorsReader>(single.string()));
    } else if (fs::exists(index, ec)) {
      open_shards(d, index.string());
    } else {
      throw CheckpointError(single.string() + ": missing (and no model.safetensors.index.json)");
    }
    for (const auto& f : files)
      for (const auto& e : f->entries())
        if (!by_name.emplace(e.name, f.get()).second)
          throw CheckpointError(f->path() + ": tensor '" + e.name + "' is also in " + by_name[e.name]->path());
  }

  void open_shards(const fs::path& d, const std::string& index) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_text(index));
    } catch (const nlohmann::json::exception&) {
      throw CheckpointError(index + ": not valid JSON");
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw CheckpointError(index + ": weight_map: missing or not an object");
    std::map<std::string, std::string> shards;  // file name -> one tensor it should hold
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) throw CheckpointError(index + ": weight_map." + name + ": expected a file name");
      const std::string f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f[0] == '.')
        throw CheckpointError(index + ": weight_map." + name + ": '" + f + "' is not a file in the folder");
      shards.emplace(f, name);
    }
    for (const auto& [file, name] : shards) {
      files.push_back(std::make_unique<SafeTensorsReader>((d / file).string()));
      if (!files.back()->find(name))
        throw CheckpointError(index + ": weight_map says '" + name + "' is in " + file + ", which lacks it");
    }
  }
};

}  // namespace

HfModel import_hf(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  if (!fs::is_directory(d, ec)) throw CheckpointError(dir + ": not a folder (expected a Hugging Face checkpoint)");
  const std::string config_path = (d / "config.json").string();
  if (!fs::exists(config_path, ec)) throw CheckpointError(config_path + ": missing");
  HfModel out;
  const HfConfig hc = hf_config_from_json(read_text(config_path), config_path);
  out.arch = hc.arch;
  out.config = hc.model;
  const HfWeights w(d);
  const std::string where = w.files.size() == 1 ? w.files[0]->path() : (d / "model.safetensors.index.json").string();
  auto fail = [&](const std::string& what) -> CheckpointError { return CheckpointError("safetensors " + where + ": " + what); };
  // A config describing a huge model must not build a huge layout: compare the
  // tensor count it implies with the files' first.
  const ModelConfig& m = out.config;
  const bool dense = hf_arch_dense(out.arch);
  const long double per_layer = 8 + (dense ? 3.0L : 1 + 3.0L * m.n_experts);
  const long double want = 2.0L + (m.tie_embeddings ? 0 : 1) + (long double)m.n_layers * per_layer;
  if (want != (long double)w.by_name.size())
    throw fail("holds " + std::to_string(w.by_name.size()) + " tensors but " + config_path + " describes " +
               std::to_string(static_cast<unsigned long long>(want)));
  const ParamLayout layout = make_layout(out.config);
  // Names, shapes and dtypes first, so a mismatched file allocates nothing.
  for (const ParamTensor& t : layout.tensors) {
    const auto name = hf_tensor_name(out.arch, t);
    if (!name) continue;
    auto it = w.by_name.find(*name);
    if (it == w.by_name.end()) throw fail("missing tensor '" + *name + "'");
    const auto* e = it->second->find(*name);
    const auto want_shape = hf_shape(t);
    if (e->shape != want_shape)
      throw fail("tensor '" + *name + "' has shape " + shape_str(e->shape) + ", the model needs " +
                 shape_str(want_shape));
    if (e->dtype != "F32" && e->dtype != "BF16" && e->dtype != "F16")
      throw fail("tensor '" + *name + "' has dtype " + e->dtype + "; F32, BF16 or F16 expected");
  }
  out.params.assign(static_cast<size_t>(layout.total), 0.0f);  // a dense router stays 0
  for (const ParamTensor& t : layout.tensors)
    if (const auto name = hf_tensor_name(out.arch, t))
      read_finite(*w.by_name.at(*name), *name, out.params.data() + t.offset);
  return out;
}

}  // namespace spes
