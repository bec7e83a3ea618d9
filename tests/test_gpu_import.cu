// Imported Hugging Face models on the GPU model against transformers: the GPU-shaped
// fixtures of tests/oracles/hf/ (*_gpu: Qwen3, Qwen3-MoE, OLMo-2, OLMoE with head_dim 32
// and widths multiples of 8; made by tests/oracles/hf_models.py) imported with
// import_hf, run through GpuModel's forward on the fixture's 16 tokens, and compared
// with transformers' fp32 logits and with our CPU forward's. GpuModel keeps the logits
// of its last lm-head chunk in its logits buffer (bf16, rows of the padded vocabulary
// stride); 16 tokens are one chunk, so after the forward that buffer holds every
// logit, and the per-token cross-entropy and logsumexp are in ce_losses / ce_lse.
// Checked per case: the logits, the per-token CE (targets: the next token) and lse,
// the mean CE and lm z-loss the GPU model reports, and (MoE) the tokens per expert.
//
// Tolerances: the fixtures' weights are bf16 values, so the GPU's bf16 compute copy is
// exactly transformers' weights; what differs is the GPU's rounding of activations to
// bf16 (u = 2^-9 ≈ 2e-3 relative per store, accumulations in fp32). About 22 stores
// lie on a logit's path (some ten per layer: norm, q/k/v, attention, its projection,
// the residual, gate/up, SwiGLU, down; the final norm; the logit itself), so a logit
// is off by about √22·u ≈ 9e-3 of its row's scale (RMS); the worst of 1024 logits,
// within 3.5 of that: 3e-2 of the largest |logit|. A per-token CE or lse moves by at
// most twice the worst logit's error (CE = lse − logit[target]; lse moves by at most
// the largest change of a logit): 6e-2 of the largest |logit|, absolute. The mean CE
// and z-loss average the per-token rounding: 5e-3 relative, as test_gpu_step's token
// means. A bug of the kinds these cases cover (a norm misplaced, RoPE's base, the
// top-k renormalization, the norms' eps) misses by several times the tolerance
// (bench/RESULTS.md: the worst mismatches measured on the emulator, mutations tried).
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "cuda/check.cuh"
#include "cuda/runtime.cuh"
#include "model/cpu/cpu_model.hpp"
#include "model/gpu/gpu_model.cuh"
#include "model/gpu/gpu_plan.hpp"
#include "model/hf_export.hpp"
#include "model/layout.hpp"
#include "tests/bf16_values.hpp"
#include "tests/gpu_test.hpp"
#include "tests/hf_fixtures.hpp"

using spes::testing::hf_fixtures;
using spes::testing::read_fixture_bin;

using namespace spes;
namespace fs = std::filesystem;

namespace {

// What a forward gives per token: logits [T, V], CE against the next token, lse; and
// the tokens each expert got per layer (our forwards only).
struct TokenOutputs {
  std::vector<float> logits, ce, lse;
  double mean_ce = 0, mean_lse_sq = 0;
  std::vector<int64_t> expert_counts;
};

// CE and lse from logits, in double (transformers' logits: the reference).
TokenOutputs from_logits(std::vector<float> logits, const std::vector<int32_t>& targets, int64_t V) {
  TokenOutputs o;
  o.logits = std::move(logits);
  const int64_t T = int64_t(targets.size());
  for (int64_t t = 0; t < T; ++t) {
    const float* row = o.logits.data() + t * V;
    const double mx = *std::max_element(row, row + V);
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(row[v]) - mx);
    const double lse = mx + std::log(sum);
    o.lse.push_back(float(lse));
    o.ce.push_back(float(lse - row[targets[size_t(t)]]));
    o.mean_ce += (lse - row[targets[size_t(t)]]) / double(T);
    o.mean_lse_sq += lse * lse / double(T);
  }
  return o;
}

TokenOutputs cpu_forward(const ModelConfig& m, const ParamLayout& layout, const Ownership& own,
                         const std::vector<float>& params, const std::vector<int32_t>& tokens,
                         const std::vector<int32_t>& targets) {
  const int64_t T = int64_t(tokens.size());
  CpuModel model(m, layout, own, 1, T);
  const LossParts parts = model.forward(params.data(), tokens.data(), targets.data(), LossConfig{});
  TokenOutputs o =
      from_logits(std::vector<float>(model.logits(), model.logits() + T * m.vocab_size), targets, m.vocab_size);
  o.expert_counts = parts.expert_counts;
  return o;
}

// GpuModel on one row of T tokens, built as the backend builds it (plan, arena, carve).
TokenOutputs gpu_forward(const ModelConfig& m, const ParamLayout& layout, const Ownership& own,
                         const std::vector<float>& params, const std::vector<int32_t>& tokens,
                         const std::vector<int32_t>& targets) {
  const int64_t T = int64_t(tokens.size()), V = m.vocab_size;
  cuda::Runtime rt(0);
  const cudaStream_t s = rt.stream();
  const GpuMemoryPlan plan = plan_gpu_node(m, layout, own, 1, current_gpu_limits());
  REQUIRE(plan.sizes.lm_chunk == T);  // one chunk: the logits buffer ends up holding every logit
  const int64_t stride = plan.sizes.vocab_stride;
  cuda::DeviceArena arena(size_t(plan.arena_bytes()), "gpu import test arena");
  const DeviceBuffers buf = carve_buffers(plan, arena);
  arena.seal(s);
  GpuModel model(m, layout, own, plan.sizes, rt, buf);
  std::vector<cuda::bf16> w(params.size());
  for (size_t i = 0; i < params.size(); ++i) w[i] = __float2bfloat16_rn(params[i]);
  cuda_check(cudaMemcpyAsync(buf.weights, w.data(), w.size() * sizeof(cuda::bf16), cudaMemcpyHostToDevice, s));
  cuda_check(cudaMemcpyAsync(model.inputs(), tokens.data(), size_t(T) * 4, cudaMemcpyHostToDevice, s));
  cuda_check(cudaMemcpyAsync(model.targets(), targets.data(), size_t(T) * 4, cudaMemcpyHostToDevice, s));
  const LossParts parts = model.forward(LossConfig{}, 1.0f, T);  // ends with a stream sync
  CHECK_NOTHROW(arena.check_guards(s));
  std::vector<cuda::bf16> logits(size_t(T * stride));
  TokenOutputs o;
  o.ce.resize(size_t(T)), o.lse.resize(size_t(T));
  cuda_check(cudaMemcpyAsync(logits.data(), buf.logits, logits.size() * sizeof(cuda::bf16), cudaMemcpyDeviceToHost, s));
  cuda_check(cudaMemcpyAsync(o.ce.data(), buf.ce_losses, size_t(T) * 4, cudaMemcpyDeviceToHost, s));
  cuda_check(cudaMemcpyAsync(o.lse.data(), buf.ce_lse, size_t(T) * 4, cudaMemcpyDeviceToHost, s));
  cuda_check(cudaStreamSynchronize(s));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < V; ++v) o.logits.push_back(__bfloat162float(logits[size_t(t * stride + v)]));
  o.mean_ce = parts.ce;
  o.mean_lse_sq = parts.lm_z;
  o.expert_counts = parts.expert_counts;
  return o;
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}

// max |a − b| (NaN: infinite, so poison left behind never passes).
double worst_abs(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::isfinite(a[i]) ? std::max(worst, double(std::fabs(a[i] - b[i]))) : INFINITY;
  return worst;
}

struct Tolerances {
  double logit = 3e-2;       // worst |logit diff| / max |reference logit|
  double token = 6e-2;       // worst per-token |CE diff| and |lse diff| / max |reference logit|
  double token_mean = 5e-3;  // mean CE and mean lse², relative
};

// One figure against its tolerance, printed as the GPU check's report reads it
// (bench/gpu_check/report.py: "rel err X (tol Y)").
void check_within(const std::string& what, double err, double tol) {
  MESSAGE(what << ": rel err " << err << " (tol " << tol << ") " << std::string(err <= tol ? "OK" : "MISMATCH"));
  CHECK_MESSAGE(err <= tol, what << ": rel err " << err << " > tol " << tol);
}

// The GPU's outputs against a reference's (transformers' or our CPU's).
void compare(const std::string& what, const TokenOutputs& gpu, const TokenOutputs& ref, const Tolerances& tol) {
  const double scale = max_abs(ref.logits);
  const std::string of_max = " (of max |logit| " + std::to_string(scale) + ")";
  check_within(what + ": worst |logit diff|" + of_max, worst_abs(gpu.logits, ref.logits) / scale, tol.logit);
  check_within(what + ": worst per-token |CE diff|" + of_max, worst_abs(gpu.ce, ref.ce) / scale, tol.token);
  check_within(what + ": worst per-token |lse diff|" + of_max, worst_abs(gpu.lse, ref.lse) / scale, tol.token);
  check_within(what + ": mean CE " + std::to_string(gpu.mean_ce) + " vs " + std::to_string(ref.mean_ce),
               std::fabs(gpu.mean_ce - ref.mean_ce) / ref.mean_ce, tol.token_mean);
  check_within(what + ": mean lse² " + std::to_string(gpu.mean_lse_sq) + " vs " + std::to_string(ref.mean_lse_sq),
               std::fabs(gpu.mean_lse_sq - ref.mean_lse_sq) / ref.mean_lse_sq, tol.token_mean);
}

}  // namespace

GPU_TEST_CASE("gpu import: imported Qwen3, Qwen3-MoE, OLMo-2 and OLMoE models give transformers' logits on the GPU model") {
  for (const std::string c : {"qwen3_gpu", "olmo2_gpu", "qwen3_moe_gpu", "olmoe_gpu"}) {
    CAPTURE(c);
    const fs::path dir = hf_fixtures() / c;
    HfModel hf = import_hf(dir.string());
    const std::vector<int32_t> tokens = read_fixture_bin<int32_t>(dir / "tokens.bin");
    std::vector<int32_t> targets(tokens.begin() + 1, tokens.end());
    targets.push_back(tokens.front());
    ModelConfig& m = hf.config;
    m.seq_len = int64_t(tokens.size());
    CHECK_NOTHROW(check_gpu_shape(m, (dir / "config.json").string()));
    // The weights are bf16 values: the GPU computes with transformers' weights exactly.
    int64_t not_bf16 = 0;
    for (float x : hf.params) not_bf16 += x != test::bf16_round(x);
    REQUIRE(not_bf16 == 0);
    const ParamLayout layout = make_layout(m);
    const Ownership own = make_ownership(m, layout, 0, 1, OwnershipMode::all, 0);
    const TokenOutputs theirs = from_logits(read_fixture_bin<float>(dir / "logits.bin"), targets, m.vocab_size);
    const TokenOutputs cpu = cpu_forward(m, layout, own, hf.params, tokens, targets);
    const TokenOutputs gpu = gpu_forward(m, layout, own, hf.params, tokens, targets);
    compare(c + " gpu vs transformers", gpu, theirs, Tolerances{});
    compare(c + " gpu vs our cpu", gpu, cpu, Tolerances{});
    // The tokens each expert got per layer, the same on both devices (the fixtures'
    // seeds keep every routing decision clear of bf16 rounding: hf_models.py,
    // MIN_ROUTER_MARGIN; a token routed elsewhere would also move its logits).
    CHECK(gpu.expert_counts == cpu.expert_counts);
    // What the case is meant to cover, as imported.
    const bool qwen3 = c.rfind("qwen3", 0) == 0;
    CHECK(m.head_dim() == 32);
    CHECK(m.n_kv_heads < m.n_heads);  // GQA
    CHECK(m.qk_norm_per_head == qwen3);
    CHECK(m.post_norm == (c == "olmo2_gpu"));
    CHECK(m.n_experts == (c.find("_moe") != std::string::npos || c == "olmoe_gpu" ? 4 : 1));
    if (c == "qwen3_gpu") {
      CHECK(m.q_dim() != m.d_model);
      CHECK(m.tie_embeddings);
      CHECK(m.rope_theta == 1e6);
    }
  }
}
