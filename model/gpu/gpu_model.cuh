// The GPU twin of CpuModel (model/cpu/cpu_model): the same decoder (OLMoE, and the
// imported shapes: per-head QK-norm, a q width apart from d_model, OLMo-2's
// post-norm), the same order of ops and the same names, read side by side like
// llm.c's train_gpt2.c and train_gpt2.cu. What differs is only how each step runs:
//   - activations and compute weights are bf16, statistics and loss math fp32;
//   - RMSNorm is fused with the residual add that feeds it (post-norm: that it
//     feeds) (cuda/rmsnorm), QK-norm
//     with RoPE (cuda/rope); each expert product is one grouped GEMM for all experts
//     (cuda/grouped_gemm), which reads the experts' row ranges on the device, so the
//     host never waits inside a micro-batch until its loss is read back;
//   - the lm head and cross-entropy run on chunks of tokens, forward and backward
//     together, so the [tokens, vocab] logits never exist at once (cuda/crossentropy);
//   - a training micro-batch's launches are captured once as a CUDA graph and then
//     launched as one (cuda::StreamGraph), so the kernels run back to back.
// Every buffer is a field of GpuBuffers (model/gpu_memory.hpp), carved from the
// backend's arena at start-up; nothing is allocated after construction.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/runtime.cuh"
#include "model/gpu_memory.hpp"
#include "model/layout.hpp"
#include "model/loss.hpp"

namespace spes {

using DeviceBuffers = GpuBuffers<cuda::bf16>;

// The plan's buffers carved out of one arena, in the plan's order and under its names.
DeviceBuffers carve_buffers(const GpuMemoryPlan& plan, cuda::DeviceArena& arena);

class GpuModel {
 public:
  // buf: the node's buffers (the backend's arena); weights are the bf16 compute copy
  // of θ (whole layout), grads fp32 in owned space (frozen experts have none).
  GpuModel(const ModelConfig& cfg, const ParamLayout& layout, const Ownership& own, const GpuSizes& sizes,
           cuda::Runtime& rt, const DeviceBuffers& buf);
  ~GpuModel();

  // The token buffers the caller fills before a forward: [batch·seq_len] each.
  int32_t* inputs() const { return b_.tokens; }
  int32_t* targets() const { return b_.tokens + N_; }

  // Forward and loss only (eval); the CE and lm z-loss are means over the first
  // loss_tokens tokens (a padded last batch counts only its real rows; the router
  // statistics, unused in eval, include the padding).
  LossParts forward(const LossConfig& loss, float aux_factor, int64_t loss_tokens);
  // Forward, then backward of grad_scale · total loss; owned gradients accumulate
  // (+=); frozen experts get no weight gradients.
  LossParts forward_backward(const LossConfig& loss, float aux_factor, float grad_scale);
  // Whether the micro-batch's CUDA graph is held: the next forward_backward with the
  // same loss coefficients and grad_scale replays it.
  bool graph_captured() const { return graph_.captured(); }

 private:
  void embed_forward();
  void enqueue_forward_backward(const LossConfig& loss, float grad_scale);
  void layer_forward(int l);
  void attention_forward_block(int l, const cuda::bf16* in);
  void moe_forward_block(int l, const cuda::bf16* x);
  void final_norm_forward();
  void lm_head(const LossConfig& loss, float grad_scale, bool backward);
  void layer_backward(int l, const LossConfig& loss, float grad_scale);
  void moe_backward_block(int l, const cuda::bf16* d_y, const cuda::bf16* x, const LossConfig& loss, float grad_scale);
  void attention_backward_block(int l, const cuda::bf16* d_out, const cuda::bf16* in, cuda::bf16* d_in,
                                bool accumulate);
  LossParts read_loss_parts(int64_t loss_tokens);
  void set_count_scale(float aux_factor);
  void upload_expert_tables();
  float* grad_of(int64_t offset) const;
  const cuda::bf16* w(int64_t offset) const { return b_.weights + offset; }

  ModelConfig cfg_;
  ParamLayout layout_;
  Ownership own_;
  int64_t B_, T_, N_, S_, V_, Vpad_, chunk_;
  cuda::Runtime& rt_;
  cudaStream_t stream_;
  const DeviceBuffers& b_;
  size_t embedding_scratch_bytes_;
  int64_t n_trained_ = 0;  // owned experts: the weight-gradient GEMMs' list
  float last_aux_factor_ = -1.0f;
  // Pinned host copies: Σ CE and Σ lse²; LB and RZ per layer; the expert offsets per
  // layer (the load metrics); the count scale.
  cuda::PinnedBuffer<double> host_sums_;
  cuda::PinnedBuffer<float> host_aux_;
  cuda::PinnedBuffer<int32_t> host_offsets_;
  cuda::PinnedBuffer<float> host_count_scale_;
  // The micro-batch's graph, and the scalars it was captured with.
  struct GraphScalars {
    LossConfig loss;
    float grad_scale = 0.0f;
    bool operator==(const GraphScalars&) const = default;
  };
  std::optional<GraphScalars> graph_scalars_;
  cuda::StreamGraph graph_;
};

}  // namespace spes
