#include "engine/init_theta.hpp"

#include <algorithm>
#include <sstream>

#include "engine/base/error.hpp"
#include "engine/base/log.hpp"
#include "engine/checkpoint.hpp"

namespace spes {

void initial_theta(const Config& cfg, const ParamLayout& layout, float* theta) {
  const std::string& path = cfg.train.init;
  if (path.empty()) {
    init_parameters(theta, cfg.model, layout, cfg.train.seed);
    return;
  }
  const std::string where = cfg.path + ": [train] init = " + path;
  const CheckpointState s = load_checkpoint(path);
  const ModelConfig m = parse_config_text(s.config_toml, path + "/config.toml").model;
  auto shape = [&](const char* key, int64_t theirs, int64_t ours) {
    if (theirs != ours)
      throw ConfigError(where + ": its model has [model] " + key + " = " + std::to_string(theirs) + ", this config has " +
                        std::to_string(ours));
  };
  shape("vocab_size", m.vocab_size, cfg.model.vocab_size);
  shape("d_model", m.d_model, cfg.model.d_model);
  shape("n_layers", m.n_layers, cfg.model.n_layers);
  shape("n_heads", m.n_heads, cfg.model.n_heads);
  shape("n_kv_heads", m.n_kv_heads, cfg.model.n_kv_heads);
  shape("n_experts", m.n_experts, cfg.model.n_experts);
  shape("expert_hidden", m.expert_hidden, cfg.model.expert_hidden);
  shape("qk_norm", m.qk_norm, cfg.model.qk_norm);
  shape("qk_norm_per_head", m.qk_norm_per_head, cfg.model.qk_norm_per_head);
  shape("head_dim", m.head_dim(), cfg.model.head_dim());
  shape("post_norm", m.post_norm, cfg.model.post_norm);
  shape("tie_embeddings", m.tie_embeddings, cfg.model.tie_embeddings);
  if (int64_t(s.params.size()) != layout.total)
    throw CheckpointError(where + ": " + std::to_string(s.params.size()) + " parameters, the model needs " +
                          std::to_string(layout.total));
  // Not the shape: the run may change them on purpose (routing, context), but say so.
  auto note = [&](const char* key, double theirs, double ours) {
    if (theirs == ours) return;
    std::ostringstream os;
    os << where << ": its [model] " << key << " = " << theirs << ", this run uses " << ours;
    log_line("[init]", "%s", os.str().c_str());
  };
  note("top_k", double(m.top_k), double(cfg.model.top_k));
  note("norm_topk_prob", m.norm_topk_prob, cfg.model.norm_topk_prob);
  note("rope_theta", m.rope_theta, cfg.model.rope_theta);
  note("norm_eps", m.norm_eps, cfg.model.norm_eps);
  note("seq_len", double(m.seq_len), double(cfg.model.seq_len));
  std::copy(s.params.begin(), s.params.end(), theta);
}

}  // namespace spes
