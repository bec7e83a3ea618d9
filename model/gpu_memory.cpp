#include "model/gpu_memory.hpp"

#include <algorithm>
#include <stdexcept>

namespace spes {

const char* mem_category_name(MemCategory c) {
  switch (c) {
    case MemCategory::weights: return "compute weights (bf16)";
    case MemCategory::master: return "master weights (fp32, owned)";
    case MemCategory::moments: return "AdamW moments (fp32, owned)";
    case MemCategory::grads: return "gradients (fp32, owned)";
    case MemCategory::activations: return "activations";
    case MemCategory::workspace: return "workspace";
  }
  return "?";
}

int64_t GpuMemoryPlan::bytes(MemCategory c) const {
  int64_t s = 0;
  for (const GpuBuffer& b : buffers)
    if (b.category == c) s += b.bytes;
  return c == MemCategory::workspace ? s + runtime_workspace : s;
}

int64_t GpuMemoryPlan::arena_bytes() const {
  int64_t s = 0;
  for (const GpuBuffer& b : buffers)
    if (b.bytes > 0) s += int64_t(arena_slot_bytes(size_t(b.bytes)));
  return s;
}

const GpuBuffer& GpuMemoryPlan::find(const std::string& name) const {
  for (const GpuBuffer& b : buffers)
    if (b.name == name) return b;
  throw std::out_of_range("GpuMemoryPlan: no buffer named " + name);
}

int64_t lm_chunk_tokens(int64_t tokens, int64_t vocab) {
  // At most ~1 GiB of bf16 logits per chunk (but at least 128 rows), in rows that are
  // a multiple of 128. Large chunks matter: every chunk's lm-head weight-gradient GEMM
  // reads and writes the whole fp32 gradient (V × d), which at 768 tokens cost as much
  // as the GEMM itself (H200, bench/RESULTS.md). The batch is split into equal chunks,
  // not full ones plus a runt.
  const int64_t max_rows = std::max<int64_t>(128, (int64_t(512) << 20) / std::max<int64_t>(vocab, 1) / 128 * 128);
  if (tokens <= max_rows) return tokens;
  const int64_t chunks = (tokens + max_rows - 1) / max_rows;
  const int64_t rows = (tokens + chunks - 1) / chunks;
  return (rows + 127) / 128 * 128;  // ≤ max_rows, since max_rows is a multiple of 128
}

GpuMemoryPlan plan_gpu_memory(const ModelConfig& m, const ParamLayout& layout, const Ownership& own,
                              int64_t micro_batch, const KernelScratch& k) {
  GpuMemoryPlan p;
  const int64_t N = micro_batch * m.seq_len, d = m.d_model, kv = m.kv_dim(), L = m.n_layers;
  const int64_t owned = own.space.size();
  p.tokens = N;
  p.lm_chunk = lm_chunk_tokens(N, m.vocab_size);
  p.vocab_stride = logits_row_stride(m.vocab_size);
  p.frozen_weight_bytes = 2 * (layout.total - owned);
  p.runtime_workspace = k.gemm_workspace;
  auto add = [&](std::string name, MemCategory c, int64_t bytes) { p.buffers.push_back({std::move(name), c, bytes}); };
  const int64_t bf = 2, f32 = 4;

  // Parameters and optimizer state.
  add("weights", MemCategory::weights, bf * layout.total);
  add("master", MemCategory::master, f32 * owned);
  add("adam_m", MemCategory::moments, f32 * owned);
  add("adam_v", MemCategory::moments, f32 * owned);
  add("grads", MemCategory::grads, f32 * owned);

  // Activations kept from forward to backward, per layer (names as in the CPU model).
  for (int64_t l = 0; l < L; ++l) {
    // Per-layer buffers are named "<name>.<layer>".
    auto layer = [l](const char* name) { return std::string(name).append(".").append(std::to_string(l)); };
    for (const char* n : {"x_in", "an1", "q_raw", "q", "att", "attn_out", "h", "an2", "moe_out"})
      add(layer(n), MemCategory::activations, bf * N * d);
    for (const char* n : {"k_raw", "v", "k"}) add(layer(n), MemCategory::activations, bf * N * kv);
    for (const char* n : {"rstd1", "rstd_q", "rstd_k", "rstd2"}) add(layer(n), MemCategory::activations, f32 * N);
    add(layer("att_lse"), MemCategory::activations, f32 * N * m.n_heads);
    add(layer("moe"), MemCategory::activations, k.moe_saved);
  }
  add("x_final", MemCategory::activations, bf * N * d);
  add("fnorm", MemCategory::activations, bf * N * d);
  add("rstd_f", MemCategory::activations, f32 * N);
  add("ce_losses", MemCategory::activations, f32 * N);
  add("ce_lse", MemCategory::activations, f32 * N);
  add("logits", MemCategory::activations, bf * p.lm_chunk * p.vocab_stride);
  // Backward's activation gradients, reused by every layer.
  for (const char* n : {"d_res", "d_a", "d_att", "d_q", "d_q_raw"}) add(n, MemCategory::activations, bf * N * d);
  for (const char* n : {"d_k", "d_v", "d_k_raw"}) add(n, MemCategory::activations, bf * N * kv);

  // Kernel scratch and small state.
  add("moe_scratch", MemCategory::workspace, k.moe_scratch);
  add("attention_scratch", MemCategory::workspace, k.attention_backward);
  add("norm_scratch", MemCategory::workspace, k.norm_backward);
  add("embedding_scratch", MemCategory::workspace, k.embedding_backward);
  add("global_norm_scratch", MemCategory::workspace, k.global_norm);
  add("rope_table", MemCategory::workspace, k.rope_table);
  add("tokens", MemCategory::workspace, 2 * 4 * N);  // inputs and targets
  add("count_scale", MemCategory::workspace, f32 * m.n_experts);
  add("loss_sums", MemCategory::workspace, 8 * 2);
  add("norm_sq", MemCategory::workspace, 8);
  add("clip_scale", MemCategory::workspace, f32);
  // θ crosses PCIe in chunks through one fp32 staging buffer (sync rounds, loads).
  add("theta_staging", MemCategory::workspace, f32 * std::min<int64_t>(layout.total, int64_t(16) << 20));
  return p;
}

}  // namespace spes
