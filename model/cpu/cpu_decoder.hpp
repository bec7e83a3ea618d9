// Text generation on the CPU: the CpuModel's forward (model/cpu/cpu_model) one token
// at a time with a KV cache — each new token attends to the keys and values of every
// earlier position, kept per layer, so a step costs O(position) attention instead of
// re-running the whole prefix. Same ops in the same order as training's forward, in
// fp32; only the attention is a plain loop (training's uses blocked GEMMs and a fast
// exp), so logits agree with `eval`'s to float rounding (tests/test_generate.cpp).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "model/layout.hpp"
#include "model/model_config.hpp"

namespace spes {

class CpuDecoder {
 public:
  // params: the flat θ (fp32, whole layout), which must outlive the decoder.
  // max_positions: the longest sequence it will see (≤ the trained context is wise).
  CpuDecoder(const ModelConfig& cfg, const ParamLayout& layout, const float* params, int64_t max_positions);

  // Feeds the token at the next position; returns the logits [vocab] that predict the
  // one after it (valid until the next call).
  std::span<const float> step(int32_t token);
  int64_t position() const { return pos_; }  // tokens fed so far
  void reset() { pos_ = 0; }

 private:
  void layer(int l);

  ModelConfig cfg_;
  ParamLayout layout_;
  const float* P_;
  int64_t max_pos_;
  int64_t pos_ = 0;
  std::vector<std::vector<float>> k_cache_, v_cache_;  // per layer: [max_positions, kv_dim]
  std::vector<float> x_, a_, q_, k_, v_, att_, h_, probs_, scores_, logits_, xe_, gate_, up_, act_, ye_, moe_;
  std::vector<int32_t> topk_idx_;
  std::vector<float> topk_w_;
  std::vector<float> rstd_;  // one per q head: per-head QK-norm writes a row each
};

}  // namespace spes
