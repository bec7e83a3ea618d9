// The coordinator never applies, persists, publishes or loads a non-finite θ
// (net/README.md, What the coordinator guarantees). Finite deltas can still sum past
// the float range: with a lossy codec θ_new = θ_old + Δ, and round after round a
// large Δ walks θ to +inf.
//
// Each push is checked against θ_old: a contribution is accepted only when every
// θ_old + Δ_p is a finite float (fp32 pushes carry values, checked finite). The mean
// of such values is finite in exact arithmetic, but the coordinator sums them in an
// fp32 accumulator (net/streaming_merge), which several huge contributions can
// overflow; that, the download delta θ_new − θ_old re-quantised with the
// coordinator's error feedback, and the outer step and warm-up are checked on the
// final values at round close (net/publication, net/outer_optimizer): a chunk that
// would not be finite keeps its value, and the log says so.
#pragma once
#include <cstdint>

#include "engine/base/finite.hpp"

namespace spes::net {

// Index of the first i where θ_old[i] + Δ[i] is not a finite float, or -1.
int64_t first_overflow(const float* theta_old, const float* delta, int64_t n);

}  // namespace spes::net
