// Training FLOPs per token, MFU's numerator (MFU counts only the experts a token is
// routed to). 6 × the matmul parameters one token passes through — q/k/v/o
// projections, the router, top_k of the E experts, the lm head (the embedding is a
// lookup, norms are negligible) — plus causal attention: QKᵀ and AV are 2·T·d
// multiply-adds per token and layer over the whole context, half of that under the
// causal mask, ×3 for forward and backward: 6·L·T·d.
#pragma once
#include "model/model_config.hpp"

namespace spes {

double active_matmul_params(const ModelConfig& m);
double train_flops_per_token(const ModelConfig& m);

}  // namespace spes
