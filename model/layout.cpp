#include "model/layout.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "model/seeded_normal.hpp"

namespace spes {

namespace {

struct LayoutBuilder {
  ParamLayout& L;
  int64_t add(std::string name, int64_t rows, int64_t cols, ParamKind kind, int layer, int expert) {
    ParamTensor t{std::move(name), L.total, rows, cols, kind, layer, expert};
    L.total += t.numel();
    L.tensors.push_back(std::move(t));
    return L.tensors.back().offset;
  }
};

std::string layer_prefix(int l) { return "model.layers." + std::to_string(l) + "."; }

}  // namespace

ParamLayout make_layout(const ModelConfig& m) {
  ParamLayout L;
  LayoutBuilder b{L};
  const int64_t d = m.d_model, qd = m.q_dim(), kv = m.kv_dim(), E = m.n_experts, H = m.expert_hidden;
  // Post-norm (OLMo-2) keeps the two norm slots, named as HF names them: attn_norm
  // normalizes the attention output, moe_norm the MLP output.
  const char* attn_norm_name = m.post_norm ? "post_attention_layernorm.weight" : "input_layernorm.weight";
  const char* moe_norm_name = m.post_norm ? "post_feedforward_layernorm.weight" : "post_attention_layernorm.weight";
  // Shared block: embedding, per-layer attention + norms + router, final norm, lm_head.
  L.embed = b.add("model.embed_tokens.weight", m.vocab_size, d, ParamKind::embedding, -1, -1);
  for (int l = 0; l < m.n_layers; ++l) {
    const std::string p = layer_prefix(l);
    LayerOffsets o{};
    o.attn_norm = b.add(p + attn_norm_name, 1, d, ParamKind::norm, l, -1);
    o.wq = b.add(p + "self_attn.q_proj.weight", qd, d, ParamKind::attention, l, -1);
    o.wk = b.add(p + "self_attn.k_proj.weight", kv, d, ParamKind::attention, l, -1);
    o.wv = b.add(p + "self_attn.v_proj.weight", kv, d, ParamKind::attention, l, -1);
    o.wo = b.add(p + "self_attn.o_proj.weight", d, qd, ParamKind::attention, l, -1);
    if (m.qk_norm) {
      o.q_norm = b.add(p + "self_attn.q_norm.weight", 1, m.q_norm_width(), ParamKind::norm, l, -1);
      o.k_norm = b.add(p + "self_attn.k_norm.weight", 1, m.k_norm_width(), ParamKind::norm, l, -1);
    } else {
      o.q_norm = o.k_norm = -1;
    }
    o.moe_norm = b.add(p + moe_norm_name, 1, d, ParamKind::norm, l, -1);
    o.router = b.add(p + "mlp.gate.weight", E, d, ParamKind::router, l, -1);
    L.layers.push_back(o);
  }
  L.final_norm = b.add("model.norm.weight", 1, d, ParamKind::norm, -1, -1);
  L.lm_head = m.tie_embeddings ? L.embed : b.add("lm_head.weight", m.vocab_size, d, ParamKind::lm_head, -1, -1);
  L.shared_count = L.total;
  // Expert blocks, expert-major: expert e's weights for every layer are contiguous.
  L.experts.assign(m.n_layers, std::vector<ExpertOffsets>(E));
  for (int e = 0; e < E; ++e) {
    for (int l = 0; l < m.n_layers; ++l) {
      const std::string p = layer_prefix(l) + "mlp.experts." + std::to_string(e) + ".";
      ExpertOffsets& x = L.experts[l][e];
      x.gate = b.add(p + "gate_proj.weight", H, d, ParamKind::expert, l, e);
      x.up = b.add(p + "up_proj.weight", H, d, ParamKind::expert, l, e);
      x.down = b.add(p + "down_proj.weight", d, H, ParamKind::expert, l, e);
    }
  }
  L.expert_block = E > 0 ? (L.total - L.shared_count) / E : 0;
  return L;
}

const ParamTensor* ParamLayout::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

Ownership make_ownership(const ModelConfig& m, const ParamLayout& layout, int node_id, int n_nodes,
                         OwnershipMode ownership, int64_t experts_per_node) {
  const int E = static_cast<int>(m.n_experts);
  Ownership o;
  o.node_id = node_id;
  o.n_nodes = n_nodes;
  o.owners.assign(E, {});
  if (ownership == OwnershipMode::all) {
    for (int e = 0; e < E; ++e)
      for (int p = 0; p < n_nodes; ++p) o.owners[e].push_back(p);
  } else {
    const int64_t k = experts_per_node ? experts_per_node : E / n_nodes;
    for (int p = 0; p < n_nodes; ++p)
      for (int64_t i = 0; i < k; ++i) {
        auto& owners = o.owners[(p * k + i) % E];
        if (std::find(owners.begin(), owners.end(), p) == owners.end()) owners.push_back(p);
      }
    for (auto& owners : o.owners) std::sort(owners.begin(), owners.end());
  }
  o.owned.assign(E, false);
  for (int e = 0; e < E; ++e)
    o.owned[e] = std::find(o.owners[e].begin(), o.owners[e].end(), node_id) != o.owners[e].end();
  // Shared params are always trained; owned expert blocks follow (adjacent ones merge).
  std::vector<Range> ranges{{0, layout.shared_count}};
  for (int e = 0; e < E; ++e)
    if (o.owned[e]) ranges.push_back({layout.expert_begin(e), layout.expert_begin(e) + layout.expert_block});
  o.space = OwnedSpace(ranges);
  return o;
}

namespace {

// FNV-1a over bytes: stable across platforms and compilers (std::hash is not).
struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void bytes(const void* p, size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 1099511628211ull;
  }
  void i64(int64_t x) { bytes(&x, sizeof x); }
  void f64(double x) { bytes(&x, sizeof x); }
  void str(const std::string& s) { i64(int64_t(s.size())); bytes(s.data(), s.size()); }
};

}  // namespace

uint64_t model_fingerprint(const ModelConfig& m, const ParamLayout& layout, const Ownership& own) {
  Fnv f;
  f.i64(m.vocab_size); f.i64(m.d_model); f.i64(m.n_layers); f.i64(m.n_heads); f.i64(m.n_kv_heads);
  f.i64(m.n_experts); f.i64(m.top_k); f.i64(m.expert_hidden); f.i64(m.seq_len);
  f.f64(m.rope_theta); f.i64(m.qk_norm); f.f64(m.norm_eps); f.i64(m.norm_topk_prob);
  f.i64(m.tie_embeddings);
  // Options added later enter only when set, so existing models keep their fingerprint.
  if (m.qk_norm_per_head || m.head_dim_key || m.post_norm) {
    f.i64(m.qk_norm_per_head); f.i64(m.head_dim_key); f.i64(m.post_norm);
  }
  for (const auto& t : layout.tensors) {
    f.str(t.name); f.i64(t.offset); f.i64(t.rows); f.i64(t.cols);
  }
  f.i64(own.n_nodes);
  for (const auto& owners : own.owners) {
    f.i64(int64_t(owners.size()));
    for (int p : owners) f.i64(p);
  }
  return f.h;
}

void init_tensor(float* params, const ParamTensor& t, const ModelConfig& m, uint64_t seed) {
  float* w = params + t.offset;
  const int64_t n = t.numel();
  if (t.is_norm()) {
    std::fill(w, w + n, 1.0f);
    return;
  }
  const float std = static_cast<float>(m.init_std);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) w[i] = std * truncated_normal(seed, uint64_t(t.offset + i));
}

void init_parameters(float* params, const ModelConfig& m, const ParamLayout& layout, uint64_t seed) {
  for (const auto& t : layout.tensors) init_tensor(params, t, m, seed);
}

std::vector<AdamWRun> adamw_runs(const ParamLayout& layout, const Ownership& own, bool split_decay_classes) {
  std::vector<AdamWRun> runs;
  for (const ParamTensor& t : layout.tensors) {
    const int64_t g = own.space.packed_index(t.offset);
    if (g < 0) continue;  // frozen expert: no state, no update
    const bool cls = split_decay_classes && (t.kind == ParamKind::norm || t.kind == ParamKind::embedding);
    AdamWRun* last = runs.empty() ? nullptr : &runs.back();
    if (last && last->flat + last->n == t.offset && last->packed + last->n == g && last->norm_or_embedding == cls)
      last->n += t.numel();
    else
      runs.push_back({t.offset, g, t.numel(), cls});
  }
  return runs;
}

}  // namespace spes
