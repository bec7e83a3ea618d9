// What a node's sync client holds between rounds, shared by its pieces (the push,
// the result, the snapshot, the handshake): the round it holds with θ of that round
// over its owned parameters, and the coordinator's grid with this node's chunks in it.
#pragma once
#include <cstdint>
#include <vector>

#include "model/layout.hpp"
#include "model/owned_space.hpp"
#include "net/grid.hpp"

namespace spes::net {

// The round this node holds. round, base and residual are what its checkpoint keeps
// (SyncState); pending and force_snapshot live for one round.
struct HeldRound {
  int64_t round = 0;
  std::vector<float> base;      // owned space: θ of `round` (sync_base)
  std::vector<float> residual;  // owned space: the lossy codec's error feedback; empty for fp32
  std::vector<float> pending;   // owned space: the feedback the push in flight leaves, kept when its round lands
  // params no longer hold "θ of `round` + local work" (a result or a snapshot was
  // cut short, or a snapshot is overwriting them): the next connect asks for every chunk.
  bool force_snapshot = false;
};

// Hash of θ at the held round: params outside the owned ranges, base inside.
uint64_t held_state_hash(const HeldRound& held, const OwnedSpace& space, const float* params, int64_t total);

// A grid chunk this node owns and pushes.
struct OwnedChunk {
  int chunk;          // grid index
  int64_t owned_off;  // its offset in owned space
};

// The grid of the coordinator this node talks to (it announces the chunk size in
// its Welcome), and where this node's chunks sit in its owned space.
struct NodeGrid {
  ChunkGrid grid;
  std::vector<OwnedChunk> owned;      // the chunks this node pushes, in push order
  std::vector<int64_t> owned_offset;  // per grid chunk: its offset in owned space, or -1

  // Cuts the grid for chunk_elems, unless it already is.
  void use_chunk_elems(const ParamLayout& layout, int64_t n_experts, const OwnedSpace& space, int64_t chunk_elems);
};

}  // namespace spes::net
