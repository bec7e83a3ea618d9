#include "model/gpu/gpu_plan.hpp"

#include <algorithm>

#include "cuda/attention.cuh"
#include "cuda/check.cuh"
#include "cuda/embedding.cuh"
#include "cuda/global_norm.cuh"
#include "cuda/moe.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"
#include "cuda/router.cuh"
#include "cuda/runtime.cuh"

namespace spes {

void check_gpu_shape(const ModelConfig& m, const std::string& config_path) {
  auto refuse = [&](const std::string& why) { throw GpuShapeError(config_path + ": [model] " + why); };
  if (m.head_dim() != 32 && m.head_dim() != 64 && m.head_dim() != 128)
    refuse(std::string(m.head_dim_key ? "head_dim" : "d_model / n_heads") + " = " + std::to_string(m.head_dim()) +
           ": the GPU attention kernels support head dims 32, 64 and 128");
  if (m.d_model % 8 || m.kv_dim() % 8 || m.expert_hidden % 8)
    refuse("d_model, the kv width and expert_hidden must be multiples of 8 on the GPU (16-byte rows)");
  if (!m.qk_norm) refuse("qk_norm = false: the GPU's RoPE kernel is fused with the QK-norm");
  if (m.n_experts > cuda::kRouterMaxExperts || m.top_k > cuda::kRouterMaxTopK)
    refuse("the GPU router supports at most " + std::to_string(cuda::kRouterMaxExperts) + " experts and top_k " +
           std::to_string(cuda::kRouterMaxTopK));
  // The norms keep a row in registers: d_model's, and the q and kv widths' when the
  // QK-norm runs over the whole projection (per head, a row is head_dim ≤ 128).
  const int64_t qk_rows = std::max(m.q_norm_width(), m.k_norm_width());
  if (std::max(m.d_model, qk_rows) > cuda::kNormMaxChannels)
    refuse(std::string(m.qk_norm_per_head ? "d_model" : "d_model, the q width and the kv width") +
           " must be at most " + std::to_string(cuda::kNormMaxChannels) +
           " on the GPU (its norm kernels keep a row in registers)");
}

GpuDeviceLimits current_gpu_limits() {
  int dev = 0;
  cuda_check(cudaGetDevice(&dev));
  GpuDeviceLimits l;
  cuda_check(cudaDeviceGetAttribute(&l.sm_count, cudaDevAttrMultiProcessorCount, dev));
  cuda_check(cudaDeviceGetAttribute(&l.max_blocks_per_sm, cudaDevAttrMaxBlocksPerMultiprocessor, dev));
  l.on_device = true;
  return l;
}

KernelScratch gpu_kernel_scratch(const ModelConfig& m, int64_t micro_batch, int64_t owned,
                                 const GpuDeviceLimits& device) {
  const int64_t N = micro_batch * m.seq_len, E = m.n_experts, K = m.top_k;
  KernelScratch k;
  k.router_partials = 4 * cuda::router_partials_count(N, E);
  k.moe_dispatch = 4 * cuda::moe_dispatch_scratch_count(N, E, K);
  k.attention_backward = int64_t(cuda::attention_backward_scratch_bytes(micro_batch, m.seq_len, m.n_heads));
  // One fp32 partial row per resident block of a norm backward (rmsnorm: N rows of d;
  // qk-norm+RoPE: N rows of the q and kv widths, or per head N·heads rows of
  // head_dim): at most every block the device holds.
  const int64_t resident = int64_t(device.sm_count) * device.max_blocks_per_sm;
  auto partials = [&](int64_t rows_per_token, int64_t width) { return std::min(N * rows_per_token, resident) * width; };
  k.norm_backward = std::max({partials(1, m.d_model), partials(m.q_norm_rows(), m.q_norm_width()),
                              partials(m.k_norm_rows(), m.k_norm_width())}) *
                    4;
  // Sort keys and positions (4 arrays of N int32, 256-byte rounded) and CUB's radix
  // sort storage, about a second copy of the pairs plus histograms, without a device.
  k.embedding_backward = device.on_device ? int64_t(cuda::embedding_backward_workspace_bytes(N, m.vocab_size))
                                          : 4 * ((N * 4 + 255) / 256 * 256) + 8 * N + (int64_t(1) << 20);
  const cuda::GradSpan span{nullptr, owned};
  k.global_norm = int64_t(cuda::global_norm_scratch_bytes(&span, 1));
  k.rope_table = int64_t(cuda::rope_table_bytes(m.seq_len, m.head_dim()));
  k.gemm_workspace = int64_t(cuda::kLtWorkspaceBytes);
  return k;
}

GpuMemoryPlan plan_gpu_node(const ModelConfig& m, const ParamLayout& layout, const Ownership& own,
                            int64_t micro_batch, const GpuDeviceLimits& device) {
  return plan_gpu_memory(m, layout, own, micro_batch, gpu_kernel_scratch(m, micro_batch, own.space.size(), device));
}

}  // namespace spes
