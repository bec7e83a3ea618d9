// Fixture tool for the one-off Python oracles in this folder (not built by CMake,
// not run by ctest; check_safetensors.py compiles it against build/libspes_core.a).
//
//   fixtures write OUT_DIR   tiny OLMoE model: params.bin (flat fp32), exports
//                            f32/ bf16/ tied/ (+ params_tied.bin), tokens.bin (int32)
//                            and our CPU forward's logits.bin / logits_tied.bin [T, V]
//   fixtures read FILE OUT   our reader on FILE: OUT.json (name, dtype, shape in file
//                            order) and OUT.bin (their fp32 values concatenated)
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "model/hf_export.hpp"
#include "model/layout.hpp"
#include "model/cpu/cpu_model.hpp"
#include "model/safetensors.hpp"

using namespace spes;

namespace {

template <class T>
void dump(const std::string& path, const std::vector<T>& v) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
}

ModelConfig oracle_model(bool tied) {
  ModelConfig m;
  m.vocab_size = 64;
  m.d_model = 32;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = tied ? 4 : 2;  // the untied case is GQA, the tied one MHA
  m.n_experts = 4;
  m.top_k = 2;
  m.expert_hidden = 48;
  m.seq_len = 16;
  m.rope_theta = tied ? 500000.0 : 10000.0;
  m.norm_eps = 1e-5;
  m.norm_topk_prob = !tied;  // both routing-weight conventions
  m.tie_embeddings = tied;
  m.init_std = 0.2;  // large enough that routing and attention are far from uniform
  return m;
}

void write_case(const std::string& out, bool tied, const std::vector<int32_t>& tokens) {
  const ModelConfig m = oracle_model(tied);
  const ParamLayout layout = make_layout(m);
  std::vector<float> params(static_cast<size_t>(layout.total));
  init_parameters(params.data(), m, layout, 42);
  // Norm weights away from 1, so a norm exported under the wrong name or shape shows.
  std::mt19937 g(3);
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  for (const auto& t : layout.tensors)
    if (t.is_norm())
      for (int64_t i = 0; i < t.numel(); ++i) params[t.offset + i] = u(g);

  const std::string suffix = tied ? "_tied" : "";
  dump(out + "/params" + suffix + ".bin", params);
  export_hf(m, layout, params.data(), out + (tied ? "/tied" : "/f32"));
  if (!tied) {
    HfExportOptions bf;
    bf.dtype = "BF16";
    export_hf(m, layout, params.data(), out + "/bf16", bf);
  }

  const Ownership own = make_ownership(m, layout, 0, 1, OwnershipMode::all, 0);
  const int64_t T = m.seq_len;
  CpuModel model(m, layout, own, 1, T);
  std::vector<int32_t> inputs(tokens.begin(), tokens.begin() + T), targets(tokens.begin() + 1, tokens.end());
  LossConfig loss;
  LossParts parts = model.forward(params.data(), inputs.data(), targets.data(), loss);
  std::vector<float> logits(model.logits(), model.logits() + T * m.vocab_size);
  dump(out + "/logits" + suffix + ".bin", logits);
  nlohmann::json j = {{"ce", parts.ce}};
  std::ofstream(out + "/loss" + suffix + ".json") << j.dump();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "write" && argc == 3) {
      const std::string out = argv[2];
      std::vector<int32_t> tokens(17);
      std::mt19937 g(11);
      for (auto& t : tokens) t = static_cast<int32_t>(g() % 64);
      dump(out + "/tokens.bin", tokens);
      write_case(out, false, tokens);
      write_case(out, true, tokens);
      return 0;
    }
    if (mode == "read" && argc == 4) {
      SafeTensorsFile f = read_safetensors(argv[2]);
      nlohmann::json j = nlohmann::json::array();
      std::vector<float> all;
      for (const auto& t : f.tensors) {
        j.push_back({{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}});
        all.insert(all.end(), t.data.begin(), t.data.end());
      }
      std::ofstream(std::string(argv[3]) + ".json") << j.dump();
      dump(std::string(argv[3]) + ".bin", all);
      return 0;
    }
    std::fprintf(stderr, "usage: fixtures write OUT_DIR | fixtures read FILE OUT_PREFIX\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fixtures: %s\n", e.what());
    return 1;
  }
}
