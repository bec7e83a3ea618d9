#include "model/cpu/cpu_decoder.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "model/cpu/ops.hpp"

namespace spes {

using namespace spes::cpu;

CpuDecoder::CpuDecoder(const ModelConfig& cfg, const ParamLayout& layout, const float* params,
                       int64_t max_positions)
    : cfg_(cfg), layout_(layout), P_(params), max_pos_(max_positions) {
  const int64_t d = cfg.d_model, kv = cfg.kv_dim(), E = cfg.n_experts, K = cfg.top_k, Hx = cfg.expert_hidden;
  k_cache_.assign(cfg.n_layers, std::vector<float>(size_t(max_positions * kv)));
  v_cache_.assign(cfg.n_layers, std::vector<float>(size_t(max_positions * kv)));
  for (auto* v : {&x_, &a_, &h_, &moe_}) v->resize(size_t(d));
  for (auto* v : {&q_, &att_}) v->resize(size_t(cfg.q_dim()));
  rstd_.resize(size_t(cfg.n_heads));
  for (auto* v : {&k_, &v_}) v->resize(size_t(kv));
  probs_.resize(size_t(E));
  scores_.resize(size_t(max_positions));
  logits_.resize(size_t(cfg.vocab_size));
  xe_.resize(size_t(d));
  for (auto* v : {&gate_, &up_, &act_}) v->resize(size_t(Hx));
  ye_.resize(size_t(d));
  topk_idx_.resize(size_t(K));
  topk_w_.resize(size_t(K));
}

// One layer for the token at position pos_: as CpuModel::layer_forward with N = 1,
// attention over the cached positions [0, pos_].
void CpuDecoder::layer(int l) {
  const LayerOffsets& o = layout_.layers[l];
  const int64_t d = cfg_.d_model, qd = cfg_.q_dim(), kv = cfg_.kv_dim(), E = cfg_.n_experts, K = cfg_.top_k,
                Hx = cfg_.expert_hidden, hd = cfg_.head_dim(), H = cfg_.n_heads, Hkv = cfg_.n_kv_heads;
  const float eps = static_cast<float>(cfg_.norm_eps);
  float* rstd = rstd_.data();

  // Attention block (post-norm: on the residual itself, its output normalized below).
  if (cfg_.post_norm)
    std::copy(x_.begin(), x_.end(), a_.begin());
  else
    rmsnorm_forward(a_.data(), rstd, x_.data(), P_ + o.attn_norm, 1, d, eps);
  matmul_forward(q_.data(), a_.data(), P_ + o.wq, 1, d, qd);
  matmul_forward(k_.data(), a_.data(), P_ + o.wk, 1, d, kv);
  matmul_forward(v_.data(), a_.data(), P_ + o.wv, 1, d, kv);
  if (cfg_.qk_norm) {
    rmsnorm_forward(q_.data(), rstd, q_.data(), P_ + o.q_norm, cfg_.q_norm_rows(), cfg_.q_norm_width(), eps);
    rmsnorm_forward(k_.data(), rstd, k_.data(), P_ + o.k_norm, cfg_.k_norm_rows(), cfg_.k_norm_width(), eps);
  }
  rope_forward(q_.data(), q_.data(), 1, 1, H, hd, cfg_.rope_theta, pos_);
  rope_forward(k_.data(), k_.data(), 1, 1, Hkv, hd, cfg_.rope_theta, pos_);
  float* kc = k_cache_[l].data();
  float* vc = v_cache_[l].data();
  std::copy(k_.begin(), k_.end(), kc + pos_ * kv);
  std::copy(v_.begin(), v_.end(), vc + pos_ * kv);
  // softmax(q·kᵀ/√D)·v over positions 0..pos_, per head (query head h reads kv head h/(H/Hkv)).
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t h = 0; h < H; ++h) {
    const float* q = q_.data() + h * hd;
    const int64_t kvh = h / (H / Hkv);
    float maxv = -INFINITY;
    for (int64_t j = 0; j <= pos_; ++j) {
      const float* k = kc + j * kv + kvh * hd;
      float s = 0;
      for (int64_t i = 0; i < hd; ++i) s += q[i] * k[i];
      scores_[j] = s * scale;
      maxv = std::max(maxv, scores_[j]);
    }
    double sum = 0;
    for (int64_t j = 0; j <= pos_; ++j) sum += (scores_[j] = std::exp(scores_[j] - maxv));
    float* out = att_.data() + h * hd;
    std::fill(out, out + hd, 0.0f);
    for (int64_t j = 0; j <= pos_; ++j) {
      const float p = static_cast<float>(scores_[j] / sum);
      const float* v = vc + j * kv + kvh * hd;
      for (int64_t i = 0; i < hd; ++i) out[i] += p * v[i];
    }
  }
  matmul_forward(h_.data(), att_.data(), P_ + o.wo, 1, qd, d);
  if (cfg_.post_norm) rmsnorm_forward(h_.data(), rstd, h_.data(), P_ + o.attn_norm, 1, d, eps);
  for (int64_t i = 0; i < d; ++i) h_[i] += x_[i];

  // MoE block: route the token, run its top-k experts, combine.
  if (cfg_.post_norm)
    std::copy(h_.begin(), h_.end(), a_.begin());
  else
    rmsnorm_forward(a_.data(), rstd, h_.data(), P_ + o.moe_norm, 1, d, eps);
  matmul_forward(probs_.data(), a_.data(), P_ + o.router, 1, d, E);
  float lse = 0;
  router_forward(probs_.data(), &lse, topk_idx_.data(), topk_w_.data(), probs_.data(), 1, E, K, cfg_.norm_topk_prob);
  std::fill(moe_.begin(), moe_.end(), 0.0f);
  for (int64_t k = 0; k < K; ++k) {
    const ExpertOffsets& x = layout_.experts[l][topk_idx_[k]];
    matmul_forward(gate_.data(), a_.data(), P_ + x.gate, 1, d, Hx);
    matmul_forward(up_.data(), a_.data(), P_ + x.up, 1, d, Hx);
    swiglu_forward(act_.data(), gate_.data(), up_.data(), Hx);
    matmul_forward(ye_.data(), act_.data(), P_ + x.down, 1, Hx, d);
    for (int64_t i = 0; i < d; ++i) moe_[i] += topk_w_[k] * ye_[i];
  }
  if (cfg_.post_norm) rmsnorm_forward(moe_.data(), rstd, moe_.data(), P_ + o.moe_norm, 1, d, eps);
  for (int64_t i = 0; i < d; ++i) x_[i] = h_[i] + moe_[i];
}

std::span<const float> CpuDecoder::step(int32_t token) {
  if (pos_ >= max_pos_)
    throw std::length_error("CpuDecoder: context of " + std::to_string(max_pos_) + " positions is full");
  if (token < 0 || token >= cfg_.vocab_size)
    throw std::out_of_range("CpuDecoder: token " + std::to_string(token) + " outside the vocabulary");
  const int64_t d = cfg_.d_model;
  embedding_forward(x_.data(), &token, P_ + layout_.embed, 1, d);
  for (int l = 0; l < cfg_.n_layers; ++l) layer(l);
  float rstd = 0;
  rmsnorm_forward(a_.data(), &rstd, x_.data(), P_ + layout_.final_norm, 1, d, static_cast<float>(cfg_.norm_eps));
  matmul_forward(logits_.data(), a_.data(), P_ + layout_.lm_head, 1, d, cfg_.vocab_size);
  ++pos_;
  return logits_;
}

}  // namespace spes
