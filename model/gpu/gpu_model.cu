#include "model/gpu/gpu_model.cuh"

#include <algorithm>

#include "cuda/attention.cuh"
#include "cuda/check.cuh"
#include "cuda/crossentropy.cuh"
#include "cuda/embedding.cuh"
#include "cuda/loss.cuh"
#include "cuda/matmul.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"

namespace spes {

using cuda::bf16;
using cuda::DType;

// ---- buffers -------------------------------------------------------------------------

GpuBuffers::GpuBuffers(const GpuMemoryPlan& plan, cuda::DeviceArena& arena) {
  for (const GpuBuffer& b : plan.buffers)
    at_[b.name] = {b.bytes > 0 ? arena.alloc_bytes(b.name, size_t(b.bytes)) : nullptr, b.bytes};
}

void* GpuBuffers::raw(const std::string& name) const {
  const auto it = at_.find(name);
  if (it == at_.end()) throw Error("GpuBuffers: the memory plan has no buffer '" + name + "'");
  return it->second.first;
}

int64_t GpuBuffers::bytes(const std::string& name) const {
  const auto it = at_.find(name);
  return it == at_.end() ? 0 : it->second.second;
}

void GpuModel::PinnedFree::operator()(void* p) const {
  if (p) cudaFreeHost(p);  // destructor path: nothing useful to do on error
}

// ---- construction ------------------------------------------------------------------

GpuModel::GpuModel(const ModelConfig& cfg, const ParamLayout& layout, const Ownership& own, int64_t batch,
                   cuda::Runtime& rt, const GpuMemoryPlan& plan, const GpuBuffers& buf)
    : cfg_(cfg), layout_(layout), own_(own), B_(batch), T_(cfg.seq_len), N_(batch * cfg.seq_len),
      V_(cfg.vocab_size), Vpad_(plan.vocab_stride), chunk_(plan.lm_chunk), rt_(rt), stream_(rt.stream()),
      weights_(buf.get<bf16>("weights")), grads_(buf.get<float>("grads")) {
  if (!cfg_.qk_norm)
    throw Error("the GPU model needs [model] qk_norm = true (its RoPE kernel is fused with the QK-norm)");
  if (plan.tokens != N_) throw Error("GpuModel: memory plan for another micro-batch");
  const int64_t d = cfg.d_model, E = cfg.n_experts, hd = cfg.head_dim();
  inputs_ = buf.get<int32_t>("tokens");
  targets_ = inputs_ + N_;

  const cuda::MoeShape shape{N_, d, E, cfg.top_k, cfg.expert_hidden, cfg.norm_topk_prob};
  const cuda::MoeScratch moe_scratch = cuda::MoeScratch::carve(buf.raw("moe_scratch"), shape);
  acts_.resize(cfg.n_layers);
  for (int l = 0; l < cfg.n_layers; ++l) {
    LayerActs& a = acts_[l];
    const std::string at = "." + std::to_string(l);
    a.x_in = buf.get<bf16>("x_in" + at), a.an1 = buf.get<bf16>("an1" + at);
    a.q_raw = buf.get<bf16>("q_raw" + at), a.k_raw = buf.get<bf16>("k_raw" + at), a.v = buf.get<bf16>("v" + at);
    a.q = buf.get<bf16>("q" + at), a.k = buf.get<bf16>("k" + at), a.att = buf.get<bf16>("att" + at);
    a.attn_out = buf.get<bf16>("attn_out" + at), a.h = buf.get<bf16>("h" + at), a.an2 = buf.get<bf16>("an2" + at);
    a.moe_out = buf.get<bf16>("moe_out" + at);
    a.rstd1 = buf.get<float>("rstd1" + at), a.rstd_q = buf.get<float>("rstd_q" + at);
    a.rstd_k = buf.get<float>("rstd_k" + at), a.rstd2 = buf.get<float>("rstd2" + at);
    a.att_lse = buf.get<float>("att_lse" + at);

    const LayerOffsets& o = layout_.layers[l];
    cuda::MoeWeights mw;
    cuda::MoeGrads mg;
    mw.router = w(o.router);
    mg.router = grad_of(o.router);
    for (int64_t e = 0; e < E; ++e) {
      const ExpertOffsets& x = layout_.experts[l][e];
      mw.gate.push_back(w(x.gate)), mw.up.push_back(w(x.up)), mw.down.push_back(w(x.down));
      // Frozen experts: null gradients, so the layer runs no weight-gradient GEMMs.
      mg.gate.push_back(grad_of(x.gate)), mg.up.push_back(grad_of(x.up)), mg.down.push_back(grad_of(x.down));
    }
    a.moe = std::make_unique<cuda::MoeLayer>(shape, kModelExpertGemm, std::move(mw), std::move(mg),
                                             cuda::MoeSaved::carve(buf.raw("moe" + at), shape), moe_scratch);
  }
  x_final_ = buf.get<bf16>("x_final"), fnorm_ = buf.get<bf16>("fnorm"), logits_ = buf.get<bf16>("logits");
  rstd_f_ = buf.get<float>("rstd_f"), ce_losses_ = buf.get<float>("ce_losses"), ce_lse_ = buf.get<float>("ce_lse");
  d_res_ = buf.get<bf16>("d_res"), d_a_ = buf.get<bf16>("d_a"), d_att_ = buf.get<bf16>("d_att");
  d_q_ = buf.get<bf16>("d_q"), d_q_raw_ = buf.get<bf16>("d_q_raw");
  d_k_ = buf.get<bf16>("d_k"), d_v_ = buf.get<bf16>("d_v"), d_k_raw_ = buf.get<bf16>("d_k_raw");
  attention_scratch_ = buf.raw("attention_scratch");
  norm_scratch_ = buf.raw("norm_scratch");
  embedding_scratch_ = buf.raw("embedding_scratch");
  embedding_scratch_bytes_ = size_t(buf.bytes("embedding_scratch"));
  rope_table_ = buf.get<float2>("rope_table");
  count_scale_ = buf.get<float>("count_scale");
  loss_sums_ = buf.get<double>("loss_sums");

  cuda::rope_table_init(rope_table_, T_, hd, cfg.rope_theta, stream_);
  double* hs = nullptr;
  cuda_check(cudaMallocHost(&hs, 2 * sizeof(double)));
  host_sums_.reset(hs);
  float* hc = nullptr;
  cuda_check(cudaMallocHost(&hc, size_t(E) * sizeof(float)));
  host_count_scale_.reset(hc);
  float* ha = nullptr;
  cuda_check(cudaMallocHost(&ha, size_t(2 * cfg.n_layers) * sizeof(float)));
  host_aux_.reset(ha);
}

GpuModel::~GpuModel() = default;

float* GpuModel::grad_of(int64_t offset) const {
  const int64_t i = own_.space.packed_index(offset);
  return i < 0 ? nullptr : grads_ + i;
}

// The SPES decayed aux loss scales owned experts' LB counts (1 for the others); the
// factor changes with the step, so it is re-uploaded when it moves.
void GpuModel::set_count_scale(float aux_factor) {
  if (aux_factor == last_aux_factor_) return;
  // Pinned source, so the copy does not stall the stream; the previous copy from it
  // finished at the last micro-batch's loss read-back (a stream sync).
  float* h = host_count_scale_.get();
  for (int64_t e = 0; e < cfg_.n_experts; ++e) h[e] = own_.owns_expert(int(e)) ? aux_factor : 1.0f;
  cuda_check(cudaMemcpyAsync(count_scale_, h, size_t(cfg_.n_experts) * sizeof(float), cudaMemcpyHostToDevice, stream_));
  last_aux_factor_ = aux_factor;
}

// ---- forward -----------------------------------------------------------------------

void GpuModel::embed_forward() {
  cuda::embedding_forward(acts_[0].x_in, inputs_, w(layout_.embed), N_, cfg_.d_model, V_, stream_);
}

// h = x + Wo·attn(rope(qknorm(Wq·a)), rope(qknorm(Wk·a)), Wv·a), a = rmsnorm(x);
// x_out = h + Σ_k w_k · expert_k(rmsnorm(h)). The residual adds happen inside the
// next norm: x_in of layer l (l > 0) = h + moe_out of layer l − 1.
void GpuModel::layer_forward(int l, float aux_factor) {
  const LayerOffsets& o = layout_.layers[l];
  LayerActs& a = acts_[l];
  const int64_t d = cfg_.d_model, kv = cfg_.kv_dim(), hd = cfg_.head_dim();
  const float eps = float(cfg_.norm_eps);
  cuda::Gemm& g = rt_.gemm();

  // Attention block.
  const bf16* res_in = l == 0 ? a.x_in : acts_[l - 1].h;
  const bf16* branch = l == 0 ? nullptr : acts_[l - 1].moe_out;
  cuda::rmsnorm_forward(a.an1, a.rstd1, a.x_in, res_in, branch, w(o.attn_norm), N_, d, eps, stream_);
  cuda::matmul_forward(g, a.q_raw, DType::bf16, a.an1, w(o.wq), N_, d, d, stream_);
  cuda::matmul_forward(g, a.k_raw, DType::bf16, a.an1, w(o.wk), N_, d, kv, stream_);
  cuda::matmul_forward(g, a.v, DType::bf16, a.an1, w(o.wv), N_, d, kv, stream_);
  // QK-norm is an RMSNorm over the whole projection, before the head split (OLMoE).
  cuda::qknorm_rope_forward(a.q, a.rstd_q, a.q_raw, w(o.q_norm), rope_table_, B_, T_, cfg_.n_heads, hd, eps, stream_);
  cuda::qknorm_rope_forward(a.k, a.rstd_k, a.k_raw, w(o.k_norm), rope_table_, B_, T_, cfg_.n_kv_heads, hd, eps,
                            stream_);
  cuda::attention_forward(a.att, a.att_lse, a.q, a.k, a.v, B_, T_, cfg_.n_heads, cfg_.n_kv_heads, hd, stream_);
  cuda::matmul_forward(g, a.attn_out, DType::bf16, a.att, w(o.wo), N_, d, d, stream_);

  // MoE block: h = x_in + attn_out (fused into the norm), then route, experts, combine.
  cuda::rmsnorm_forward(a.an2, a.rstd2, a.h, a.x_in, a.attn_out, w(o.moe_norm), N_, d, eps, stream_);
  set_count_scale(aux_factor);
  a.moe->forward(rt_.cublas(), a.moe_out, a.an2, count_scale_, stream_);
}

// The lm head and cross-entropy, chunk by chunk: logits = fnorm·W_lmᵀ, then the fused
// CE + z-loss kernel writes per-token losses and lse and, in training, the logit
// gradient over the logits, which the lm head's backward GEMMs consume right away.
void GpuModel::lm_head(const LossConfig& loss, float grad_scale, bool backward) {
  const int64_t d = cfg_.d_model;
  cuda::Gemm& g = rt_.gemm();
  float* dw_lm = backward ? grad_of(layout_.lm_head) : nullptr;
  // d(grad_scale · (CE + lm_z·ZLM)) / dlogits.
  const float ce_scale = float(grad_scale / double(N_));
  const float z_scale = float(grad_scale * loss.lm_z_coef / double(N_));
  for (int64_t c0 = 0; c0 < N_; c0 += chunk_) {
    const int64_t n = std::min(chunk_, N_ - c0);
    cuda::matmul_forward(g, logits_, DType::bf16, fnorm_ + c0 * d, w(layout_.lm_head), n, d, V_, stream_, false,
                         Vpad_);
    cuda::crossentropy_forward_backward(backward ? logits_ : nullptr, ce_losses_ + c0, ce_lse_ + c0, logits_,
                                        targets_ + c0, n, V_, Vpad_, ce_scale, z_scale, stream_);
    if (!backward) continue;
    cuda::matmul_backward_input(g, d_a_ + c0 * d, DType::bf16, logits_, w(layout_.lm_head), n, d, V_, stream_,
                                false, Vpad_);
    if (dw_lm) cuda::matmul_backward_weight(g, dw_lm, logits_, fnorm_ + c0 * d, n, d, V_, stream_, true, Vpad_);
  }
}

LossParts GpuModel::read_loss_parts(int64_t loss_tokens) {
  const int L = int(cfg_.n_layers);
  cuda::loss_sums(loss_sums_, ce_losses_, ce_lse_, loss_tokens, stream_);
  cuda_check(cudaMemcpyAsync(host_sums_.get(), loss_sums_, 2 * sizeof(double), cudaMemcpyDeviceToHost, stream_));
  for (int l = 0; l < L; ++l)
    cuda_check(cudaMemcpyAsync(host_aux_.get() + 2 * l, acts_[l].moe->saved().aux, 2 * sizeof(float),
                               cudaMemcpyDeviceToHost, stream_));
  cuda_check(cudaStreamSynchronize(stream_));
  LossParts parts;
  parts.ce = host_sums_.get()[0] / double(loss_tokens);
  parts.lm_z = host_sums_.get()[1] / double(loss_tokens);
  parts.expert_counts.assign(size_t(L * cfg_.n_experts), 0);
  for (int l = 0; l < L; ++l) {
    parts.lb += double(host_aux_.get()[2 * l]) / double(L);
    parts.router_z += double(host_aux_.get()[2 * l + 1]) / double(L);
    const auto off = acts_[l].moe->expert_offsets();
    for (int64_t e = 0; e < cfg_.n_experts; ++e) parts.expert_counts[l * cfg_.n_experts + e] = off[e + 1] - off[e];
  }
  return parts;
}

LossParts GpuModel::forward(const LossConfig& loss, float aux_factor, int64_t loss_tokens) {
  embed_forward();
  for (int l = 0; l < cfg_.n_layers; ++l) layer_forward(l, aux_factor);
  const LayerActs& last = acts_.back();
  cuda::rmsnorm_forward(fnorm_, rstd_f_, x_final_, last.h, last.moe_out, w(layout_.final_norm), N_, cfg_.d_model,
                        float(cfg_.norm_eps), stream_);
  lm_head(loss, 1.0f, false);
  return read_loss_parts(loss_tokens);
}

// ---- backward ----------------------------------------------------------------------

// d_res holds dLoss/dx_out of layer l (x_out = h + moe_out); on return, dLoss/dx_in.
void GpuModel::layer_backward(int l, const LossConfig& loss, float grad_scale) {
  const LayerOffsets& o = layout_.layers[l];
  LayerActs& a = acts_[l];
  const int64_t d = cfg_.d_model, kv = cfg_.kv_dim(), hd = cfg_.head_dim(), L = cfg_.n_layers;
  cuda::Gemm& g = rt_.gemm();

  // MoE branch; the layer's LB and RZ enter the loss as lb_coef/L and router_z_coef/L.
  a.moe->backward(rt_.cublas(), d_a_, d_res_, a.an2, float(grad_scale * loss.lb_coef / double(L)),
                  float(grad_scale * loss.router_z_coef / double(L)), stream_);
  cuda::rmsnorm_backward(d_res_, grad_of(o.moe_norm), norm_scratch_, d_a_, d_res_, a.h, w(o.moe_norm), a.rstd2,
                         N_, d, stream_);  // d_res is now dLoss/dh

  // Attention branch.
  cuda::matmul_backward(g, d_att_, grad_of(o.wo), d_res_, a.att, w(o.wo), N_, d, d, stream_);
  cuda::attention_backward(d_q_, d_k_, d_v_, d_att_, a.q, a.k, a.v, a.att, a.att_lse, attention_scratch_, B_, T_,
                           cfg_.n_heads, cfg_.n_kv_heads, hd, stream_);
  cuda::qknorm_rope_backward(d_q_raw_, grad_of(o.q_norm), norm_scratch_, d_q_, a.q_raw, w(o.q_norm), a.rstd_q,
                             rope_table_, B_, T_, cfg_.n_heads, hd, stream_);
  cuda::qknorm_rope_backward(d_k_raw_, grad_of(o.k_norm), norm_scratch_, d_k_, a.k_raw, w(o.k_norm), a.rstd_k,
                             rope_table_, B_, T_, cfg_.n_kv_heads, hd, stream_);
  // d_a = d_q_raw·Wq + d_k_raw·Wk + d_v·Wv; each weight gradient += doutᵀ·an1.
  struct Proj {
    const bf16* dout;
    int64_t offset, out;
  };
  const Proj projs[] = {{d_q_raw_, o.wq, d}, {d_k_raw_, o.wk, kv}, {d_v_, o.wv, kv}};
  for (int i = 0; i < 3; ++i) {
    const Proj& p = projs[i];
    cuda::matmul_backward_input(g, d_a_, DType::bf16, p.dout, w(p.offset), N_, d, p.out, stream_, i > 0);
    if (float* dw = grad_of(p.offset)) cuda::matmul_backward_weight(g, dw, p.dout, a.an1, N_, d, p.out, stream_);
  }
  cuda::rmsnorm_backward(d_res_, grad_of(o.attn_norm), norm_scratch_, d_a_, d_res_, a.x_in, w(o.attn_norm),
                         a.rstd1, N_, d, stream_);  // d_res is now dLoss/dx_in
}

LossParts GpuModel::forward_backward(const LossConfig& loss, float aux_factor, float grad_scale) {
  const int64_t d = cfg_.d_model;
  embed_forward();
  for (int l = 0; l < cfg_.n_layers; ++l) layer_forward(l, aux_factor);
  const LayerActs& last = acts_.back();
  cuda::rmsnorm_forward(fnorm_, rstd_f_, x_final_, last.h, last.moe_out, w(layout_.final_norm), N_, d,
                        float(cfg_.norm_eps), stream_);
  lm_head(loss, grad_scale, true);  // d_a = dLoss/dfnorm
  cuda::rmsnorm_backward(d_res_, grad_of(layout_.final_norm), norm_scratch_, d_a_, nullptr, x_final_,
                         w(layout_.final_norm), rstd_f_, N_, d, stream_);
  for (int l = int(cfg_.n_layers) - 1; l >= 0; --l) layer_backward(l, loss, grad_scale);
  if (float* de = grad_of(layout_.embed))
    cuda::embedding_backward(de, d_res_, inputs_, N_, d, V_, embedding_scratch_, embedding_scratch_bytes_, stream_);
  return read_loss_parts(N_);
}

}  // namespace spes
