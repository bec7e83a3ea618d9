#include "model/cpu/cpu_model.hpp"

#include <algorithm>
#include <cmath>

#include "model/cpu/ops.hpp"

namespace spes {

using namespace spes::cpu;

CpuModel::CpuModel(const ModelConfig& cfg, const ParamLayout& layout, const Ownership& own, int64_t batch,
                   int64_t seq_len)
    : CpuModel(cfg, layout, own, batch, seq_len, true) {}

CpuModel::CpuModel(const ModelConfig& cfg, const ParamLayout& layout, const Ownership& own, int64_t batch,
                   int64_t seq_len, bool allocate)
    : cfg_(cfg), layout_(layout), own_(own), B_(batch), T_(seq_len), N_(batch * seq_len),
      S_(batch * seq_len * cfg.top_k) {
  acts_.resize(cfg.n_layers);
  for_each_buffer([&](auto& v, int64_t count) {
    planned_bytes_ += count * int64_t(sizeof(v[0]));
    if (allocate) v.resize(size_t(count));
  });
}

int64_t CpuModel::planned_bytes(const ModelConfig& cfg, const ParamLayout& layout, const Ownership& own,
                                int64_t batch, int64_t seq_len) {
  return CpuModel(cfg, layout, own, batch, seq_len, false).planned_bytes_;
}

int64_t CpuModel::allocated_bytes() {
  int64_t bytes = 0;
  for_each_buffer([&](auto& v, int64_t) { bytes += int64_t(v.size() * sizeof(v[0])); });
  return bytes;
}

// Every activation and scratch buffer with its element count: the one list the
// constructor sizes and planned_bytes adds up.
template <class F>
void CpuModel::for_each_buffer(F&& f) {
  const int64_t d = cfg_.d_model, qd = cfg_.q_dim(), kv = cfg_.kv_dim(), E = cfg_.n_experts, K = cfg_.top_k,
                Hx = cfg_.expert_hidden;
  const int64_t post = cfg_.post_norm ? 1 : 0;
  for (auto& a : acts_) {
    for (auto* v : {&a.x_in, &a.an1, &a.h, &a.an2}) f(*v, N_ * d);
    for (auto* v : {&a.q_raw, &a.q_n, &a.q, &a.att}) f(*v, N_ * qd);
    for (auto* v : {&a.k_raw, &a.v, &a.k_n, &a.k}) f(*v, N_ * kv);
    for (auto* v : {&a.rstd1, &a.rstd2, &a.router_lse}) f(*v, N_);
    f(a.rstd_q, N_ * cfg_.q_norm_rows());
    f(a.rstd_k, N_ * cfg_.k_norm_rows());
    for (auto* v : {&a.o_raw, &a.y_raw}) f(*v, post * N_ * d);
    f(a.lse, B_ * cfg_.n_heads * T_);
    f(a.router_logits, N_ * E);
    f(a.probs, N_ * E);
    f(a.topk_w, N_ * K);
    f(a.topk_idx, N_ * K);
    f(a.offsets, E + 1);
    f(a.slot_token, S_);
    f(a.token_slot, S_);
    f(a.xe, S_ * d);
    f(a.ye, S_ * d);
    for (auto* v : {&a.gate, &a.up, &a.act}) f(*v, S_ * Hx);
  }
  f(x_final_, N_ * d);
  f(fnorm_, N_ * d);
  f(rstd_f_, N_);
  f(logits_, N_ * cfg_.vocab_size);
  f(ce_lse_, N_);
  f(ce_losses_, N_);
  f(inputs_, N_);
  f(targets_, N_);
  for (auto* v : {&d_x_, &d_a_, &d_b_}) f(*v, N_ * d);
  for (auto* v : {&d_q_, &d_att_}) f(*v, N_ * qd);
  f(d_c_, post * N_ * d);
  for (auto* v : {&d_k_, &d_v_}) f(*v, N_ * kv);
  f(d_logits_r_, N_ * E);
  f(d_topk_w_, N_ * K);
  for (auto* v : {&d_xe_, &d_xe2_, &d_ye_}) f(*v, S_ * d);
  for (auto* v : {&d_act_, &d_gate_, &d_up_}) f(*v, S_ * Hx);
  f(lb_dprob_, E);
}

float* CpuModel::grad_of(float* grads, int64_t offset) const {
  const int64_t i = own_.space.packed_index(offset);
  return i < 0 ? nullptr : grads + i;
}

// Pre-norm (OLMoE, Qwen3): h = x + Wo·attn(rope(qknorm(Wq·a)), rope(qknorm(Wk·a)), Wv·a), a = rmsnorm(x);
// x_out = h + Σ_k w_k · expert_k(rmsnorm(h)).
// Post-norm (OLMo-2): h = x + rmsnorm(Wo·attn(…x…)); x_out = h + rmsnorm(Σ_k w_k · expert_k(h)).
void CpuModel::layer_forward(const float* P, int l, const float* x_in, float* x_out, float aux_factor,
                             LossParts& parts) {
  const LayerOffsets& o = layout_.layers[l];
  LayerActs& a = acts_[l];
  const int64_t d = cfg_.d_model, E = cfg_.n_experts, K = cfg_.top_k;
  const float eps = static_cast<float>(cfg_.norm_eps);
  std::copy(x_in, x_in + N_ * d, a.x_in.begin());

  if (cfg_.post_norm) {
    std::copy(x_in, x_in + N_ * d, a.an1.begin());
    attention_forward_block(P, l, a.o_raw.data());
    rmsnorm_forward(a.h.data(), a.rstd1.data(), a.o_raw.data(), P + o.attn_norm, N_, d, eps);
    for (int64_t i = 0; i < N_ * d; ++i) a.h[i] += x_in[i];
    std::copy(a.h.begin(), a.h.end(), a.an2.begin());
    moe_forward_block(P, l, a.an2.data(), a.y_raw.data());
    rmsnorm_forward(x_out, a.rstd2.data(), a.y_raw.data(), P + o.moe_norm, N_, d, eps);
  } else {
    rmsnorm_forward(a.an1.data(), a.rstd1.data(), x_in, P + o.attn_norm, N_, d, eps);
    attention_forward_block(P, l, a.h.data());
    for (int64_t i = 0; i < N_ * d; ++i) a.h[i] += x_in[i];
    rmsnorm_forward(a.an2.data(), a.rstd2.data(), a.h.data(), P + o.moe_norm, N_, d, eps);
    moe_forward_block(P, l, a.an2.data(), x_out);
  }
  for (int64_t i = 0; i < N_ * d; ++i) x_out[i] += a.h[i];

  // Aux losses: LB = E/(N·K)·Σ_e s_e·count_e·mean_t p_te, RZ = mean_t lse_t².
  double lb = 0, rz = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t count = a.offsets[e + 1] - a.offsets[e];
    parts.expert_counts[l * E + e] += count;
    double psum = 0;
    for (int64_t t = 0; t < N_; ++t) psum += a.probs[t * E + e];
    const double s = own_.owns_expert(int(e)) ? aux_factor : 1.0;
    lb += s * double(count) * (psum / double(N_));
  }
  lb *= double(E) / (double(N_) * double(K));
  for (int64_t t = 0; t < N_; ++t) rz += double(a.router_lse[t]) * a.router_lse[t];
  parts.lb += lb / double(cfg_.n_layers);
  parts.router_z += rz / double(N_) / double(cfg_.n_layers);
}

// out = Wo·attn(rope(qknorm(Wq·a)), rope(qknorm(Wk·a)), Wv·a) with a = acts_[l].an1. QK-norm is an
// RMSNorm over the whole projection (OLMoE, OLMo-2) or over each head (Qwen3: rows of head_dim).
void CpuModel::attention_forward_block(const float* P, int l, float* out) {
  const LayerOffsets& o = layout_.layers[l];
  LayerActs& a = acts_[l];
  const int64_t d = cfg_.d_model, qd = cfg_.q_dim(), kv = cfg_.kv_dim(), hd = cfg_.head_dim();
  const float eps = static_cast<float>(cfg_.norm_eps);
  matmul_forward(a.q_raw.data(), a.an1.data(), P + o.wq, N_, d, qd);
  matmul_forward(a.k_raw.data(), a.an1.data(), P + o.wk, N_, d, kv);
  matmul_forward(a.v.data(), a.an1.data(), P + o.wv, N_, d, kv);
  if (cfg_.qk_norm) {
    rmsnorm_forward(a.q_n.data(), a.rstd_q.data(), a.q_raw.data(), P + o.q_norm, N_ * cfg_.q_norm_rows(),
                    cfg_.q_norm_width(), eps);
    rmsnorm_forward(a.k_n.data(), a.rstd_k.data(), a.k_raw.data(), P + o.k_norm, N_ * cfg_.k_norm_rows(),
                    cfg_.k_norm_width(), eps);
  } else {
    a.q_n = a.q_raw;
    a.k_n = a.k_raw;
  }
  rope_forward(a.q.data(), a.q_n.data(), B_, T_, cfg_.n_heads, hd, cfg_.rope_theta);
  rope_forward(a.k.data(), a.k_n.data(), B_, T_, cfg_.n_kv_heads, hd, cfg_.rope_theta);
  attention_forward(a.att.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), B_, T_, cfg_.n_heads,
                    cfg_.n_kv_heads, hd);
  matmul_forward(out, a.att.data(), P + o.wo, N_, qd, d);
}

// y = Σ_k w_k · expert_k(x): route, group tokens by expert, run each expert on its rows, combine.
void CpuModel::moe_forward_block(const float* P, int l, const float* x, float* y) {
  const LayerOffsets& o = layout_.layers[l];
  LayerActs& a = acts_[l];
  const int64_t d = cfg_.d_model, E = cfg_.n_experts, K = cfg_.top_k, Hx = cfg_.expert_hidden;
  matmul_forward(a.router_logits.data(), x, P + o.router, N_, d, E);
  router_forward(a.probs.data(), a.router_lse.data(), a.topk_idx.data(), a.topk_w.data(),
                 a.router_logits.data(), N_, E, K, cfg_.norm_topk_prob);
  moe_dispatch_indices(a.offsets.data(), a.slot_token.data(), a.token_slot.data(), a.topk_idx.data(), N_,
                       E, K);
  moe_gather_forward(a.xe.data(), x, a.slot_token.data(), S_, d);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = a.offsets[e], rows = a.offsets[e + 1] - begin;
    if (rows == 0) continue;
    const ExpertOffsets& w = layout_.experts[l][e];
    matmul_forward(a.gate.data() + begin * Hx, a.xe.data() + begin * d, P + w.gate, rows, d, Hx);
    matmul_forward(a.up.data() + begin * Hx, a.xe.data() + begin * d, P + w.up, rows, d, Hx);
    swiglu_forward(a.act.data() + begin * Hx, a.gate.data() + begin * Hx, a.up.data() + begin * Hx, rows * Hx);
    matmul_forward(a.ye.data() + begin * d, a.act.data() + begin * Hx, P + w.down, rows, Hx, d);
  }
  moe_combine_forward(y, a.ye.data(), a.topk_w.data(), a.token_slot.data(), N_, K, d);
}

LossParts CpuModel::forward(const float* P, const int32_t* inputs, const int32_t* targets,
                            const LossConfig& loss, float aux_factor) {
  (void)loss;
  const int64_t d = cfg_.d_model, V = cfg_.vocab_size;
  LossParts parts;
  parts.expert_counts.assign(cfg_.n_layers * cfg_.n_experts, 0);
  std::copy(inputs, inputs + N_, inputs_.begin());
  std::copy(targets, targets + N_, targets_.begin());

  std::vector<float>& x = d_x_;  // the residual stream between layers (scratch until backward)
  embedding_forward(x.data(), inputs, P + layout_.embed, N_, d);
  for (int l = 0; l < cfg_.n_layers; ++l) layer_forward(P, l, x.data(), x.data(), aux_factor, parts);
  std::copy(x.begin(), x.end(), x_final_.begin());

  rmsnorm_forward(fnorm_.data(), rstd_f_.data(), x_final_.data(), P + layout_.final_norm, N_, d,
                  static_cast<float>(cfg_.norm_eps));
  matmul_forward(logits_.data(), fnorm_.data(), P + layout_.lm_head, N_, d, V);
  crossentropy_forward(ce_losses_.data(), ce_lse_.data(), logits_.data(), targets, N_, V);
  double ce = 0, z = 0;
  for (int64_t t = 0; t < N_; ++t) {
    ce += ce_losses_[t];
    z += double(ce_lse_[t]) * ce_lse_[t];
  }
  parts.ce = ce / double(N_);
  parts.lm_z = z / double(N_);
  return parts;
}

void CpuModel::layer_backward(const float* P, float* G, int l, float* dx, const LossConfig& loss,
                              float aux_factor, float grad_scale) {
  const LayerOffsets& o = layout_.layers[l];
  LayerActs& a = acts_[l];
  const int64_t d = cfg_.d_model;
  // dx holds dLoss/dx_out; each branch adds to it, ending as dLoss/dx_in.
  if (cfg_.post_norm) {
    rmsnorm_backward(d_c_.data(), grad_of(G, o.moe_norm), dx, a.y_raw.data(), P + o.moe_norm, a.rstd2.data(), N_, d);
    moe_backward_block(P, G, l, d_c_.data(), loss, aux_factor, grad_scale);
    for (int64_t i = 0; i < N_ * d; ++i) dx[i] += d_a_[i];  // dx is now dLoss/dh
    rmsnorm_backward(d_c_.data(), grad_of(G, o.attn_norm), dx, a.o_raw.data(), P + o.attn_norm, a.rstd1.data(),
                     N_, d);
    attention_backward_block(P, G, l, d_c_.data());
    for (int64_t i = 0; i < N_ * d; ++i) dx[i] += d_a_[i];
    return;
  }
  moe_backward_block(P, G, l, dx, loss, aux_factor, grad_scale);
  rmsnorm_backward(d_b_.data(), grad_of(G, o.moe_norm), d_a_.data(), a.h.data(), P + o.moe_norm,
                   a.rstd2.data(), N_, d);
  for (int64_t i = 0; i < N_ * d; ++i) dx[i] += d_b_[i];  // dx is now dLoss/dh
  attention_backward_block(P, G, l, dx);
  rmsnorm_backward(d_b_.data(), grad_of(G, o.attn_norm), d_a_.data(), a.x_in.data(), P + o.attn_norm,
                   a.rstd1.data(), N_, d);
  for (int64_t i = 0; i < N_ * d; ++i) dx[i] += d_b_[i];
}

// Backward of moe_forward_block for dLoss/dy = d_y: weight gradients, and dLoss/dx in d_a_.
void CpuModel::moe_backward_block(const float* P, float* G, int l, const float* d_y, const LossConfig& loss,
                                  float aux_factor, float grad_scale) {
  const LayerOffsets& o = layout_.layers[l];
  LayerActs& a = acts_[l];
  const int64_t d = cfg_.d_model, E = cfg_.n_experts, K = cfg_.top_k, Hx = cfg_.expert_hidden, L = cfg_.n_layers;
  moe_combine_backward(d_ye_.data(), d_topk_w_.data(), d_y, a.ye.data(), a.topk_w.data(), a.token_slot.data(),
                       N_, K, d);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = a.offsets[e], rows = a.offsets[e + 1] - begin;
    if (rows == 0) continue;
    const ExpertOffsets& x = layout_.experts[l][e];
    // Frozen experts: grad_of() is null, so no weight-gradient products run.
    matmul_backward(d_act_.data() + begin * Hx, grad_of(G, x.down), d_ye_.data() + begin * d,
                    a.act.data() + begin * Hx, P + x.down, rows, Hx, d);
    swiglu_backward(d_gate_.data() + begin * Hx, d_up_.data() + begin * Hx, d_act_.data() + begin * Hx,
                    a.gate.data() + begin * Hx, a.up.data() + begin * Hx, rows * Hx);
    matmul_backward(d_xe_.data() + begin * d, grad_of(G, x.gate), d_gate_.data() + begin * Hx,
                    a.xe.data() + begin * d, P + x.gate, rows, d, Hx);
    matmul_backward(d_xe2_.data() + begin * d, grad_of(G, x.up), d_up_.data() + begin * Hx,
                    a.xe.data() + begin * d, P + x.up, rows, d, Hx);
  }
  for (int64_t i = 0; i < S_ * d; ++i) d_xe_[i] += d_xe2_[i];
  moe_gather_backward(d_a_.data(), d_xe_.data(), a.token_slot.data(), N_, K, d);

  // Router: LB is linear in p with coefficient c_e per expert; RZ via lse.
  for (int64_t e = 0; e < E; ++e) {
    const double count = double(a.offsets[e + 1] - a.offsets[e]);
    const double s = own_.owns_expert(int(e)) ? aux_factor : 1.0;
    lb_dprob_[e] = static_cast<float>(grad_scale * loss.lb_coef / double(L) * double(E) /
                                      (double(N_) * double(K)) * s * count / double(N_));
  }
  const float rz_scale = static_cast<float>(grad_scale * loss.router_z_coef / double(L) / double(N_));
  router_backward(d_logits_r_.data(), d_topk_w_.data(), a.probs.data(), a.router_lse.data(),
                  a.topk_idx.data(), a.topk_w.data(), lb_dprob_.data(), rz_scale, N_, E, K, cfg_.norm_topk_prob);
  matmul_backward(d_b_.data(), grad_of(G, o.router), d_logits_r_.data(), a.an2.data(), P + o.router, N_, d, E);
  for (int64_t i = 0; i < N_ * d; ++i) d_a_[i] += d_b_[i];
}

// Backward of attention_forward_block for dLoss/dout = d_out: weight gradients, and dLoss/d(an1) in d_a_.
void CpuModel::attention_backward_block(const float* P, float* G, int l, const float* d_out) {
  const LayerOffsets& o = layout_.layers[l];
  LayerActs& a = acts_[l];
  const int64_t d = cfg_.d_model, qd = cfg_.q_dim(), kv = cfg_.kv_dim(), hd = cfg_.head_dim();
  matmul_backward(d_att_.data(), grad_of(G, o.wo), d_out, a.att.data(), P + o.wo, N_, qd, d);
  attention_backward(d_q_.data(), d_k_.data(), d_v_.data(), d_att_.data(), a.q.data(), a.k.data(),
                     a.v.data(), a.att.data(), a.lse.data(), B_, T_, cfg_.n_heads, cfg_.n_kv_heads, hd);
  rope_backward(d_q_.data(), d_q_.data(), B_, T_, cfg_.n_heads, hd, cfg_.rope_theta);
  rope_backward(d_k_.data(), d_k_.data(), B_, T_, cfg_.n_kv_heads, hd, cfg_.rope_theta);
  if (cfg_.qk_norm) {
    // d_att_ (N·qd >= N·kv) is free here: it takes each pre-norm gradient in turn.
    rmsnorm_backward(d_att_.data(), grad_of(G, o.q_norm), d_q_.data(), a.q_raw.data(), P + o.q_norm,
                     a.rstd_q.data(), N_ * cfg_.q_norm_rows(), cfg_.q_norm_width());
    std::copy(d_att_.begin(), d_att_.begin() + N_ * qd, d_q_.begin());
    rmsnorm_backward(d_att_.data(), grad_of(G, o.k_norm), d_k_.data(), a.k_raw.data(), P + o.k_norm,
                     a.rstd_k.data(), N_ * cfg_.k_norm_rows(), cfg_.k_norm_width());
    std::copy(d_att_.begin(), d_att_.begin() + N_ * kv, d_k_.begin());
  }
  matmul_backward(d_a_.data(), grad_of(G, o.wq), d_q_.data(), a.an1.data(), P + o.wq, N_, d, qd);
  matmul_backward(d_b_.data(), grad_of(G, o.wk), d_k_.data(), a.an1.data(), P + o.wk, N_, d, kv);
  for (int64_t i = 0; i < N_ * d; ++i) d_a_[i] += d_b_[i];
  matmul_backward(d_b_.data(), grad_of(G, o.wv), d_v_.data(), a.an1.data(), P + o.wv, N_, d, kv);
  for (int64_t i = 0; i < N_ * d; ++i) d_a_[i] += d_b_[i];
}

LossParts CpuModel::forward_backward(const float* P, float* G, const int32_t* inputs, const int32_t* targets,
                                     const LossConfig& loss, float aux_factor, float grad_scale) {
  LossParts parts = forward(P, inputs, targets, loss, aux_factor);
  const int64_t d = cfg_.d_model, V = cfg_.vocab_size;
  // d(grad_scale · (CE + lm_z·ZLM)) / dlogits, written over the logits.
  crossentropy_backward(logits_.data(), logits_.data(), ce_lse_.data(), targets_.data(), N_, V,
                        static_cast<float>(grad_scale / double(N_)),
                        static_cast<float>(grad_scale * loss.lm_z_coef / double(N_)));
  matmul_backward(d_a_.data(), grad_of(G, layout_.lm_head), logits_.data(), fnorm_.data(), P + layout_.lm_head,
                  N_, d, V);
  rmsnorm_backward(d_x_.data(), grad_of(G, layout_.final_norm), d_a_.data(), x_final_.data(),
                   P + layout_.final_norm, rstd_f_.data(), N_, d);
  for (int l = int(cfg_.n_layers) - 1; l >= 0; --l) layer_backward(P, G, l, d_x_.data(), loss, aux_factor, grad_scale);
  embedding_backward(grad_of(G, layout_.embed), d_x_.data(), inputs_.data(), N_, d);
  return parts;
}

}  // namespace spes
