#include "model/flops.hpp"

namespace spes {

double active_matmul_params(const ModelConfig& m) {
  const double d = double(m.d_model), qd = double(m.q_dim()), kv = double(m.kv_dim());
  const double attention = 2 * d * qd + 2 * d * kv;
  const double router = double(m.n_experts) * d;
  const double experts = double(m.top_k) * 3 * d * double(m.expert_hidden);
  return double(m.n_layers) * (attention + router + experts) + double(m.vocab_size) * d;
}

double train_flops_per_token(const ModelConfig& m) {
  return 6 * active_matmul_params(m) + 6 * double(m.n_layers) * double(m.seq_len) * double(m.d_model);
}

}  // namespace spes
