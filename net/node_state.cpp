#include "net/node_state.hpp"

#include "net/digest.hpp"

namespace spes::net {

uint64_t held_state_hash(const HeldRound& held, const OwnedSpace& space, const float* params, int64_t total) {
  StateHasher h;
  int64_t at = 0;
  for (const OwnedSegment& s : space.segments()) {
    h.update(params + at, s.flat.begin - at);
    h.update(held.base.data() + s.packed_begin, s.flat.size());
    at = s.flat.end;
  }
  h.update(params + at, total - at);
  return h.digest();
}

void NodeGrid::use_chunk_elems(const ParamLayout& layout, int64_t n_experts, const OwnedSpace& space,
                               int64_t chunk_elems) {
  if (grid.chunk_elems == chunk_elems) return;
  grid = make_grid(layout, n_experts, chunk_elems);
  owned.clear();
  owned_offset.assign(grid.chunks.size(), -1);
  for (const Range& r : space.ranges())
    for (int c : grid.chunks_in(r)) {
      owned_offset[c] = space.packed_offset({grid.chunks[c].begin, grid.chunks[c].end});
      owned.push_back({c, owned_offset[c]});
    }
}

}  // namespace spes::net
