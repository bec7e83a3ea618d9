// The whole GPU training step against the CPU oracle (llm.c's test_gpt2.cu): the
// same θ and micro-batches through GpuBackend and CpuBackend, then the loss parts,
// the gradient norm and every owned tensor's gradient and AdamW update compared,
// printing OK or the mismatch per tensor with its tolerance. Then the lm head over
// several chunks with a padded logits stride, 300 training steps against the CPU
// run, bitwise resume on the GPU, a GPU checkpoint evaluated on the CPU, and the
// device arena against the memory plan.
//
// The model is small but of GPU shape: d_model 128, 2 heads of 64 (the attention
// kernels take head dims 64 and 128), GQA with one kv head, 4 experts, seq 64, and a
// SPES node owning experts 2 and 3 of 4, so frozen experts are in every step. The
// imported architectures' options (Qwen3's per-head QK-norm and wide q, OLMo-2's
// post-norm) get one step each against the CPU, and their buffers the arena check.
//
// Tolerances (first calibration, from the precision of the step, not yet from a
// run): the GPU computes with bf16 activations (8-bit mantissa, relative rounding
// ≤ 2^-9 ≈ 2e-3 per value) and fp32 accumulation; the CPU is fp32 throughout. Both
// start from θ rounded to bf16, so they compute with the same weights and what
// differs is activation rounding alone. Token means (CE, z-losses) average the
// per-token rounding away: 5e-3. The loads-weighted LB moves with any token routed
// differently: 1e-2. Per-tensor gradients and updates (relative L2 error over the
// tensor): 5e-2 when every token goes to every expert (no routing decision can
// differ); with top-2 routing a token whose 2nd and 3rd router logits differ by less
// than the bf16 rounding is routed differently on the two devices (about 2e-3 of
// token-layers), which moves one rank-1 term of an expert's gradient (≈ 1/√count of
// it, ~6 % at 256 slots per expert) and a little of every upstream gradient, so the
// routed configuration allows 1e-1 for shared tensors and 3e-1 for the router and
// experts. A wrong index, transpose or scale gives errors of order 1.
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/check.cuh"
#include "cuda/runtime.cuh"
#include "engine/backend.hpp"
#include "engine/base/error.hpp"
#include "engine/checkpoint.hpp"
#include "engine/config.hpp"
#include "engine/cpu_backend.hpp"
#include "engine/gpu_backend.hpp"
#include "engine/trainer.hpp"
#include "model/cpu/cpu_model.hpp"
#include "model/gpu_memory.hpp"
#include "model/gpu/gpu_model.cuh"
#include "model/gpu/gpu_plan.hpp"
#include "model/layout.hpp"
#include "tests/bf16_values.hpp"
#include "tests/gpu_test.hpp"
#include "tests/gpu_train_util.hpp"
#include "tests/test_util.hpp"

using namespace spes;
using test::bf16_round, test::csv_rows, test::gpu_config, test::loss_columns, test::mean_loss_of_last, test::ownership_of;

namespace {

// The seeded init with norm weights spread around 1, rounded to bf16 so both
// devices compute with exactly the same weights.
std::vector<float> seeded_theta(const Config& c, const ParamLayout& layout) {
  std::vector<float> theta(size_t(layout.total));
  init_parameters(theta.data(), c.model, layout, c.train.seed);
  std::mt19937 g(17);
  std::uniform_real_distribution<float> u(0.8f, 1.2f);
  for (const ParamTensor& t : layout.tensors)
    if (t.is_norm())
      for (int64_t i = 0; i < t.numel(); ++i) theta[t.offset + i] = u(g);
  for (float& x : theta) x = bf16_round(x);
  return theta;
}

struct Batch {
  std::vector<int32_t> x, y;
};
Batch random_batch(const Config& c, int64_t rows, unsigned seed) {
  std::mt19937 g(seed);
  std::uniform_int_distribution<int> tok(0, int(c.model.vocab_size) - 1);
  Batch b;
  for (int64_t i = 0; i < rows * c.model.seq_len; ++i) b.x.push_back(tok(g)), b.y.push_back(tok(g));
  return b;
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-30); }

void check_close(const std::string& name, double gpu, double cpu, double tol) {
  const double err = rel(gpu, cpu);
  MESSAGE(name << ": gpu " << gpu << " cpu " << cpu << " rel err " << err << " (tol " << tol << ") "
                << std::string(err <= tol ? "OK" : "MISMATCH"));
  CHECK_MESSAGE(err <= tol, name << ": rel err " << err << " > tol " << tol);
}

void check_parts(const std::string& what, const LossParts& g, const LossParts& c, double ce_tol, double lb_tol) {
  check_close(what + " ce", g.ce, c.ce, ce_tol);
  check_close(what + " lm_z", g.lm_z, c.lm_z, ce_tol);
  check_close(what + " router_z", g.router_z, c.router_z, ce_tol);
  check_close(what + " lb", g.lb, c.lb, lb_tol);
}

struct StepTolerances {
  double loss = 5e-3;       // CE, lm z-loss, router z-loss (token means)
  double lb = 1e-2;         // load balancing (moves with routing)
  double grad_norm = 2e-2;  // √Σg² over the owned gradients
  double shared = 5e-2;     // per-tensor gradient / update: embeddings, norms, attention, lm head
  double routed = 5e-2;     // per-tensor gradient / update: routers and experts
  double moved_slots = 0;   // fraction of routed slots that may land on another expert
};

// One optimizer step (2 micro-batches of gradient accumulation, clipping active) on
// both devices from the same θ and moments; see the file comment for tolerances.
void compare_one_step(const Config& cfg, const StepTolerances& tol) {
  const ParamLayout layout = make_layout(cfg.model);
  const Ownership own = ownership_of(cfg, layout);
  REQUIRE_FALSE(own.owns_expert(0));  // frozen experts take part in the step
  REQUIRE(own.owns_expert(2));
  const int64_t B = cfg.train.micro_batch, T = cfg.model.seq_len, owned = own.space.size();
  const std::vector<float> theta0 = seeded_theta(cfg, layout);
  const Batch mb1 = random_batch(cfg, B, 1), mb2 = random_batch(cfg, B, 2);
  const float aux = 0.85f;  // the SPES decayed aux factor on owned experts' LB counts

  std::unique_ptr<RankBackend> gpu = make_gpu_rank(cfg, layout, own);
  CpuBackend cpu(cfg.model, cfg.train.loss, layout, own, B, cfg.train.threads);
  MESSAGE("gpu: " << gpu->describe());
  for (TrainBackend* b : {static_cast<TrainBackend*>(gpu.get()), static_cast<TrainBackend*>(&cpu)}) {
    std::copy(theta0.begin(), theta0.end(), b->host_theta().begin());
    b->push_theta();
  }

  // The CPU gradients up front, per tensor RMS, for mid-run second moments below.
  std::vector<float> g_ref(size_t(owned), 0.0f);
  {
    CpuModel ref(cfg.model, layout, own, B, T);
    ref.forward_backward(theta0.data(), g_ref.data(), mb1.x.data(), mb1.y.data(), cfg.train.loss, aux, 0.5f);
    ref.forward_backward(theta0.data(), g_ref.data(), mb2.x.data(), mb2.y.data(), cfg.train.loss, aux, 0.5f);
  }

  // ---- forward + backward, two micro-batches ----------------------------------------
  LossParts gp[2], cp[2];
  double norm_sq[2];
  TrainBackend* backends[2] = {gpu.get(), &cpu};
  for (int i = 0; i < 2; ++i) {
    TrainBackend& b = *backends[i];
    b.forward_backward(mb2.x.data(), mb2.y.data(), aux, 0.5f);  // stale gradients for zero_grads to clear
    b.zero_grads();
    LossParts* p = i == 0 ? gp : cp;
    p[0] = b.forward_backward(mb1.x.data(), mb1.y.data(), aux, 0.5f);
    p[1] = b.forward_backward(mb2.x.data(), mb2.y.data(), aux, 0.5f);
    norm_sq[i] = b.grad_sum_squares();
  }
  check_parts("micro-batch 1", gp[0], cp[0], tol.loss, tol.lb);
  check_parts("micro-batch 2", gp[1], cp[1], tol.loss, tol.lb);
  int64_t moved = 0, slots = 0;
  for (int k = 0; k < 2; ++k) {
    REQUIRE(gp[k].expert_counts.size() == cp[k].expert_counts.size());
    for (size_t j = 0; j < cp[k].expert_counts.size(); ++j) {
      moved += std::abs(gp[k].expert_counts[j] - cp[k].expert_counts[j]);
      slots += cp[k].expert_counts[j];
    }
  }
  moved /= 2;  // a slot routed elsewhere leaves one expert and joins another
  MESSAGE("routing: " << moved << " of " << slots << " routed slots on another expert (tol "
                      << tol.moved_slots * double(slots) << ")");
  CHECK(double(moved) <= tol.moved_slots * double(slots));
  const double gpu_norm = std::sqrt(norm_sq[0]), cpu_norm = std::sqrt(norm_sq[1]);
  check_close("grad norm", gpu_norm, cpu_norm, tol.grad_norm);

  // ---- AdamW with clipping active -----------------------------------------------------
  // Second moments of a run in progress (per-tensor RMS² of the clipped CPU gradient)
  // make the update a smooth function of g: from zero moments the first AdamW step
  // is lr·g/|g| elementwise, a sign, which would compare signs of near-zero entries.
  const double clip = 0.5 * cpu_norm;
  const float scale[2] = {float(clip / (gpu_norm + 1e-6)), float(clip / (cpu_norm + 1e-6))};
  std::vector<float> m0(size_t(owned), 0.0f), v0(size_t(owned), 0.0f);
  for (const ParamTensor& t : layout.tensors) {
    const int64_t g = own.space.packed_index(t.offset);
    if (g < 0) continue;
    double ss = 0;
    for (int64_t i = 0; i < t.numel(); ++i) ss += double(g_ref[g + i]) * g_ref[g + i];
    const float v = float(ss / double(t.numel()) * double(scale[1]) * double(scale[1]));
    std::fill(v0.begin() + g, v0.begin() + g + t.numel(), v);
  }
  std::vector<float> m[2], v[2];
  for (int i = 0; i < 2; ++i) {
    TrainBackend& b = *backends[i];
    b.write_moments(m0, v0);
    AdamWStep s;
    s.lr = 1e-2, s.beta1 = 0.9, s.beta2 = 0.95, s.eps = 1e-8, s.weight_decay = 0.1, s.t = 1;
    s.decay_norms_and_embeddings = false;  // the step's own setting, not the config's
    s.grad_scale = scale[i];
    REQUIRE(s.grad_scale < 1.0f);  // clipping is active
    b.optimizer_step(s);
    b.pull_theta();
    m[i].resize(size_t(owned)), v[i].resize(size_t(owned));
    b.read_moments(m[i], v[i]);
  }

  // ---- every owned tensor: gradient (from m = (1 − β1)·scale·g) and update --------------
  const std::span<float> th_gpu = gpu->host_theta(), th_cpu = cpu.host_theta();
  std::ostringstream table;
  char line[256];
  std::snprintf(line, sizeof line, "%-50s %11s %11s %8s\n", "owned tensor", "grad err", "update err", "tol");
  table << line;
  int bad = 0;
  double worst = 0;
  std::string worst_name;
  for (const ParamTensor& t : layout.tensors) {
    const int64_t g = own.space.packed_index(t.offset);
    if (g < 0) continue;
    const int64_t n = t.numel();
    const double grad_err = test::rel_error(m[0].data() + g, m[1].data() + g, n);
    std::vector<float> u_gpu(static_cast<size_t>(n)), u_cpu(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      u_gpu[i] = th_gpu[t.offset + i] - theta0[t.offset + i];
      u_cpu[i] = th_cpu[t.offset + i] - theta0[t.offset + i];
    }
    const double upd_err = test::rel_error(u_gpu.data(), u_cpu.data(), n);
    const double tl = (t.kind == ParamKind::expert || t.kind == ParamKind::router) ? tol.routed : tol.shared;
    const bool ok = grad_err <= tl && upd_err <= tl;
    std::snprintf(line, sizeof line, "%-50s %11.3e %11.3e %8.1e %s\n", t.name.c_str(), grad_err, upd_err, tl,
                  ok ? "OK" : "MISMATCH");
    table << line;
    bad += !ok;
    if (std::max(grad_err, upd_err) / tl > worst) worst = std::max(grad_err, upd_err) / tl, worst_name = t.name;
    CHECK_MESSAGE(ok, t.name << ": grad rel err " << grad_err << ", update rel err " << upd_err << " > tol " << tl);
  }
  MESSAGE("GPU vs CPU after one step:\n"
          << table.str() << (bad == 0 ? "all owned tensors OK" : std::to_string(bad) + " tensor(s) MISMATCH")
          << "; worst " << worst_name << " at " << worst << " of its tolerance");

  // Frozen experts: bit-unchanged on the host θ (no state, no update).
  for (int e = 0; e < int(cfg.model.n_experts); ++e) {
    if (own.owns_expert(e)) continue;
    const int64_t b0 = layout.expert_begin(e), b1 = layout.expert_begin(e + 1);
    CHECK_MESSAGE(std::memcmp(th_gpu.data() + b0, theta0.data() + b0, size_t(b1 - b0) * 4) == 0,
                  "frozen expert " << e << " changed on the GPU");
  }
  // That host check cannot fail on the GPU (pull_theta copies back the owned segments
  // only), so read the device's bf16 compute copy, which AdamW writes, directly: the
  // frozen experts must still hold theta0's bits (theta0 is bf16-representable).
  {
    const std::span<std::byte> wbuf = gpu->theta_buffers().at(1);  // bf16 weights, whole layout
    REQUIRE(wbuf.size() == size_t(layout.total) * 2);
    std::vector<uint16_t> w_gpu(static_cast<size_t>(layout.total));
    cudaStream_t s = nullptr;
    cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    // pull_theta ended with a sync of the backend's stream: nothing is in flight.
    cuda_check(cudaMemcpyAsync(w_gpu.data(), wbuf.data(), wbuf.size(), cudaMemcpyDeviceToHost, s));
    cuda_check(cudaStreamSynchronize(s));
    cuda_check(cudaStreamDestroy(s));
    for (int e = 0; e < int(cfg.model.n_experts); ++e) {
      if (own.owns_expert(e)) continue;
      int64_t changed = 0;
      for (int64_t i = layout.expert_begin(e); i < layout.expert_begin(e + 1); ++i) {
        uint32_t u;
        std::memcpy(&u, &theta0[size_t(i)], 4);
        changed += w_gpu[size_t(i)] != uint16_t(u >> 16);
      }
      CHECK_MESSAGE(changed == 0, "frozen expert " << e << ": " << changed << " bf16 compute weights changed on the GPU");
    }
  }

  // ---- the compute weights AdamW wrote ------------------------------------------------
  // The CPU at the GPU's θ rounded to bf16 — the compute copy AdamW should have
  // written — gives the GPU's losses (full batch and a 1-row, padded batch).
  std::vector<float> theta1(th_gpu.begin(), th_gpu.end());
  for (float& x : theta1) x = bf16_round(x);
  std::copy(theta1.begin(), theta1.end(), cpu.host_theta().begin());
  cpu.push_theta();
  const LossParts after_gpu = gpu->forward(mb1.x.data(), mb1.y.data(), B);
  check_parts("after the step", after_gpu, cpu.forward(mb1.x.data(), mb1.y.data(), B), tol.loss, tol.lb);
  // A short batch: the GPU pads it to micro_batch rows and takes CE and ZLM over the
  // real rows only. (LB and RZ come from the MoE layers over all rows, padding
  // included, so only the token-mean parts are comparable; evaluation uses CE.)
  const LossParts short_gpu = gpu->forward(mb2.x.data(), mb2.y.data(), 1),
                  short_cpu = cpu.forward(mb2.x.data(), mb2.y.data(), 1);
  check_close("after the step, 1 row ce", short_gpu.ce, short_cpu.ce, tol.loss);
  check_close("after the step, 1 row lm_z", short_gpu.lm_z, short_cpu.lm_z, tol.loss);
  // Pushing the pulled θ back rebuilds the compute copy with float_to_bf16; AdamW's
  // copy must have been the same bits, so the (deterministic) forward is unchanged.
  gpu->pull_theta();
  gpu->push_theta();
  const LossParts again = gpu->forward(mb1.x.data(), mb1.y.data(), B);
  CHECK(again.ce == after_gpu.ce);
  CHECK(again.lb == after_gpu.lb);
  CHECK(again.router_z == after_gpu.router_z);
  CHECK(again.lm_z == after_gpu.lm_z);
}

}  // namespace

// Which tensors AdamW decays, exactly: with zero gradients and zero moments the Adam
// term is 0, so a step leaves θ·(1 − lr·wd) in a decayed tensor and θ in an exempt
// one. Steps that decay every tensor (the config's default) and steps that exempt
// norms and embeddings use different groupings of the owned tensors on the GPU
// (GpuBackend's AdamW runs); in the one-step comparison above an embedding's decay is
// ~0.5 % of its update, far inside that test's tolerance. Both devices, rel 1e-6.
GPU_TEST_CASE("gpu step: AdamW decays exactly the tensors it should, in both decay modes") {
  auto dir = test::temp_dir("gpu-decay");
  const Config cfg = gpu_config(dir);
  const ParamLayout layout = make_layout(cfg.model);
  const Ownership own = ownership_of(cfg, layout);
  const std::vector<float> theta0 = seeded_theta(cfg, layout);
  const std::vector<float> zeros(size_t(own.space.size()), 0.0f);
  const float lr = 1e-2f, wd = 0.1f;
  std::unique_ptr<TrainBackend> gpu = make_gpu_rank(cfg, layout, own);
  CpuBackend cpu(cfg.model, cfg.train.loss, layout, own, cfg.train.micro_batch, cfg.train.threads);
  for (const bool decay_all : {true, false}) {
    for (TrainBackend* b : {gpu.get(), static_cast<TrainBackend*>(&cpu)}) {
      // std::string: doctest prints a const char* as an address.
      const std::string device = b == gpu.get() ? "gpu" : "cpu";
      const std::string mode = decay_all ? "every tensor" : "all but norms and embeddings";
      std::copy(theta0.begin(), theta0.end(), b->host_theta().begin());
      b->push_theta();
      b->zero_grads();
      b->write_moments(zeros, zeros);
      AdamWStep s;
      s.lr = lr, s.beta1 = 0.9, s.beta2 = 0.95, s.eps = 1e-8, s.weight_decay = wd, s.t = 3;
      s.decay_norms_and_embeddings = decay_all;
      s.grad_scale = 1.0f;
      b->optimizer_step(s);
      b->pull_theta();
      const std::span<float> th = b->host_theta();
      int bad = 0;
      for (const ParamTensor& t : layout.tensors) {
        if (own.space.packed_index(t.offset) < 0) continue;
        const bool exempt = !decay_all && (t.kind == ParamKind::norm || t.kind == ParamKind::embedding);
        const float factor = exempt ? 1.0f : 1.0f - lr * wd;
        double worst = 0;
        for (int64_t i = 0; i < t.numel(); ++i) {
          const double want = double(theta0[t.offset + i]) * factor;
          worst = std::max(worst, std::fabs(th[t.offset + i] - want) / std::max(std::fabs(want), 1e-30));
        }
        bad += worst > 1e-6;
        CHECK_MESSAGE(worst <= 1e-6, device << ", decay " << mode << ": " << t.name
                                            << std::string(exempt ? " (exempt)" : " (decayed)") << " off by " << worst);
      }
      MESSAGE(device << ", decay " << mode << ": "
                     << (bad == 0 ? std::string("every owned tensor exact") : std::to_string(bad) + " wrong"));
    }
  }
}

GPU_TEST_CASE("gpu step: one step equals the CPU's, every token routed to every expert") {
  auto dir = test::temp_dir("gpu-step-dense");
  // top_k = n_experts: no routing decision exists that bf16 rounding could flip. Large
  // auxiliary coefficients make each auxiliary loss's gradient a large share of the
  // step's, so a wrong scale on any of them shows: at lb_coef 0.05 a doubled LB gradient
  // moved the router 1.1x its tolerance, at 0.5 12x; at lm_z_coef 0.001 a doubled lm
  // z-loss gradient passed, at 0.1 it moves 33 tensors up to 7x (the emulated step's
  // worst tensor is at 0.30 of its tolerance).
  StepTolerances tol;
  compare_one_step(gpu_config(dir, {"model.top_k=4", "train.lb_coef=0.5", "train.router_z_coef=0.1",
                                    "train.lm_z_coef=0.1"}),
                   tol);
}

GPU_TEST_CASE("gpu step: one step equals the CPU's, top-2 routing") {
  StepTolerances tol;
  tol.shared = 1e-1;
  tol.routed = 3e-1;
  tol.moved_slots = 2e-2;
  // The routing weights as the top-k probabilities, and divided by their sum (renorm):
  // the router's backward differs between the two.
  for (const char* renorm : {"false", "true"}) {
    CAPTURE(renorm);
    auto dir = test::temp_dir(std::string("gpu-step-top2-renorm-") + renorm);
    compare_one_step(gpu_config(dir, {"train.lb_coef=0.05", "train.router_z_coef=0.01", "train.lm_z_coef=0.001",
                                      std::string("model.norm_topk_prob=") + renorm}),
                     tol);
  }
}

// The imported architectures' shapes (model/hf_config.cpp), small: Qwen3's per-head
// QK-norm (one weight of head_dim shared by the heads) with q wider than d_model
// (4 heads of 64 = 256 over d_model 128), GQA 2:1, rope_theta 1e6 and the lm head tied
// to the embedding; OLMo-2's
// post-norm (norms on the attention and MoE outputs, added to the residual), QK-norm
// over the whole projection; and both at once. Dense routing (top_k = n_experts), so
// the dense case's tolerances hold: a norm placed wrong, a per-head statistic taken
// over the row or a q width read as d_model gives errors of order 1.
GPU_TEST_CASE("gpu step: one step equals the CPU's for the Qwen3 and OLMo-2 shapes (per-head QK-norm, wide q, post-norm)") {
  const std::vector<std::string> dense = {"model.top_k=4", "train.lb_coef=0.5", "train.router_z_coef=0.1",
                                          "train.lm_z_coef=0.1"};
  const std::vector<std::string> qwen3 = {"model.qk_norm_per_head=true", "model.head_dim=64", "model.n_heads=4",
                                          "model.n_kv_heads=2", "model.rope_theta=1e6", "model.tie_embeddings=true"};
  const std::vector<std::string> olmo2 = {"model.post_norm=true"};
  struct Case {
    const char* name;
    std::vector<const std::vector<std::string>*> parts;
  };
  for (const Case& c : {Case{"qwen3", {&qwen3}}, Case{"olmo2", {&olmo2}}, Case{"qwen3-post-norm", {&qwen3, &olmo2}}}) {
    const std::string name = c.name;
    CAPTURE(name);
    std::vector<std::string> sets = dense;
    for (const auto* p : c.parts) sets.insert(sets.end(), p->begin(), p->end());
    auto dir = test::temp_dir("gpu-step-" + name);
    compare_one_step(gpu_config(dir, sets), StepTolerances{});
  }
}

// The lm head and cross-entropy over several chunks with a padded logits row stride —
// what every real vocabulary runs (V = 151 665: stride 151 672, a 16384-token
// micro-batch in 5 chunks of up to 3328 tokens).
// The test model's vocabulary of 256 runs as one unpadded chunk, so the cases above
// never offset fnorm / targets / losses / d_a by a chunk, nor pad a logits row. Here
// the GpuModel is built directly with V = 300 (stride 304) and a 96-token chunk
// (256 tokens: chunks of 96, 96 and 64), and one micro-batch's loss parts and every
// owned gradient are compared with the CPU's. Dense routing (top_k = n_experts), so
// the tolerances are the dense case's: 5e-3 for token means, 5e-2 per tensor.
GPU_TEST_CASE("gpu model: chunked lm head with a padded logits stride equals the CPU") {
  auto dir = test::temp_dir("gpu-lm-chunks");
  const Config cfg = gpu_config(dir, {"model.vocab_size=300", "model.top_k=4", "train.lb_coef=0.05",
                                      "train.router_z_coef=0.01", "train.lm_z_coef=0.001"});
  const ParamLayout layout = make_layout(cfg.model);
  const Ownership own = ownership_of(cfg, layout);
  const int64_t B = cfg.train.micro_batch, N = B * cfg.model.seq_len, owned = own.space.size();
  cuda::Runtime rt(0);
  const cudaStream_t s = rt.stream();
  GpuMemoryPlan plan =
      plan_gpu_node(cfg.model, layout, own, B, current_gpu_limits());
  REQUIRE(plan.sizes.vocab_stride == 304);
  REQUIRE(plan.sizes.lm_chunk == N);  // planned as one chunk: its logits buffer holds any smaller one
  // bf16 logits of a planned chunk (N tokens) at the padded stride: the kernels write
  // rows of vocab_stride, and a buffer sized by the vocabulary would overrun into the
  // next buffer of the arena, which no test of values would see (its guard would).
  CHECK(plan.find("logits").bytes == 2 * N * plan.sizes.vocab_stride);
  cuda::DeviceArena arena(size_t(plan.arena_bytes()), "chunked lm head test arena");
  const DeviceBuffers buf = carve_buffers(plan, arena);
  arena.seal(s);
  GpuSizes sizes = plan.sizes;
  sizes.lm_chunk = 96;
  GpuModel model(cfg.model, layout, own, sizes, rt, buf);

  const std::vector<float> theta = seeded_theta(cfg, layout);  // bf16 values: both devices use the same weights
  std::vector<cuda::bf16> w(theta.size());
  for (size_t i = 0; i < theta.size(); ++i) w[i] = __float2bfloat16_rn(theta[i]);
  const Batch mb = random_batch(cfg, B, 3);
  cuda_check(cudaMemcpyAsync(buf.weights, w.data(), w.size() * sizeof(cuda::bf16),
                             cudaMemcpyHostToDevice, s));
  cuda_check(cudaMemsetAsync(buf.grads, 0, size_t(owned) * sizeof(float), s));
  cuda_check(cudaMemcpyAsync(model.inputs(), mb.x.data(), size_t(N) * 4, cudaMemcpyHostToDevice, s));
  cuda_check(cudaMemcpyAsync(model.targets(), mb.y.data(), size_t(N) * 4, cudaMemcpyHostToDevice, s));
  const LossParts gp = model.forward_backward(cfg.train.loss, 1.0f, 1.0f);  // ends with a stream sync
  CHECK_NOTHROW(arena.check_guards(s));  // no kernel of the step wrote past its buffer
  std::vector<float> g_gpu(static_cast<size_t>(owned));
  cuda_check(cudaMemcpyAsync(g_gpu.data(), buf.grads, size_t(owned) * sizeof(float),
                             cudaMemcpyDeviceToHost, s));
  cuda_check(cudaStreamSynchronize(s));

  CpuModel ref(cfg.model, layout, own, B, cfg.model.seq_len);
  std::vector<float> g_cpu(size_t(owned), 0.0f);
  const LossParts cp =
      ref.forward_backward(theta.data(), g_cpu.data(), mb.x.data(), mb.y.data(), cfg.train.loss, 1.0f, 1.0f);
  check_parts("chunked lm head", gp, cp, 5e-3, 1e-2);
  const double tol = 5e-2;
  int bad = 0;
  for (const ParamTensor& t : layout.tensors) {
    const int64_t g = own.space.packed_index(t.offset);
    if (g < 0) continue;
    const double err = test::rel_error(g_gpu.data() + g, g_cpu.data() + g, t.numel());
    MESSAGE(t.name << ": grad rel err " << err << " (tol " << tol << ") " << std::string(err <= tol ? "OK" : "MISMATCH"));
    bad += err > tol;
    CHECK_MESSAGE(err <= tol, t.name << ": grad rel err " << err << " > tol " << tol);
  }
  MESSAGE("chunked lm head: " << (bad == 0 ? "all owned gradients OK" : std::to_string(bad) + " tensor(s) MISMATCH"));
}

// The micro-batch's CUDA graph: a replay reads the token buffers as they are then
// (the graph holds their pointers, not their contents) and gives the bits of the run
// launch by launch; a new grad_scale is not replayed with the old one (the graph is
// dropped, and captured anew after one run launch by launch).
GPU_TEST_CASE("gpu model: a micro-batch replayed from its CUDA graph gives the bits of one run launch by launch") {
  auto dir = test::temp_dir("gpu-graph");
  const Config cfg = gpu_config(dir, {"train.lb_coef=0.05", "train.router_z_coef=0.01", "train.lm_z_coef=0.001"});
  const ParamLayout layout = make_layout(cfg.model);
  const Ownership own = ownership_of(cfg, layout);
  const int64_t B = cfg.train.micro_batch, N = B * cfg.model.seq_len, owned = own.space.size();
  cuda::Runtime rt(0);
  const cudaStream_t s = rt.stream();
  const GpuMemoryPlan plan = plan_gpu_node(cfg.model, layout, own, B, current_gpu_limits());
  cuda::DeviceArena arena(size_t(plan.arena_bytes()), "graph test arena");
  const DeviceBuffers buf = carve_buffers(plan, arena);
  arena.seal(s);
  GpuModel model(cfg.model, layout, own, plan.sizes, rt, buf);
  const std::vector<float> theta = seeded_theta(cfg, layout);
  std::vector<cuda::bf16> w(theta.size());
  for (size_t i = 0; i < theta.size(); ++i) w[i] = __float2bfloat16_rn(theta[i]);
  cuda_check(cudaMemcpyAsync(buf.weights, w.data(), w.size() * sizeof(cuda::bf16), cudaMemcpyHostToDevice, s));
  const Batch batches[2] = {random_batch(cfg, B, 4), random_batch(cfg, B, 5)};

  struct Result {
    std::vector<float> grads;
    LossParts parts;
  };
  auto run = [&](int batch, float grad_scale, bool expect_graph) {
    cuda_check(cudaMemsetAsync(buf.grads, 0, size_t(owned) * sizeof(float), s));
    cuda_check(cudaMemcpyAsync(model.inputs(), batches[batch].x.data(), size_t(N) * 4, cudaMemcpyHostToDevice, s));
    cuda_check(cudaMemcpyAsync(model.targets(), batches[batch].y.data(), size_t(N) * 4, cudaMemcpyHostToDevice, s));
    Result r;
    r.parts = model.forward_backward(cfg.train.loss, 0.85f, grad_scale);
    CHECK(model.graph_captured() == expect_graph);
    r.grads.resize(size_t(owned));
    cuda_check(cudaMemcpyAsync(r.grads.data(), buf.grads, size_t(owned) * sizeof(float), cudaMemcpyDeviceToHost, s));
    cuda_check(cudaStreamSynchronize(s));
    return r;
  };
  auto same = [](const Result& a, const Result& b) {
    return std::memcmp(a.grads.data(), b.grads.data(), a.grads.size() * sizeof(float)) == 0 &&
           a.parts.ce == b.parts.ce && a.parts.lm_z == b.parts.lm_z && a.parts.lb == b.parts.lb &&
           a.parts.router_z == b.parts.router_z && a.parts.expert_counts == b.parts.expert_counts;
  };
  // Each batch's reference launch by launch: a change of scalars in between keeps
  // every one of these runs out of a graph.
  const Result eager1 = run(1, 0.5f, false);
  const Result eager0_quarter = run(0, 0.25f, false);
  const Result eager0 = run(0, 0.5f, false);
  CHECK_FALSE(same(eager0, eager1));  // the comparisons below can tell the batches apart
  CHECK_FALSE(same(eager0, eager0_quarter));
  // At 0.5 again: captured (batch 1), then replayed for each batch in turn.
  CHECK_MESSAGE(same(run(1, 0.5f, true), eager1), "batch 1 through its captured graph differs from its eager run");
  CHECK_MESSAGE(same(run(0, 0.5f, true), eager0), "a replay for batch 0 differs from its eager run");
  CHECK_MESSAGE(same(run(1, 0.5f, true), eager1), "a replay for batch 1 differs from its eager run");
  CHECK_NOTHROW(arena.check_guards(s));
  // A new grad_scale is not replayed with the old: launch by launch, then captured anew.
  CHECK_MESSAGE(same(run(0, 0.25f, false), eager0_quarter), "the run at grad_scale 0.25 after the graph differs");
  CHECK_MESSAGE(same(run(0, 0.25f, true), eager0_quarter), "the graph captured at grad_scale 0.25 differs");
}

GPU_TEST_CASE("gpu step: 300 steps end within 2% of the CPU run's training loss") {
  auto dir = test::temp_dir("gpu-300");
  Config g = gpu_config(dir / "gpu");
  Config c = gpu_config(dir / "cpu");  // the same tokens in its own folder
  c.train.device = Device::cpu;
  std::ostringstream gpu_csv, cpu_csv;
  Trainer(g).run(gpu_csv, false);
  Trainer(c).run(cpu_csv, false);
  REQUIRE(csv_rows(gpu_csv.str()).size() == 300);
  REQUIRE(csv_rows(cpu_csv.str()).size() == 300);
  // Same batches on both: compare the mean of the last 10 steps' losses (one step's
  // loss alone carries that batch's noise, ±0.15 here). bf16 activations drift the
  // trajectory a little (on the CPU, rounding θ0 alone to bf16 moves this mean by
  // 0.6%); 2% is the bar. 300 CPU steps take about 3 s on 2 cores.
  const double gl = mean_loss_of_last(gpu_csv.str(), 10), cl = mean_loss_of_last(cpu_csv.str(), 10);
  const double first = std::stod(csv_rows(cpu_csv.str()).front()[2]);
  MESSAGE("300 steps: gpu " << gl << ", cpu " << cl << " (mean of the last 10 steps; first step " << first
                            << "), rel diff " << rel(gl, cl) << " (tol 2e-2)");
  CHECK(rel(gl, cl) <= 2e-2);
  CHECK(cl < first - 1.0);  // it learned (the data is a noisy repeating pattern)
}

GPU_TEST_CASE("gpu resume: N steps equal N/2 + resume + N/2, bitwise; a GPU checkpoint evaluates the same on the CPU") {
  auto dir = test::temp_dir("gpu-resume");
  // 8 steps: the first half ends past the warm-up, so the resumed half starts inside
  // the decay; more steps repeat the same arithmetic (and cost the emulator minutes).
  const std::vector<std::string> sets = {"train.steps=8", "optim.decay_steps=8", "optim.warmup_steps=2"};
  Config full_cfg = gpu_config(dir / "a", sets);
  std::ostringstream full_csv, first_csv, second_csv;
  Trainer full(full_cfg);
  full.run(full_csv, false);

  Config half_cfg = gpu_config(dir / "b", sets);
  half_cfg.train.max_steps_this_run = 4;
  {
    Trainer t(half_cfg);
    t.run(first_csv, false);
    CHECK(t.step() == 4);
  }
  half_cfg.train.max_steps_this_run = 0;
  Trainer resumed(half_cfg);
  resumed.run(second_csv, true);
  CHECK(resumed.step() == 8);
  // Bitwise: the checkpoint holds the fp32 master θ and moments exactly, the bf16
  // compute copy rebuilt from it has the bits AdamW wrote, and every kernel of the
  // step is deterministic (README, Architecture: "Precision and determinism"), so the resumed run repeats the same arithmetic.
  std::vector<std::string> a = loss_columns(full_csv.str()), b = loss_columns(first_csv.str()),
                           b2 = loss_columns(second_csv.str());
  b.insert(b.end(), b2.begin(), b2.end());
  CHECK(a == b);
  CHECK(resumed.params() == full.params());

  // The GPU's validation CE, and the CPU's on the GPU's checkpoint: the CPU runs the
  // fp32 θ, the GPU its bf16 copy with bf16 activations; mean CE over the held-out
  // tokens agrees to 1e-3 (relative).
  const EvalResult gpu_eval = full.evaluate(8);
  REQUIRE(gpu_eval.tokens > 0);
  Config cpu_cfg = full_cfg;
  cpu_cfg.train.device = Device::cpu;
  Trainer cpu(cpu_cfg);
  const std::string ckpt = latest_checkpoint((std::filesystem::path(full_cfg.checkpoint.dir) / "node-1").string());
  REQUIRE_FALSE(ckpt.empty());
  cpu.load_params(load_checkpoint(ckpt), ckpt);
  CHECK(cpu.step() == 8);
  const EvalResult cpu_eval = cpu.evaluate(8);
  CHECK(cpu_eval.tokens == gpu_eval.tokens);
  MESSAGE("validation CE: gpu " << gpu_eval.ce << ", cpu on the GPU checkpoint " << cpu_eval.ce << " over "
                                << gpu_eval.tokens << " tokens, rel diff " << rel(gpu_eval.ce, cpu_eval.ce)
                                << " (tol 1e-3)");
  CHECK(rel(gpu_eval.ce, cpu_eval.ce) <= 1e-3);
}

static void check_arena_is_plan(const Config& cfg) {
  const ParamLayout layout = make_layout(cfg.model);
  const Ownership own = ownership_of(cfg, layout);
  const GpuMemoryPlan plan = plan_gpu_node(cfg.model, layout, own, cfg.train.micro_batch, current_gpu_limits());
  cuda_check(cudaFree(nullptr));  // the context exists before the first reading
  size_t free_before = 0, free_after = 0, total = 0;
  cuda_check(cudaMemGetInfo(&free_before, &total));
  std::unique_ptr<TrainBackend> gpu = make_gpu_rank(cfg, layout, own);
  cuda_check(cudaMemGetInfo(&free_after, &total));
  const GpuMemoryUse use = gpu_memory_use(*gpu);
  const int64_t taken = int64_t(free_before) - int64_t(free_after);
  MESSAGE("arena " << use.arena_capacity << " B (used " << use.arena_used << "), plan arena " << plan.arena_bytes()
                   << " B, plan total " << plan.total() << " B; device memory taken by the backend " << taken
                   << " B");
  CHECK(use.arena_capacity == plan.arena_bytes());
  CHECK(use.plan.total() == plan.total());
  CHECK(use.arena_used == use.arena_capacity);  // every planned buffer was carved, with its guard
  // The backend's own allocations are the arena plus the runtime's GEMM workspace;
  // cuBLAS handles and lazily loaded kernels take a little more.
  CHECK(taken >= use.arena_capacity);
  CHECK(taken <= plan.total() + (int64_t(256) << 20));
  // The start-up report reads the same plan.
  const std::vector<MemoryLine> report = memory_report(use.plan);
  REQUIRE_FALSE(report.empty());
  CHECK(report.back().category == "total");
  CHECK(report.back().bytes == plan.total());
  for (const MemoryLine& l : report)
    for (MemCategory c : {MemCategory::weights, MemCategory::master, MemCategory::moments, MemCategory::grads,
                          MemCategory::activations, MemCategory::workspace})
      if (l.category == mem_category_name(c)) CHECK(l.bytes == plan.bytes(c));
  CHECK(gpu->optimizer_state_bytes() == 12 * own.space.size());
  CpuBackend cpu(cfg.model, cfg.train.loss, layout, own, cfg.train.micro_batch, 1);
  CHECK_THROWS_AS(gpu_memory_use(cpu), Error);
}

// Also with the imported shapes' buffers: q wider than d_model, an rstd per head,
// post-norm's d_c and no an1 / an2.
GPU_TEST_CASE("gpu memory: the backend's arena is exactly the memory plan's") {
  for (const bool imported : {false, true}) {
    CAPTURE(imported);
    auto dir = test::temp_dir(imported ? "gpu-arena-imported" : "gpu-arena");
    check_arena_is_plan(imported ? gpu_config(dir, {"model.qk_norm_per_head=true", "model.head_dim=64",
                                                    "model.n_heads=4", "model.n_kv_heads=2", "model.post_norm=true"})
                                 : gpu_config(dir));
  }
}

GPU_TEST_CASE("gpu memory: θ and the moments never leave the GPU past an overwritten arena guard") {
  auto dir = test::temp_dir("gpu-guard");
  const Config cfg = gpu_config(dir);
  const ParamLayout layout = make_layout(cfg.model);
  const Ownership own = ownership_of(cfg, layout);
  std::unique_ptr<RankBackend> gpu = make_gpu_rank(cfg, layout, own);
  std::vector<float> m(size_t(own.space.size())), v(m.size());
  CHECK_NOTHROW(gpu->pull_theta());
  CHECK_NOTHROW(gpu->read_moments(m, v));
  // One byte just past the bf16 weights, as a kernel writing past them would leave it
  // (here through a memset: the emulator would stop a kernel's write at its launch).
  const std::span<std::byte> weights = gpu->theta_buffers().at(1);
  REQUIRE(weights.size() == size_t(layout.total) * 2);
  cuda_check(cudaMemsetAsync(weights.data() + weights.size(), 0, 1, nullptr));
  cuda_check(cudaDeviceSynchronize());
  const char* expected = "past the end of buffer 'weights'";
  CHECK_THROWS_WITH_AS(gpu->pull_theta(), doctest::Contains(expected), Error);  // a sync round, a checkpoint
  CHECK_THROWS_WITH_AS(gpu->read_moments(m, v), doctest::Contains(expected), Error);  // a checkpoint
}
