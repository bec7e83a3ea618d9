// One round's result as it goes to every node that pushed (DESIGN §1: every node
// receives the new global θ): the grid chunks that changed, as θ_new − θ_old.
// Lossy codecs: the frames are encoded once here and shared by all recipients, and
// θ takes the *decoded* update, which is exactly what every node computes. fp32:
// θ takes the new values and the frames are built from θ as they are sent (θ holds
// exactly those values until the next round closes).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "net/codec.hpp"
#include "net/frame.hpp"
#include "net/global_state.hpp"
#include "net/grid.hpp"

namespace spes::net {

struct Publication {
  int64_t round = 0, step = 0;
  uint64_t hash = 0;
  int participants = 0;
  double alpha = 0;
  std::vector<int> chunks;          // grid chunks that changed, ascending
  std::vector<int> refused;         // chunks whose merged update was not finite: they keep their value
  std::vector<OwnedFrame> frames;   // lossy codecs: one RoundChunk frame per chunk; fp32: empty
  int64_t bytes = 0;                // all frames of the result, RoundDone included
};

// Applies round `round`'s merge result (target: θ_new per element, valid on the
// changed chunks) to s.theta and s.down_residual, and builds its publication with
// the state hash of the new θ. Only θ changes in `s`: the caller sets round, step
// and hash. A chunk whose new θ would not be finite is left as it was and listed in
// `refused` instead of `chunks`: nothing non-finite is ever applied or published.
std::shared_ptr<Publication> build_publication(Codec codec, const ChunkGrid& grid, const std::vector<bool>& changed,
                                               const float* target, GlobalState& s, int64_t round, int64_t step,
                                               int participants, double alpha);

}  // namespace spes::net
