#include "model/upcycle.hpp"

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "engine/base/error.hpp"
#include "model/seeded_normal.hpp"

namespace spes {

namespace {

std::string shape(const ParamTensor& t) { return "[" + std::to_string(t.rows) + ", " + std::to_string(t.cols) + "]"; }

// The noise stream of tensor `which` (0 gate, 1 up, 2 down) of expert e in layer l.
uint64_t noise_key(uint64_t seed, int layer, int expert, int which) {
  constexpr uint64_t kSalt = 0x55504359434c45ull;  // "UPCYCLE": apart from the init's streams
  uint64_t k = splitmix64(seed ^ kSalt);
  k = splitmix64(k ^ uint64_t(layer));
  k = splitmix64(k ^ uint64_t(expert));
  return splitmix64(k ^ uint64_t(which));
}

double rms(const float* w, int64_t n) {
  double s = 0;  // serial: the same bits on any thread count
  for (int64_t i = 0; i < n; ++i) s += double(w[i]) * double(w[i]);
  return n > 0 ? std::sqrt(s / double(n)) : 0.0;
}

}  // namespace

void check_upcyclable(const ModelConfig& dense, const ModelConfig& moe, const std::string& dense_name,
                      const std::string& moe_name) {
  if (dense.n_experts != 1 || dense.top_k != 1)
    throw ConfigError(dense_name + ": [model] n_experts = " + std::to_string(dense.n_experts) + ", top_k = " +
                      std::to_string(dense.top_k) + ": upcycle takes a dense model (n_experts = 1, top_k = 1)");
  auto same = [&](const char* key, int64_t d, int64_t m, const char* what = nullptr) {
    if (d == m) return;
    throw ConfigError("upcycle: [model] " + std::string(key) + " differs: " + dense_name + " has " +
                      std::to_string(d) + (what ? what : "") + ", " + moe_name + " has " + std::to_string(m));
  };
  same("vocab_size", dense.vocab_size, moe.vocab_size);
  same("d_model", dense.d_model, moe.d_model);
  same("n_layers", dense.n_layers, moe.n_layers);
  same("n_heads", dense.n_heads, moe.n_heads);
  same("n_kv_heads", dense.n_kv_heads, moe.n_kv_heads);
  same("qk_norm", dense.qk_norm, moe.qk_norm);
  same("qk_norm_per_head", dense.qk_norm_per_head, moe.qk_norm_per_head);
  same("head_dim", dense.head_dim(), moe.head_dim());
  same("post_norm", dense.post_norm, moe.post_norm);
  same("tie_embeddings", dense.tie_embeddings, moe.tie_embeddings);
  same("expert_hidden", dense.expert_hidden, moe.expert_hidden, " (its dense MLP's hidden size)");
}

void upcycle(const ModelConfig& dense, const ParamLayout& dense_layout, std::span<const float> dense_params,
             const ModelConfig& moe, const ParamLayout& moe_layout, float* out, const UpcycleOptions& opt,
             const std::string& dense_name, const std::string& moe_name) {
  check_upcyclable(dense, moe, dense_name, moe_name);
  if (int64_t(dense_params.size()) != dense_layout.total)
    throw ConfigError(dense_name + ": " + std::to_string(dense_params.size()) + " parameters, its [model] needs " +
                      std::to_string(dense_layout.total));
  std::unordered_map<std::string, const ParamTensor*> by_name;
  for (const ParamTensor& t : dense_layout.tensors) by_name[t.name] = &t;
  auto source = [&](const ParamTensor& t, const std::string& name) -> const ParamTensor& {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw ConfigError("upcycle: " + name + " (for " + t.name + ") is not in " + dense_name);
    const ParamTensor& s = *it->second;
    if (s.rows != t.rows || s.cols != t.cols)
      throw ConfigError("upcycle: " + t.name + " is " + shape(t) + " in " + moe_name + " but " + s.name + " is " +
                        shape(s) + " in " + dense_name);
    return s;
  };
  static const char* kWhich[3] = {"gate_proj", "up_proj", "down_proj"};
  for (const ParamTensor& t : moe_layout.tensors) {
    float* w = out + t.offset;
    if (t.kind == ParamKind::router) {
      init_tensor(out, t, moe, opt.seed);
      continue;
    }
    if (t.kind != ParamKind::expert) {
      const ParamTensor& s = source(t, t.name);
      std::copy(dense_params.begin() + s.offset, dense_params.begin() + s.offset + s.numel(), w);
      continue;
    }
    const ExpertOffsets& o = moe_layout.experts[t.layer][t.expert];
    const int which = t.offset == o.gate ? 0 : t.offset == o.up ? 1 : 2;
    const ParamTensor& s = source(t, "model.layers." + std::to_string(t.layer) + ".mlp.experts.0." + kWhich[which] +
                                         ".weight");
    const float* d = dense_params.data() + s.offset;
    const int64_t n = t.numel();
    if (opt.noise == 0.0) {
      std::copy(d, d + n, w);
      continue;
    }
    const double scale = opt.noise * rms(d, n);
    const uint64_t key = noise_key(opt.seed, t.layer, t.expert, which);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) w[i] = float(double(d[i]) + scale * standard_normal(key, uint64_t(i)));
  }
}

}  // namespace spes
