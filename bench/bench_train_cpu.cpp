// CPU training throughput of a config (default configs/tiny.toml): median time of
// one optimizer step (forward + backward over global_batch sequences, AdamW) on
// synthetic tokens, as tokens/s and achieved GFLOP/s (6·active params·tokens +
// causal attention).
//   bench_train_cpu [CONFIG] [--steps N] [--set section.key=value]...
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/config.hpp"
#include "engine/openmp_env.hpp"
#include "model/cpu/ops.hpp"
#include "engine/trainer.hpp"
#include "model/layout.hpp"
#include "model/cpu/cpu_model.hpp"

#include <cblas.h>
#include <omp.h>

using namespace spes;

int main(int argc, char** argv) {
  default_to_short_openmp_spin(argv);  // measure what spes-engine runs
  std::string path = std::string(SPES_SOURCE_DIR) + "/configs/tiny.toml";
  std::vector<std::string> sets = {"data.train=\"unused\""};
  int steps = 5;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) steps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--set") && i + 1 < argc) sets.push_back(argv[++i]);
    else path = argv[i];
  }
  Config c = load_config(path, sets);
  const ModelConfig& m = c.model;
  const int threads = c.train.threads > 0 ? int(c.train.threads) : omp_get_num_procs();
  omp_set_num_threads(threads);
  ParamLayout layout = make_layout(m);
  Ownership own = make_ownership(m, layout, 0, 1, OwnershipMode::all, 0);
  std::vector<float> params(layout.total), grads(own.space.size()), mom1(own.space.size()), mom2(own.space.size());
  init_parameters(params.data(), m, layout, c.train.seed);
  CpuModel model(m, layout, own, c.train.micro_batch, m.seq_len);
  std::mt19937 g(1);
  const int64_t n = c.train.micro_batch * m.seq_len;
  std::vector<int32_t> x(n), y(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = int32_t(g() % m.vocab_size);
    y[i] = int32_t(g() % m.vocab_size);
  }
  const int64_t n_micro = c.train.global_batch / c.train.micro_batch;
  auto step = [&] {
    std::fill(grads.begin(), grads.end(), 0.0f);
    for (int64_t k = 0; k < n_micro; ++k)
      model.forward_backward(params.data(), grads.data(), x.data(), y.data(), c.train.loss, 1.0f, 1.0f / n_micro);
    cpu::adamw_update(params.data(), grads.data(), mom1.data(), mom2.data(), own.space.size(), 1e-4f, 0.9f, 0.95f,
                      1e-8f, 0.1f, 1);
  };
  step();  // warm-up
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    step();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const double tokens = double(c.train.global_batch * m.seq_len);
  // Active parameters per token: everything but the embedding table and the experts
  // a token is not routed to.
  const double d = double(m.d_model), active_expert = 3.0 * d * double(m.expert_hidden) * double(m.top_k);
  const double attn_proj = d * d * 2 + 2 * d * double(m.kv_dim()) + d * double(m.n_experts);
  const double active = double(m.n_layers) * (attn_proj + active_expert) + d * double(m.vocab_size);
  const double attn_flops = double(m.n_layers) * 6.0 * 2.0 * double(m.seq_len) * d;  // causal: half of 4·T·d, ×3 for fwd+bwd
  const double flops = tokens * (6.0 * active + attn_flops);
  std::printf("bench_train_cpu: %s, %d threads, %lld params (%.2fM active/token)\n", path.c_str(), threads,
              (long long)layout.total, active / 1e6);
  std::printf("%-28s %10s %12s %10s\n", "config", "step_ms", "tokens/s", "GFLOP/s");
  std::printf("%-28s %10.1f %12.0f %10.2f\n", "median of steps", med, tokens / (med / 1e3), flops / (med / 1e3) / 1e9);
  return 0;
}
