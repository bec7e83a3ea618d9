#include "net/grid.hpp"

#include <algorithm>
#include <string>

#include "engine/base/error.hpp"

namespace spes::net {

ChunkGrid make_grid(const ParamLayout& layout, int64_t n_experts, int64_t chunk_elems) {
  ChunkGrid g;
  g.total = layout.total;
  g.chunk_elems = chunk_elems;
  auto cut = [&](int64_t b, int64_t e, int segment) {
    for (int64_t x = b; x < e; x += chunk_elems) g.chunks.push_back({x, std::min(e, x + chunk_elems), segment});
  };
  cut(0, layout.shared_count, 0);
  for (int64_t e = 0; e < n_experts; ++e)
    cut(layout.expert_begin(int(e)), layout.expert_begin(int(e)) + layout.expert_block, int(1 + e));
  // Every parameter in exactly one chunk: pushes, merges and the coordinator's state
  // file go chunk by chunk, so a parameter outside the grid would be lost silently.
  int64_t covered = 0;
  for (const GridChunk& ch : g.chunks)
    if (ch.begin == covered) covered = ch.end;
  if (covered != layout.total)
    throw NetError("the payload grid covers " + std::to_string(covered) + " of " + std::to_string(layout.total) +
                   " parameters (n_experts " + std::to_string(n_experts) + " does not match the layout?)");
  return g;
}

int ChunkGrid::find(int64_t begin, int64_t end) const {
  auto it = std::lower_bound(chunks.begin(), chunks.end(), begin,
                             [](const GridChunk& c, int64_t b) { return c.begin < b; });
  if (it == chunks.end() || it->begin != begin || it->end != end) return -1;
  return int(it - chunks.begin());
}

std::vector<int> ChunkGrid::chunks_in(const Range& r) const {
  std::vector<int> out;
  auto it = std::lower_bound(chunks.begin(), chunks.end(), r.begin,
                             [](const GridChunk& c, int64_t b) { return c.begin < b; });
  for (; it != chunks.end() && it->end <= r.end; ++it) out.push_back(int(it - chunks.begin()));
  return out;
}

}  // namespace spes::net
