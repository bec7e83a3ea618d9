// The coordinator's outer optimizer (DiLoCo, arXiv 2311.08455): the merged delta of
// a round — per parameter, the mean over its participating owners minus θ_old — is
// the outer gradient g (DiLoCo's pseudo-gradient with the sign flipped: the way the
// nodes moved), and
//   average:   θ ← θ + lr·g                                (lr 1: today's plain merge)
//   nesterov:  m ← μ·m + g;  θ ← θ + lr·(g + μ·m)           (SGD with Nesterov momentum)
// Applied only to chunks someone delivered this round: an expert whose owners all
// missed the round keeps its value *and* its momentum. It runs after the mean and
// before the expert-merging warm-up, so the momentum only ever holds the nodes'
// training progress, never the warm-up's pull between experts (which would
// otherwise echo on through the momentum after α has decayed to 0).
// Arithmetic in double, θ and m rounded to fp32 once per round (both are stored fp32).
#pragma once
#include <cstdint>
#include <string>

#include "engine/base/enum_names.hpp"

namespace spes::net {

enum class OuterKind { average, nesterov };
inline constexpr EnumName<OuterKind> kOuterKindNames[] = {{OuterKind::average, "average"},
                                                          {OuterKind::nesterov, "nesterov"}};

struct OuterOptimizer {
  OuterKind kind = OuterKind::average;
  double lr = 1.0;
  double momentum = 0.0;  // μ, nesterov only
  // average with lr 1 does nothing to the mean: skipped, so it is today's merge bit for bit.
  bool identity() const { return kind == OuterKind::average && lr == 1.0; }
  bool has_momentum() const { return kind == OuterKind::nesterov; }
};

const char* outer_kind_name(OuterKind k);

// The outer step of one contributed chunk of n params: target holds the merged mean
// θ_new and becomes the stepped θ_new; theta is θ_old; momentum (nesterov only, else
// null) is updated. All or nothing: a chunk whose step would not be finite is left at
// θ_old (target := theta) with its momentum, and the call returns false.
bool outer_step_chunk(const OuterOptimizer& o, int64_t n, const float* theta, float* target, float* momentum);

}  // namespace spes::net
