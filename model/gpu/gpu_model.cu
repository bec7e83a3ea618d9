#include "model/gpu/gpu_model.cuh"

#include <algorithm>

#include "cuda/attention.cuh"
#include "cuda/check.cuh"
#include "cuda/crossentropy.cuh"
#include "cuda/embedding.cuh"
#include "cuda/grouped_gemm.cuh"
#include "cuda/loss.cuh"
#include "cuda/matmul.cuh"
#include "cuda/moe.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"
#include "cuda/router.cuh"

namespace spes {

using cuda::bf16;
using cuda::DType;

// ---- buffers -------------------------------------------------------------------------

DeviceBuffers carve_buffers(const GpuMemoryPlan& plan, cuda::DeviceArena& arena) {
  DeviceBuffers b;
  b.for_each_buffer(plan.sizes, [&]<class T>(T*& p, int64_t count, MemCategory, const char* name, int layer) {
    p = count > 0 ? static_cast<T*>(arena.alloc_bytes(gpu_buffer_name(name, layer), size_t(count) * sizeof(T)))
                  : nullptr;
  });
  return b;
}

// ---- construction ------------------------------------------------------------------

GpuModel::GpuModel(const ModelConfig& cfg, const ParamLayout& layout, const Ownership& own, const GpuSizes& sizes,
                   cuda::Runtime& rt, const DeviceBuffers& buf)
    : cfg_(cfg), layout_(layout), own_(own), B_(sizes.tokens / cfg.seq_len), T_(cfg.seq_len), N_(sizes.tokens),
      S_(sizes.slots()), V_(cfg.vocab_size), Vpad_(sizes.vocab_stride), chunk_(sizes.lm_chunk), rt_(rt),
      stream_(rt.stream()), b_(buf), embedding_scratch_bytes_(size_t(sizes.k.embedding_backward)), host_sums_(2),
      host_aux_(size_t(2 * cfg.n_layers)), host_offsets_(size_t(cfg.n_layers * (cfg.n_experts + 1))),
      host_count_scale_(size_t(cfg.n_experts)), graph_(stream_) {
  upload_expert_tables();
  cuda::rope_table_init(reinterpret_cast<float2*>(b_.rope_table), T_, cfg.head_dim(), cfg.rope_theta, stream_);
}

// Each layer's per-expert pointer tables and the trained-experts list, which the grouped
// expert GEMMs read on the device. Weights and gradients never move: written once.
// Expert e's gate and up weights are adjacent in the layout ([gate; up] is one
// [2H, d] matrix, one GEMM), and so are their gradients in owned space.
void GpuModel::upload_expert_tables() {
  const int64_t E = cfg_.n_experts, L = cfg_.n_layers, Hd = cfg_.expert_hidden * cfg_.d_model;
  cuda::PinnedBuffer<const void*> tables{size_t(4 * E * L)};
  cuda::PinnedBuffer<int32_t> trained{size_t(E)};
  n_trained_ = 0;
  for (int64_t e = 0; e < E; ++e)
    if (own_.owns_expert(int(e))) trained[size_t(n_trained_++)] = int32_t(e);
  for (int64_t l = 0; l < L; ++l) {
    const void** t = tables.data() + 4 * E * l;
    for (int64_t e = 0; e < E; ++e) {
      const ExpertOffsets& x = layout_.experts[size_t(l)][size_t(e)];
      if (x.up != x.gate + Hd) throw Error("GpuModel: expert gate and up weights are not adjacent in the layout");
      t[e] = w(x.gate);
      t[E + e] = w(x.down);
      t[2 * E + e] = grad_of(x.gate);
      t[3 * E + e] = grad_of(x.down);
    }
    const GpuLayerBuffers<bf16>& a = b_.layers[size_t(l)];
    const size_t table = size_t(E) * sizeof(void*);
    cuda_check(cudaMemcpyAsync(a.gate_up_weights, t, table, cudaMemcpyHostToDevice, stream_));
    cuda_check(cudaMemcpyAsync(a.down_weights, t + E, table, cudaMemcpyHostToDevice, stream_));
    cuda_check(cudaMemcpyAsync(a.gate_up_grads, t + 2 * E, table, cudaMemcpyHostToDevice, stream_));
    cuda_check(cudaMemcpyAsync(a.down_grads, t + 3 * E, table, cudaMemcpyHostToDevice, stream_));
  }
  cuda_check(cudaMemcpyAsync(b_.trained_experts, trained.data(), size_t(E) * sizeof(int32_t), cudaMemcpyHostToDevice,
                             stream_));
  cuda_check(cudaStreamSynchronize(stream_));  // before the pinned staging goes
}

GpuModel::~GpuModel() = default;

float* GpuModel::grad_of(int64_t offset) const {
  const int64_t i = own_.space.packed_index(offset);
  return i < 0 ? nullptr : b_.grads + i;
}

// The SPES decayed aux loss scales owned experts' LB counts (1 for the others); the
// factor changes with the step, so it is re-uploaded when it moves.
void GpuModel::set_count_scale(float aux_factor) {
  if (aux_factor == last_aux_factor_) return;
  // Pinned source, so the copy does not stall the stream; the previous copy from it
  // finished at the last micro-batch's loss read-back (a stream sync).
  for (int64_t e = 0; e < cfg_.n_experts; ++e) host_count_scale_[size_t(e)] = own_.owns_expert(int(e)) ? aux_factor : 1.0f;
  cuda_check(cudaMemcpyAsync(b_.count_scale, host_count_scale_.data(), size_t(cfg_.n_experts) * sizeof(float),
                             cudaMemcpyHostToDevice, stream_));
  last_aux_factor_ = aux_factor;
}

// ---- forward -----------------------------------------------------------------------

void GpuModel::embed_forward() {
  cuda::embedding_forward(b_.layers[0].x_in, inputs(), w(layout_.embed), N_, cfg_.d_model, V_, stream_);
}

// Pre-norm (OLMoE, Qwen3): h = x + Wo·attn(rope(qknorm(Wq·a)), rope(qknorm(Wk·a)), Wv·a), a = rmsnorm(x);
// x_out = h + Σ_k w_k · expert_k(rmsnorm(h)). The residual adds happen inside the
// next norm: x_in of layer l (l > 0) = h + moe_out of layer l − 1.
// Post-norm (OLMo-2): h = x + rmsnorm(Wo·attn(…x…)); x_out = h + rmsnorm(Σ_k w_k · expert_k(h)),
// each add fused into its norm; x_out lands in the next layer's x_in (or x_final).
void GpuModel::layer_forward(int l) {
  const LayerOffsets& o = layout_.layers[size_t(l)];
  const GpuLayerBuffers<bf16>& a = b_.layers[size_t(l)];
  const int64_t d = cfg_.d_model;
  const float eps = float(cfg_.norm_eps);

  if (cfg_.post_norm) {
    bf16* x_out = l + 1 < cfg_.n_layers ? b_.layers[size_t(l + 1)].x_in : b_.x_final;
    attention_forward_block(l, a.x_in);
    cuda::rmsnorm_post_forward(a.h, a.rstd1, a.x_in, a.attn_out, w(o.attn_norm), N_, d, eps, stream_);
    moe_forward_block(l, a.h);
    cuda::rmsnorm_post_forward(x_out, a.rstd2, a.h, a.moe_out, w(o.moe_norm), N_, d, eps, stream_);
    return;
  }
  const bf16* res_in = l == 0 ? a.x_in : b_.layers[size_t(l - 1)].h;
  const bf16* branch = l == 0 ? nullptr : b_.layers[size_t(l - 1)].moe_out;
  cuda::rmsnorm_forward(a.an1, a.rstd1, a.x_in, res_in, branch, w(o.attn_norm), N_, d, eps, stream_);
  attention_forward_block(l, a.an1);
  // h = x_in + attn_out, fused into the norm.
  cuda::rmsnorm_forward(a.an2, a.rstd2, a.h, a.x_in, a.attn_out, w(o.moe_norm), N_, d, eps, stream_);
  moe_forward_block(l, a.an2);
}

// attn_out = Wo·attn(rope(qknorm(Wq·in)), rope(qknorm(Wk·in)), Wv·in). QK-norm is an
// RMSNorm over the whole projection, before the head split (OLMoE, OLMo-2), or over
// each head (Qwen3). q and the attention output are q_dim = n_heads·head_dim wide.
void GpuModel::attention_forward_block(int l, const bf16* in) {
  const LayerOffsets& o = layout_.layers[size_t(l)];
  const GpuLayerBuffers<bf16>& a = b_.layers[size_t(l)];
  const int64_t d = cfg_.d_model, qd = cfg_.q_dim(), kv = cfg_.kv_dim(), hd = cfg_.head_dim();
  const float eps = float(cfg_.norm_eps);
  const float2* rope = reinterpret_cast<const float2*>(b_.rope_table);
  cuda::Gemm& g = rt_.gemm();
  cuda::matmul_forward(g, a.q_raw, DType::bf16, in, w(o.wq), N_, d, qd, stream_);
  cuda::matmul_forward(g, a.k_raw, DType::bf16, in, w(o.wk), N_, d, kv, stream_);
  cuda::matmul_forward(g, a.v, DType::bf16, in, w(o.wv), N_, d, kv, stream_);
  auto qknorm_rope = cfg_.qk_norm_per_head ? cuda::qknorm_head_rope_forward : cuda::qknorm_rope_forward;
  qknorm_rope(a.q, a.rstd_q, a.q_raw, w(o.q_norm), rope, B_, T_, cfg_.n_heads, hd, eps, stream_);
  qknorm_rope(a.k, a.rstd_k, a.k_raw, w(o.k_norm), rope, B_, T_, cfg_.n_kv_heads, hd, eps, stream_);
  cuda::attention_forward(a.att, a.lse, a.q, a.k, a.v, B_, T_, cfg_.n_heads, cfg_.n_kv_heads, hd, stream_);
  cuda::matmul_forward(g, a.attn_out, DType::bf16, a.att, w(o.wo), N_, qd, d, stream_);
}

// moe_out = Σ_k w_k · expert_k(x): route, group tokens by expert, run every expert on
// its rows (one grouped GEMM per product for all experts, their row ranges read on the
// device; the gate|up one forms SwiGLU's h as it stores), combine. The router's logits
// land in probs, which router_forward overwrites; the aux losses' statistics stay on
// the device.
void GpuModel::moe_forward_block(int l, const bf16* x) {
  const LayerOffsets& o = layout_.layers[size_t(l)];
  const GpuLayerBuffers<bf16>& a = b_.layers[size_t(l)];
  const int64_t d = cfg_.d_model, E = cfg_.n_experts, K = cfg_.top_k, H = cfg_.expert_hidden;
  cuda::matmul_forward(rt_.gemm(), a.probs, DType::f32, x, w(o.router), N_, d, E, stream_);
  cuda::router_forward(a.probs, a.router_lse, a.topk_idx, a.topk_w, b_.router_partials, a.probs, N_, E, K,
                       cfg_.norm_topk_prob, stream_);
  cuda::moe_dispatch_indices(a.offsets, a.slot_token, a.token_slot, b_.dispatch_scratch, a.topk_idx, N_, E, K,
                             stream_);
  cuda::router_aux_forward(a.aux, a.lb_weight, b_.router_partials, a.offsets, b_.count_scale, N_, E, K, stream_);
  cuda::moe_gather_forward(a.xe, x, a.slot_token, S_, d, stream_);
  cuda::grouped_matmul_forward_swiglu(a.gate_up, b_.expert_h, a.xe, a.gate_up_weights, a.offsets, S_, E, d, H,
                                      stream_);
  cuda::grouped_matmul_forward(a.ye, b_.expert_h, a.down_weights, a.offsets, S_, E, H, d, stream_);
  cuda::moe_combine_forward(a.moe_out, a.ye, a.topk_w, a.token_slot, N_, K, d, stream_);
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
    cuda::matmul_forward(g, b_.logits, DType::bf16, b_.fnorm + c0 * d, w(layout_.lm_head), n, d, V_, stream_, false,
                         Vpad_);
    cuda::crossentropy_forward_backward(backward ? b_.logits : nullptr, b_.ce_losses + c0, b_.ce_lse + c0, b_.logits,
                                        targets() + c0, n, V_, Vpad_, ce_scale, z_scale, stream_);
    if (!backward) continue;
    cuda::matmul_backward_input(g, b_.d_a + c0 * d, DType::bf16, b_.logits, w(layout_.lm_head), n, d, V_, stream_,
                                false, Vpad_);
    if (dw_lm) cuda::matmul_backward_weight(g, dw_lm, b_.logits, b_.fnorm + c0 * d, n, d, V_, stream_, true, Vpad_);
  }
}

LossParts GpuModel::read_loss_parts(int64_t loss_tokens) {
  const int L = int(cfg_.n_layers);
  cuda::loss_sums(b_.loss_sums, b_.ce_losses, b_.ce_lse, loss_tokens, stream_);
  cuda_check(cudaMemcpyAsync(host_sums_.data(), b_.loss_sums, 2 * sizeof(double), cudaMemcpyDeviceToHost, stream_));
  const int64_t E = cfg_.n_experts;
  for (int l = 0; l < L; ++l) {
    const GpuLayerBuffers<bf16>& a = b_.layers[size_t(l)];
    cuda_check(cudaMemcpyAsync(host_aux_.data() + 2 * l, a.aux, 2 * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    cuda_check(cudaMemcpyAsync(host_offsets_.data() + l * (E + 1), a.offsets, size_t(E + 1) * sizeof(int32_t),
                               cudaMemcpyDeviceToHost, stream_));
  }
  cuda_check(cudaStreamSynchronize(stream_));
  LossParts parts;
  parts.ce = host_sums_[0] / double(loss_tokens);
  parts.lm_z = host_sums_[1] / double(loss_tokens);
  parts.expert_counts.assign(size_t(L * E), 0);
  for (int l = 0; l < L; ++l) {
    parts.lb += double(host_aux_[size_t(2 * l)]) / double(L);
    parts.router_z += double(host_aux_[size_t(2 * l + 1)]) / double(L);
    const int32_t* off = host_offsets_.data() + l * (E + 1);
    if (off[0] != 0 || off[E] != S_) throw Error("GpuModel: the expert offsets do not cover the routed slots (kernel bug)");
    for (int64_t e = 0; e < E; ++e) parts.expert_counts[l * E + e] = off[e + 1] - off[e];
  }
  return parts;
}

// fnorm = rmsnorm(x_final). Pre-norm: x_final = h + moe_out of the last layer, fused
// into the norm; post-norm: the last layer wrote x_final.
void GpuModel::final_norm_forward() {
  const GpuLayerBuffers<bf16>& last = b_.layers.back();
  const bool post = cfg_.post_norm;
  cuda::rmsnorm_forward(b_.fnorm, b_.rstd_f, post ? nullptr : b_.x_final, post ? b_.x_final : last.h,
                        post ? nullptr : last.moe_out, w(layout_.final_norm), N_, cfg_.d_model, float(cfg_.norm_eps),
                        stream_);
}

LossParts GpuModel::forward(const LossConfig& loss, float aux_factor, int64_t loss_tokens) {
  set_count_scale(aux_factor);
  embed_forward();
  for (int l = 0; l < cfg_.n_layers; ++l) layer_forward(l);
  final_norm_forward();
  lm_head(loss, 1.0f, false);
  return read_loss_parts(loss_tokens);
}

// ---- backward ----------------------------------------------------------------------

// d_x holds dLoss/dx_out of layer l; on return, dLoss/dx_in. Pre-norm: each norm's
// backward adds its input gradient into d_x. Post-norm: d_c takes each branch's
// output gradient through its norm; the MoE input's gradient (d_a) is added to d_x
// inside the attention norm's backward, the attention input's GEMMs add into d_x.
void GpuModel::layer_backward(int l, const LossConfig& loss, float grad_scale) {
  const LayerOffsets& o = layout_.layers[size_t(l)];
  const GpuLayerBuffers<bf16>& a = b_.layers[size_t(l)];
  const int64_t d = cfg_.d_model;
  if (cfg_.post_norm) {
    cuda::rmsnorm_post_backward(b_.d_c, grad_of(o.moe_norm), b_.norm_scratch, b_.d_x, nullptr, a.moe_out,
                                w(o.moe_norm), a.rstd2, N_, d, stream_);
    moe_backward_block(l, b_.d_c, a.h, loss, grad_scale);
    cuda::rmsnorm_post_backward(b_.d_c, grad_of(o.attn_norm), b_.norm_scratch, b_.d_x, b_.d_a, a.attn_out,
                                w(o.attn_norm), a.rstd1, N_, d, stream_);  // d_x is now dLoss/dh
    attention_backward_block(l, b_.d_c, a.x_in, b_.d_x, true);  // d_x is now dLoss/dx_in
    return;
  }
  moe_backward_block(l, b_.d_x, a.an2, loss, grad_scale);
  cuda::rmsnorm_backward(b_.d_x, grad_of(o.moe_norm), b_.norm_scratch, b_.d_a, b_.d_x, a.h, w(o.moe_norm), a.rstd2,
                         N_, d, stream_);  // d_x is now dLoss/dh
  attention_backward_block(l, b_.d_x, a.an1, b_.d_a, false);
  cuda::rmsnorm_backward(b_.d_x, grad_of(o.attn_norm), b_.norm_scratch, b_.d_a, b_.d_x, a.x_in, w(o.attn_norm),
                         a.rstd1, N_, d, stream_);  // d_x is now dLoss/dx_in
}

// Backward of moe_forward_block (input x) for dLoss/dmoe_out = d_y: weight gradients,
// and dLoss/dx in d_a. The down product's backward-input computes SwiGLU's backward
// as it stores (dh never reaches memory): d_gate_up gets the gate and up gradients,
// expert_h the forward h recomputed (for the down weight gradient); d_ye gets dye,
// then dxe once dye is used. Frozen experts get no weight-gradient tiles.
void GpuModel::moe_backward_block(int l, const bf16* d_y, const bf16* x, const LossConfig& loss, float grad_scale) {
  const LayerOffsets& o = layout_.layers[size_t(l)];
  const GpuLayerBuffers<bf16>& a = b_.layers[size_t(l)];
  const int64_t d = cfg_.d_model, E = cfg_.n_experts, K = cfg_.top_k, H = cfg_.expert_hidden, L = cfg_.n_layers;
  cuda::Gemm& g = rt_.gemm();
  cuda::moe_combine_backward(b_.d_ye, b_.d_topk_w, d_y, a.ye, a.topk_w, a.token_slot, N_, K, d, stream_);
  cuda::grouped_matmul_backward_input_swiglu(b_.d_gate_up, b_.expert_h, b_.d_ye, a.down_weights, a.gate_up,
                                             a.offsets, S_, E, H, d, stream_);
  cuda::grouped_matmul_backward_weight(a.down_grads, b_.d_ye, b_.expert_h, a.offsets, b_.trained_experts, n_trained_,
                                       S_, E, H, d, stream_);
  cuda::grouped_matmul_backward_input(b_.d_ye, b_.d_gate_up, a.gate_up_weights, a.offsets, S_, E, d, 2 * H, stream_);
  cuda::grouped_matmul_backward_weight(a.gate_up_grads, b_.d_gate_up, a.xe, a.offsets, b_.trained_experts,
                                       n_trained_, S_, E, d, 2 * H, stream_);
  cuda::moe_gather_backward(b_.d_a, b_.d_ye, a.token_slot, N_, K, d, stream_);
  // The router: the layer's LB and RZ enter the loss as lb_coef/L and router_z_coef/L;
  // d_a += dlogits·Wr, dWr += dlogitsᵀ·x.
  cuda::router_backward(b_.d_router_logits, b_.d_topk_w, a.probs, a.router_lse, a.topk_idx, a.topk_w, a.lb_weight,
                        float(grad_scale * loss.lb_coef / double(L)),
                        float(grad_scale * loss.router_z_coef / double(L)) / float(N_), N_, E, K,
                        cfg_.norm_topk_prob, stream_);
  cuda::matmul_backward_input(g, b_.d_a, DType::bf16, b_.d_router_logits, w(o.router), N_, d, E, stream_, true);
  if (float* dw = grad_of(o.router)) cuda::matmul_backward_weight(g, dw, b_.d_router_logits, x, N_, d, E, stream_);
}

// Backward of attention_forward_block (input in) for dLoss/dattn_out = d_out: weight
// gradients, and dLoss/din written to d_in (accumulate: added to it).
void GpuModel::attention_backward_block(int l, const bf16* d_out, const bf16* in, bf16* d_in, bool accumulate) {
  const LayerOffsets& o = layout_.layers[size_t(l)];
  const GpuLayerBuffers<bf16>& a = b_.layers[size_t(l)];
  const int64_t d = cfg_.d_model, qd = cfg_.q_dim(), kv = cfg_.kv_dim(), hd = cfg_.head_dim();
  const float2* rope = reinterpret_cast<const float2*>(b_.rope_table);
  cuda::Gemm& g = rt_.gemm();
  cuda::matmul_backward(g, b_.d_att, grad_of(o.wo), d_out, a.att, w(o.wo), N_, qd, d, stream_);
  cuda::attention_backward(b_.d_q, b_.d_k, b_.d_v, b_.d_att, a.q, a.k, a.v, a.att, a.lse, b_.attention_scratch, B_,
                           T_, cfg_.n_heads, cfg_.n_kv_heads, hd, stream_);
  auto qknorm_rope = cfg_.qk_norm_per_head ? cuda::qknorm_head_rope_backward : cuda::qknorm_rope_backward;
  qknorm_rope(b_.d_q_raw, grad_of(o.q_norm), b_.norm_scratch, b_.d_q, a.q_raw, w(o.q_norm), a.rstd_q, rope, B_, T_,
              cfg_.n_heads, hd, stream_);
  qknorm_rope(b_.d_k_raw, grad_of(o.k_norm), b_.norm_scratch, b_.d_k, a.k_raw, w(o.k_norm), a.rstd_k, rope, B_, T_,
              cfg_.n_kv_heads, hd, stream_);
  // d_in (+)= d_q_raw·Wq + d_k_raw·Wk + d_v·Wv; each weight gradient += doutᵀ·in.
  struct Proj {
    const bf16* dout;
    int64_t offset, out;
  };
  const Proj projs[] = {{b_.d_q_raw, o.wq, qd}, {b_.d_k_raw, o.wk, kv}, {b_.d_v, o.wv, kv}};
  for (int i = 0; i < 3; ++i) {
    const Proj& p = projs[i];
    cuda::matmul_backward_input(g, d_in, DType::bf16, p.dout, w(p.offset), N_, d, p.out, stream_, accumulate || i > 0);
    if (float* dw = grad_of(p.offset)) cuda::matmul_backward_weight(g, dw, p.dout, in, N_, d, p.out, stream_);
  }
}

// A micro-batch is hundreds of launches, the same ones every time: captured as
// a CUDA graph (cuda::StreamGraph), they run back to back, not each behind the host's
// launch call. The graph freezes the loss coefficients and grad_scale, so it is
// captured anew when they change, after one micro-batch run launch by launch (which
// makes the first-use setups, GEMM plans and the like, that a capture cannot hold);
// aux_factor reaches the kernels through the count-scale buffer, copied before.
LossParts GpuModel::forward_backward(const LossConfig& loss, float aux_factor, float grad_scale) {
  set_count_scale(aux_factor);
  const GraphScalars scalars{loss, grad_scale};
  if (graph_scalars_ != scalars) {
    graph_.reset();
    graph_scalars_.reset();
    enqueue_forward_backward(loss, grad_scale);
    graph_scalars_ = scalars;  // only once that run went through: it is the warm-up
  } else {
    graph_.run([&] { enqueue_forward_backward(loss, grad_scale); });
  }
  return read_loss_parts(N_);
}

void GpuModel::enqueue_forward_backward(const LossConfig& loss, float grad_scale) {
  const int64_t d = cfg_.d_model;
  embed_forward();
  for (int l = 0; l < cfg_.n_layers; ++l) layer_forward(l);
  final_norm_forward();
  lm_head(loss, grad_scale, true);  // d_a = dLoss/dfnorm
  cuda::rmsnorm_backward(b_.d_x, grad_of(layout_.final_norm), b_.norm_scratch, b_.d_a, nullptr, b_.x_final,
                         w(layout_.final_norm), b_.rstd_f, N_, d, stream_);
  for (int l = int(cfg_.n_layers) - 1; l >= 0; --l) layer_backward(l, loss, grad_scale);
  if (float* de = grad_of(layout_.embed))
    cuda::embedding_backward(de, b_.d_x, inputs(), N_, d, V_, b_.embedding_scratch, embedding_scratch_bytes_,
                             stream_);
}

}  // namespace spes
