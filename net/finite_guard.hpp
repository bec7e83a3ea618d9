// The coordinator never applies, persists, publishes or loads a non-finite θ
// (DESIGN §3, issue 13). Finite deltas can still sum past the float range: with a
// lossy codec θ_new = θ_old + Δ, and round after round a large Δ walks θ to +inf.
//
// Why checking each push against θ_old is enough for the mean: a contribution is
// accepted only when every θ_old + Δ_p is a finite float (|·| ≤ FLT_MAX); the mean
// of values in [−FLT_MAX, FLT_MAX] lies in that interval too, so the merged value,
// rounded once to fp32, is finite. What the mean cannot bound — the download delta
// θ_new − θ_old re-quantised with the coordinator's error feedback, and the
// expert-merging warm-up — is checked on the final values at round close
// (net/publication), before anything is applied.
#pragma once
#include <cstdint>

namespace spes::net {

// Index of the first non-finite value of x[0, n), or -1.
int64_t first_non_finite(const float* x, int64_t n);

// Index of the first i where θ_old[i] + Δ[i] is not a finite float, or -1.
int64_t first_overflow(const float* theta_old, const float* delta, int64_t n);

}  // namespace spes::net
