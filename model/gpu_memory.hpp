// Every device buffer of a GPU node, sized from the config (DESIGN §2 "GPU memory"):
// the one source of truth for sizes. The GPU backend allocates exactly these
// buffers, in this order, from one arena; the start-up report and the "does it fit"
// check read the same list. Plain C++ (no CUDA), so it is tested and used without
// a GPU; the few sizes that only the kernels know (their scratch) come in as
// KernelScratch, filled from cuda/ by the caller.
//
// Precision (DESIGN §5): bf16 compute weights over the whole layout; fp32 master
// weights, gradients and AdamW moments for the owned segments only; frozen experts
// are bf16 weights and nothing else.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/base/arena_layout.hpp"
#include "model/layout.hpp"
#include "model/model_config.hpp"

namespace spes {

enum class MemCategory { weights, master, moments, grads, activations, workspace };
const char* mem_category_name(MemCategory c);

// Scratch the kernels size themselves (cuda/*_scratch_bytes, MoeSaved/MoeScratch).
struct KernelScratch {
  int64_t moe_saved = 0;         // per layer: MoeSaved::bytes
  int64_t moe_scratch = 0;       // shared by the layers: MoeScratch::bytes
  int64_t attention_backward = 0;
  int64_t norm_backward = 0;     // max of rmsnorm / qknorm+rope backward scratch
  int64_t embedding_backward = 0;
  int64_t global_norm = 0;
  int64_t rope_table = 0;
  int64_t gemm_workspace = 0;    // the cuBLAS(Lt) workspace (held by the device runtime, not the arena)
};

struct GpuBuffer {
  std::string name;
  MemCategory category;
  int64_t bytes = 0;
};

struct GpuMemoryPlan {
  int64_t tokens = 0;            // N = micro_batch · seq_len
  int64_t lm_chunk = 0;          // tokens per lm-head / cross-entropy chunk
  int64_t vocab_stride = 0;      // logits row stride (vocab rounded up to 8: 16-byte rows)
  int64_t frozen_weight_bytes = 0;  // the part of "weights" that is frozen experts
  int64_t runtime_workspace = 0;   // the cuBLAS(Lt) workspace, held by the device runtime
  std::vector<GpuBuffer> buffers;   // the arena's buffers, in allocation order

  int64_t bytes(MemCategory c) const;  // Σ of the category's buffers (+ the runtime's workspace)
  int64_t arena_bytes() const;         // Σ arena_slot_bytes of the buffers (engine/base/arena_layout.hpp)
  int64_t total() const { return arena_bytes() + runtime_workspace; }
  const GpuBuffer& find(const std::string& name) const;
};

// The lm head and cross-entropy run on chunks of this many tokens, so the logits of
// a 151k vocabulary never exist for the whole micro-batch at once.
int64_t lm_chunk_tokens(int64_t tokens, int64_t vocab);
// The logits' row stride: the vocabulary rounded up to 8, so every bf16 row starts on
// a 16-byte boundary: odd strides force slow, unvectorised GEMM kernels (cuda/matmul.cuh).
inline int64_t logits_row_stride(int64_t vocab) { return (vocab + 7) / 8 * 8; }

GpuMemoryPlan plan_gpu_memory(const ModelConfig& m, const ParamLayout& layout, const Ownership& own,
                              int64_t micro_batch, const KernelScratch& k);

}  // namespace spes
