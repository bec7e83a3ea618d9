// The flat parameter buffer (README, Architecture: Ownership): shared parameters
// first, then one block per expert holding that expert's gate/up/down for every
// layer. Because expert blocks are expert-major, the consecutive experts a node owns
// ((p·k + i) mod E, i < k) form one contiguous range (two when they wrap past E), so
// a node's grads, optimizer state and sync payload are "shared range + one or two
// expert ranges".
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/base/enum_names.hpp"
#include "model/model_config.hpp"
#include "model/owned_space.hpp"

namespace spes {

enum class ParamKind { embedding, norm, attention, router, lm_head, expert };

struct ParamTensor {
  std::string name;        // HF OLMoE name, e.g. model.layers.0.self_attn.q_proj.weight
  int64_t offset = 0;      // first element in the flat buffer
  int64_t rows = 0;        // [rows, cols] = [out, in], as HF stores it; norms: [1, C]
  int64_t cols = 0;
  ParamKind kind = ParamKind::attention;
  int layer = -1;          // -1 for embedding, final norm, lm_head
  int expert = -1;         // -1 for shared tensors
  int64_t numel() const { return rows * cols; }
  bool is_norm() const { return kind == ParamKind::norm; }
};

// Offsets of one layer's shared tensors.
struct LayerOffsets {
  int64_t attn_norm, wq, wk, wv, wo, q_norm, k_norm, moe_norm, router;
};
// Offsets of one (layer, expert) FFN.
struct ExpertOffsets {
  int64_t gate, up, down;  // gate/up: [hidden, d_model]; down: [d_model, hidden]
};

struct ParamLayout {
  std::vector<ParamTensor> tensors;  // in buffer order
  int64_t total = 0;                 // elements in the flat buffer
  int64_t shared_count = 0;          // shared params occupy [0, shared_count)
  int64_t expert_block = 0;          // elements per expert block (all layers)
  int64_t embed = 0, final_norm = 0, lm_head = 0;  // lm_head == embed when tied
  std::vector<LayerOffsets> layers;
  std::vector<std::vector<ExpertOffsets>> experts;  // [layer][expert]

  int64_t expert_begin(int e) const { return shared_count + e * expert_block; }
  const ParamTensor* find(const std::string& name) const;
};

ParamLayout make_layout(const ModelConfig& m);

// Which experts each node owns (a table, not a formula, so "all" and replicated
// experts need no special case) and this node's
// view of it: the owned parameters (shared block + owned expert blocks) as an
// OwnedSpace, where grads, master weights and moments live packed.
struct Ownership {
  int node_id = 0;
  int n_nodes = 1;
  std::vector<std::vector<int>> owners;  // per expert: the nodes that train it
  std::vector<bool> owned;               // per expert: does this node train it
  OwnedSpace space;                      // shared block + owned expert blocks

  bool owns_expert(int e) const { return owned[e]; }
};

// How experts are spread over the nodes ([spes] ownership).
enum class OwnershipMode { partitioned, all };
inline constexpr EnumName<OwnershipMode> kOwnershipModeNames[] = {{OwnershipMode::partitioned, "partitioned"},
                                                                  {OwnershipMode::all, "all"}};

// ownership all: every node owns every expert (centralized, DiLoCo/FedAvg).
// partitioned: node p owns experts (p·k + i) mod E for i < k, k = experts_per_node
// (n_experts / n_nodes when 0), so n_nodes·k > E replicates experts.
Ownership make_ownership(const ModelConfig& m, const ParamLayout& layout, int node_id,
                         int n_nodes, OwnershipMode ownership, int64_t experts_per_node);

// A run of owned tensors that one AdamW update covers: contiguous in the flat layout
// and in owned space. With split_decay_classes, a run never mixes norms and
// embeddings (which a step may exempt from weight decay) with the other tensors.
struct AdamWRun {
  int64_t flat = 0, packed = 0, n = 0;
  bool norm_or_embedding = false;  // only set with split_decay_classes
};
std::vector<AdamWRun> adamw_runs(const ParamLayout& layout, const Ownership& own, bool split_decay_classes);

// Hash of model config + layout + ownership table: two peers agree on it iff they
// train the same parameter space (used by checkpoints and the sync protocol).
uint64_t model_fingerprint(const ModelConfig& m, const ParamLayout& layout, const Ownership& own);

// OLMo init: truncated normal (std init_std, cut at ±3σ) for every matrix, 1 for
// norms. Element i's value depends only on (seed, i), so any node, the coordinator
// and any thread count produce the same θ.
void init_parameters(float* params, const ModelConfig& m, const ParamLayout& layout, uint64_t seed);
// init_parameters for one tensor of the layout (the same values it gets there):
// e.g. a fresh router when the rest of θ comes from elsewhere (model/upcycle.hpp).
void init_tensor(float* params, const ParamTensor& t, const ModelConfig& m, uint64_t seed);

}  // namespace spes
