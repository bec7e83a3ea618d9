// The chunk grid: how the flat parameter buffer is cut into payload chunks.
// Segments are the shared block and each expert block (model/layout.hpp); each is
// cut into chunk_elems pieces from its start. Every node and the coordinator use
// the same grid (the coordinator announces chunk_elems in Welcome), so a chunk is
// the unit of idempotent resend and of the per-chunk participant count: a node
// whose push was cut short still counts for the chunks it delivered.
#pragma once
#include <cstdint>
#include <vector>

#include "model/layout.hpp"

namespace spes::net {

struct GridChunk {
  int64_t begin = 0, end = 0;
  int segment = 0;  // 0 = shared block, 1 + e = expert e
  int64_t size() const { return end - begin; }
};

struct ChunkGrid {
  std::vector<GridChunk> chunks;  // ascending, covering [0, total)
  int64_t total = 0;
  int64_t chunk_elems = 0;

  // Index of the chunk that is exactly [begin, end), or -1.
  int find(int64_t begin, int64_t end) const;
  // Chunks inside a range (ranges are unions of segments, so chunks never straddle).
  std::vector<int> chunks_in(const Range& r) const;
};

// Throws NetError when the segments do not cover the layout (n_experts does not match it).
ChunkGrid make_grid(const ParamLayout& layout, int64_t n_experts, int64_t chunk_elems);

}  // namespace spes::net
