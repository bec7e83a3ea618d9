// Every device buffer of a GPU node, as one struct of typed pointers (GpuBuffers)
// with one visitor (for_each_buffer) that names each buffer and gives its element
// count: the one list that sizes the memory plan, carves the node's arena and prints
// the start-up memory report, as CpuModel::for_each_buffer does on the CPU. A typo in
// a buffer's name is then a compile error, not a failed lookup at start-up.
//
// Plain C++ (no CUDA), so `spes-engine plan` and the tests size a GPU node without a
// GPU: the struct is a template over the bf16 storage type (cuda::bf16 in the GPU
// model, uint16_t here; both 2 bytes). The few sizes only the kernels know (their
// scratch) come in as KernelScratch, filled by model/gpu/gpu_scratch.
//
// Precision (README, Architecture: "Precision and determinism"): bf16 compute weights over the whole
// layout; fp32 master weights, gradients and AdamW moments for the owned parameters
// only; frozen experts are bf16 weights and nothing else.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/base/arena_layout.hpp"
#include "model/layout.hpp"
#include "model/model_config.hpp"

namespace spes {

enum class MemCategory { weights, master, moments, grads, activations, workspace };
const char* mem_category_name(MemCategory c);

// Scratch whose size only the kernels know, in bytes (model/gpu/gpu_scratch.hpp).
struct KernelScratch {
  int64_t router_partials = 0;    // router_forward's per-warp partial sums
  int64_t moe_dispatch = 0;       // moe_dispatch_indices' counts
  int64_t attention_backward = 0;
  int64_t norm_backward = 0;      // max of rmsnorm / qknorm+rope backward scratch
  int64_t embedding_backward = 0;
  int64_t global_norm = 0;
  int64_t rope_table = 0;
  int64_t gemm_workspace = 0;     // the cuBLAS(Lt) workspace (held by the device runtime, not the arena)
};

// The sizes every buffer derives from.
struct GpuSizes {
  int64_t tokens = 0;        // N = micro_batch · seq_len
  int64_t d = 0, q = 0, kv = 0;  // d_model, the q and attention-output width, the k/v width
  int64_t q_norm_rows = 1, k_norm_rows = 1;  // QK-norm rows per token: 1, or the heads (per-head QK-norm)
  bool post_norm = false;    // OLMo-2's norm placement: no an1/an2 copies, a d_c gradient
  int64_t heads = 0, layers = 0, experts = 0, top_k = 0, hidden = 0;
  int64_t lm_chunk = 0;      // tokens per lm-head / cross-entropy chunk
  int64_t vocab_stride = 0;  // the logits' row stride
  int64_t params = 0;        // the whole layout
  int64_t owned = 0;         // owned space
  int64_t staging = 0;       // fp32 elements of the θ staging buffer
  KernelScratch k;
  int64_t slots() const { return tokens * top_k; }
};

GpuSizes gpu_sizes(const ModelConfig& m, const ParamLayout& layout, const Ownership& own, int64_t micro_batch,
                   const KernelScratch& k);

// One layer's activations, kept from forward to backward. Names as in CpuModel's
// LayerActs; where they differ, the GPU fuses: q and k are QK-normed and rotated in
// one kernel (the CPU's q_n, k_n are never stored), the residual add happens inside
// the next RMSNorm (so the attention output attn_out and the MoE output moe_out are
// kept apart from the residual h), the router logits land in probs, and the experts'
// gate and up projections are one [S, 2H] buffer gate_up, from one GEMM over the
// stacked [gate; up] weights (the layout stores them adjacent). Post-norm (OLMo-2):
// the attention and MoE blocks read x_in and h themselves (an1, an2 are empty), and
// attn_out, moe_out are the CPU's o_raw, y_raw (the inputs of the norms).
template <class Bf16>
struct GpuLayerBuffers {
  Bf16 *x_in, *an1, *q_raw, *k_raw, *v, *q, *k, *att, *attn_out, *h, *an2;
  float *rstd1, *rstd_q, *rstd_k, *lse, *rstd2;
  float *probs, *router_lse, *topk_w, *lb_weight, *aux;  // aux: this layer's LB and RZ
  int32_t *topk_idx, *offsets, *slot_token, *token_slot;
  Bf16 *xe, *gate_up, *ye, *moe_out;
  // [E] each, written once: expert e's stacked gate|up and its down weights, and their
  // gradients (null for a frozen expert), for the grouped expert GEMMs.
  const Bf16 **gate_up_weights, **down_weights;
  float **gate_up_grads, **down_grads;

  // f(T*& pointer, int64_t count, const char* name) for every buffer.
  template <class F>
  void for_each_buffer(const GpuSizes& s, F&& f) {
    const int64_t N = s.tokens, d = s.d, q_w = s.q, kv = s.kv, E = s.experts, K = s.top_k, S = s.slots(),
                  H = s.hidden, pre = s.post_norm ? 0 : 1;
    f(x_in, N * d, "x_in");
    f(an1, pre * N * d, "an1");
    f(q_raw, N * q_w, "q_raw");
    f(k_raw, N * kv, "k_raw");
    f(v, N * kv, "v");
    f(q, N * q_w, "q");
    f(k, N * kv, "k");
    f(att, N * q_w, "att");
    f(attn_out, N * d, "attn_out");
    f(h, N * d, "h");
    f(an2, pre * N * d, "an2");
    f(rstd1, N, "rstd1");
    f(rstd_q, N * s.q_norm_rows, "rstd_q");
    f(rstd_k, N * s.k_norm_rows, "rstd_k");
    f(lse, N * s.heads, "lse");
    f(rstd2, N, "rstd2");
    f(probs, N * E, "probs");
    f(router_lse, N, "router_lse");
    f(topk_w, N * K, "topk_w");
    f(lb_weight, E, "lb_weight");
    f(aux, 2, "aux");
    f(topk_idx, N * K, "topk_idx");
    f(offsets, E + 1, "offsets");
    f(slot_token, S, "slot_token");
    f(token_slot, S, "token_slot");
    f(xe, S * d, "xe");
    f(gate_up, S * 2 * H, "gate_up");
    f(ye, S * d, "ye");
    f(moe_out, N * d, "moe_out");
    f(gate_up_weights, E, "gate_up_weights");
    f(down_weights, E, "down_weights");
    f(gate_up_grads, E, "gate_up_grads");
    f(down_grads, E, "down_grads");
  }
};

template <class Bf16>
struct GpuBuffers {
  // Parameters and optimizer state.
  Bf16* weights;  // the bf16 compute copy of θ, whole layout
  float *master, *adam_m, *adam_v, *grads;  // owned space
  // Activations.
  int32_t* tokens;  // inputs, then targets: [2, N]
  std::vector<GpuLayerBuffers<Bf16>> layers;
  Bf16 *x_final, *fnorm, *logits;
  float *rstd_f, *ce_losses, *ce_lse;
  // Backward's activation gradients, reused by every layer.
  Bf16 *d_x, *d_a, *d_att, *d_q, *d_q_raw, *d_k, *d_v, *d_k_raw;
  Bf16* d_c;  // post-norm only: gradient of a branch output before its norm
  // The MoE block's temporaries, reused by every layer: h (forward), then dh and h
  // recomputed (backward); the expert outputs' gradient, then dxe; dgate_up; the
  // routing weights' and the router logits' gradients.
  Bf16 *expert_h, *d_ye, *d_gate_up, *d_router_logits;
  float* d_topk_w;
  // Kernel scratch and small state.
  float* router_partials;
  int32_t* dispatch_scratch;
  int32_t* trained_experts;  // [E]: the owned experts, whose weight gradients the GEMMs compute
  std::byte *attention_scratch, *norm_scratch, *embedding_scratch, *global_norm_scratch, *rope_table;
  float* count_scale;  // [E]: the decayed aux-loss factor on owned experts' LB counts
  double* loss_sums;   // Σ CE, Σ lse²
  double* norm_sq;     // Σ g² of the owned gradients
  float* clip_scale;   // the clipping factor AdamW reads
  float* theta_staging;  // θ crosses PCIe through it in chunks (sync rounds, loads)

  // f(T*& pointer, int64_t count, MemCategory, const char* name, int layer) for every
  // buffer, in allocation order; layer is −1 outside the layers.
  template <class F>
  void for_each_buffer(const GpuSizes& s, F&& f) {
    const int64_t N = s.tokens, d = s.d, q_w = s.q, kv = s.kv, S = s.slots(), H = s.hidden;
    auto act = [&](auto*& p, int64_t count, const char* name) { f(p, count, MemCategory::activations, name, -1); };
    auto work = [&](auto*& p, int64_t count, const char* name) { f(p, count, MemCategory::workspace, name, -1); };
    f(weights, s.params, MemCategory::weights, "weights", -1);
    f(master, s.owned, MemCategory::master, "master", -1);
    f(adam_m, s.owned, MemCategory::moments, "adam_m", -1);
    f(adam_v, s.owned, MemCategory::moments, "adam_v", -1);
    f(grads, s.owned, MemCategory::grads, "grads", -1);

    layers.resize(size_t(s.layers));
    for (int l = 0; l < int(s.layers); ++l)
      layers[size_t(l)].for_each_buffer(
          s, [&](auto*& p, int64_t count, const char* name) { f(p, count, MemCategory::activations, name, l); });
    act(x_final, N * d, "x_final");
    act(fnorm, N * d, "fnorm");
    act(rstd_f, N, "rstd_f");
    act(ce_losses, N, "ce_losses");
    act(ce_lse, N, "ce_lse");
    act(logits, s.lm_chunk * s.vocab_stride, "logits");
    act(d_x, N * d, "d_x");
    act(d_a, N * d, "d_a");
    act(d_att, N * q_w, "d_att");
    act(d_q, N * q_w, "d_q");
    act(d_q_raw, N * q_w, "d_q_raw");
    act(d_k, N * kv, "d_k");
    act(d_v, N * kv, "d_v");
    act(d_k_raw, N * kv, "d_k_raw");
    act(expert_h, S * H, "expert_h");
    act(d_ye, S * d, "d_ye");
    act(d_gate_up, S * 2 * H, "d_gate_up");
    act(d_topk_w, N * s.top_k, "d_topk_w");
    act(d_router_logits, N * s.experts, "d_router_logits");
    act(d_c, s.post_norm ? N * d : 0, "d_c");

    work(router_partials, s.k.router_partials / 4, "router_partials");
    work(dispatch_scratch, s.k.moe_dispatch / 4, "dispatch_scratch");
    work(trained_experts, s.experts, "trained_experts");
    work(attention_scratch, s.k.attention_backward, "attention_scratch");
    work(norm_scratch, s.k.norm_backward, "norm_scratch");
    work(embedding_scratch, s.k.embedding_backward, "embedding_scratch");
    work(global_norm_scratch, s.k.global_norm, "global_norm_scratch");
    work(rope_table, s.k.rope_table, "rope_table");
    work(tokens, 2 * N, "tokens");
    work(count_scale, s.experts, "count_scale");
    work(loss_sums, 2, "loss_sums");
    work(norm_sq, 1, "norm_sq");
    work(clip_scale, 1, "clip_scale");
    work(theta_staging, s.staging, "theta_staging");
  }
};

// "x_in.3" for layer 3's x_in, "logits" outside the layers: the arena's and the
// plan's name of a buffer.
std::string gpu_buffer_name(const char* name, int layer);

struct GpuBuffer {
  std::string name;
  MemCategory category;
  int64_t bytes = 0;
};

struct GpuMemoryPlan {
  GpuSizes sizes;
  int64_t frozen_weight_bytes = 0;  // the part of "weights" that is frozen experts
  std::vector<GpuBuffer> buffers;   // the arena's buffers, in allocation order

  int64_t bytes(MemCategory c) const;  // Σ of the category's buffers (+ the runtime's workspace)
  int64_t arena_bytes() const;         // Σ arena_slot_bytes of the buffers (engine/base/arena_layout.hpp)
  int64_t runtime_workspace() const { return sizes.k.gemm_workspace; }
  int64_t total() const { return arena_bytes() + runtime_workspace(); }
  const GpuBuffer& find(const std::string& name) const;
};

// The plan by category, with the frozen experts' share of the weights and the total:
// the GPU node's start-up report and `spes-engine plan`.
struct MemoryLine {
  std::string category;
  int64_t bytes = 0;
};
std::vector<MemoryLine> memory_report(const GpuMemoryPlan& plan);

// The lm head and cross-entropy run on chunks of this many tokens, so the logits of
// a 151k vocabulary never exist for the whole micro-batch at once.
int64_t lm_chunk_tokens(int64_t tokens, int64_t vocab);
// The logits' row stride: the vocabulary rounded up to 8, so every bf16 row starts on
// a 16-byte boundary: odd strides force slow, unvectorised GEMM kernels (cuda/matmul.cuh).
inline int64_t logits_row_stride(int64_t vocab) { return (vocab + 7) / 8 * 8; }

GpuMemoryPlan plan_gpu_memory(const ModelConfig& m, const ParamLayout& layout, const Ownership& own,
                              int64_t micro_batch, const KernelScratch& k);

}  // namespace spes
