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
  return c == MemCategory::workspace ? s + runtime_workspace() : s;
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

std::vector<MemoryLine> memory_report(const GpuMemoryPlan& plan) {
  std::vector<MemoryLine> lines;
  for (MemCategory c : {MemCategory::weights, MemCategory::master, MemCategory::moments, MemCategory::grads,
                        MemCategory::activations, MemCategory::workspace}) {
    lines.push_back({mem_category_name(c), plan.bytes(c)});
    if (c == MemCategory::weights) lines.push_back({"  of which frozen experts", plan.frozen_weight_bytes});
  }
  lines.push_back({"total", plan.total()});
  return lines;
}

std::string gpu_buffer_name(const char* name, int layer) {
  return layer < 0 ? std::string(name) : std::string(name) + "." + std::to_string(layer);
}

int64_t lm_chunk_tokens(int64_t tokens, int64_t vocab) {
  // At most ~1 GiB of bf16 logits per chunk (but at least 128 rows), in rows that are
  // a multiple of 128. Large chunks matter: every chunk's lm-head weight-gradient GEMM
  // reads and writes the whole fp32 gradient (V × d), a fixed cost per chunk that small
  // chunks pay over few tokens (bench/RESULTS.md). The batch is split into equal
  // chunks, not full ones plus a runt.
  const int64_t max_rows = std::max<int64_t>(128, (int64_t(512) << 20) / std::max<int64_t>(vocab, 1) / 128 * 128);
  if (tokens <= max_rows) return tokens;
  const int64_t chunks = (tokens + max_rows - 1) / max_rows;
  const int64_t rows = (tokens + chunks - 1) / chunks;
  return (rows + 127) / 128 * 128;  // ≤ max_rows, since max_rows is a multiple of 128
}

GpuSizes gpu_sizes(const ModelConfig& m, const ParamLayout& layout, const Ownership& own, int64_t micro_batch,
                   const KernelScratch& k) {
  GpuSizes s;
  s.tokens = micro_batch * m.seq_len;
  s.d = m.d_model;
  s.q = m.q_dim();
  s.kv = m.kv_dim();
  s.q_norm_rows = m.q_norm_rows();
  s.k_norm_rows = m.k_norm_rows();
  s.post_norm = m.post_norm;
  s.heads = m.n_heads;
  s.layers = m.n_layers;
  s.experts = m.n_experts;
  s.top_k = m.top_k;
  s.hidden = m.expert_hidden;
  s.lm_chunk = lm_chunk_tokens(s.tokens, m.vocab_size);
  s.vocab_stride = logits_row_stride(m.vocab_size);
  s.params = layout.total;
  s.owned = own.space.size();
  s.staging = std::min<int64_t>(layout.total, int64_t(16) << 20);  // 64 MiB of fp32 per chunk at most
  s.k = k;
  return s;
}

GpuMemoryPlan plan_gpu_memory(const ModelConfig& m, const ParamLayout& layout, const Ownership& own,
                              int64_t micro_batch, const KernelScratch& k) {
  GpuMemoryPlan p;
  p.sizes = gpu_sizes(m, layout, own, micro_batch, k);
  p.frozen_weight_bytes = 2 * (layout.total - p.sizes.owned);
  GpuBuffers<uint16_t> sizing;  // bf16 storage: 2 bytes
  sizing.for_each_buffer(p.sizes, [&]<class T>(T*&, int64_t count, MemCategory c, const char* name, int layer) {
    p.buffers.push_back({gpu_buffer_name(name, layer), c, count * int64_t(sizeof(T))});
  });
  return p;
}

}  // namespace spes
