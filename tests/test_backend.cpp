// The training-backend contract (engine/backend.hpp) on CpuBackend, the oracle the
// GPU backend is held to; the GPU memory plan's arithmetic (model/gpu_memory); the
// MFU numerator (model/flops) on hand-computed configs.
//
// Gradients are read through the seam alone: from zero moments, one AdamW step with
// β1 = β2 = 0 and lr = 0 leaves m = 0·0 + 1·g = g exactly and θ unchanged, so
// read_moments returns the accumulated owned gradients bit for bit.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "engine/backend.hpp"
#include "engine/base/error.hpp"
#include "engine/cpu_backend.hpp"
#include "model/cpu/cpu_model.hpp"
#include "model/flops.hpp"
#include "model/gpu_memory.hpp"
#include "model/layout.hpp"

using namespace spes;

namespace {

ModelConfig small_model() {
  ModelConfig m;
  m.vocab_size = 41;
  m.d_model = 16;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;  // GQA
  m.n_experts = 4;
  m.top_k = 2;
  m.expert_hidden = 12;
  m.seq_len = 8;
  m.qk_norm = true;
  m.init_std = 0.2;  // large enough that every path carries a clear gradient signal
  return m;
}

LossConfig strong_aux() {
  LossConfig c;
  c.lb_coef = 0.1;
  c.router_z_coef = 0.05;
  c.lm_z_coef = 0.02;
  return c;
}

// One node of a 2-node SPES run (owns experts 2 and 3 of 4), or one owning all.
struct Node {
  ModelConfig cfg = small_model();
  ParamLayout layout = make_layout(cfg);
  Ownership own;
  LossConfig loss = strong_aux();
  std::vector<float> theta;

  explicit Node(bool partitioned = true, uint64_t seed = 7)
      : own(partitioned ? make_ownership(cfg, layout, 1, 2, OwnershipMode::partitioned, 0)
                        : make_ownership(cfg, layout, 0, 1, OwnershipMode::all, 0)) {
    theta.resize(size_t(layout.total));
    init_parameters(theta.data(), cfg, layout, seed);
    // Norm weights away from 1 so their gradients and decay are exercised.
    std::mt19937 g{unsigned(seed)};
    std::uniform_real_distribution<float> u(0.7f, 1.3f);
    for (const ParamTensor& t : layout.tensors)
      if (t.is_norm())
        for (int64_t i = 0; i < t.numel(); ++i) theta[t.offset + i] = u(g);
  }
  int64_t owned() const { return own.space.size(); }

  std::unique_ptr<CpuBackend> backend(int64_t micro_batch) const {
    auto b = std::make_unique<CpuBackend>(cfg, loss, layout, own, micro_batch, 1);
    std::copy(theta.begin(), theta.end(), b->host_theta().begin());
    b->push_theta();
    return b;
  }
  // `rows` sequences of random tokens: inputs then targets.
  std::pair<std::vector<int32_t>, std::vector<int32_t>> batch(int64_t rows, unsigned seed) const {
    std::mt19937 g{seed};
    std::uniform_int_distribution<int> tok(0, int(cfg.vocab_size) - 1);
    std::vector<int32_t> x(size_t(rows * cfg.seq_len)), y(x.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = tok(g), y[i] = tok(g);
    return {x, y};
  }
};

template <class T>
std::vector<T> concat(const std::vector<T>& a, const std::vector<T>& b) {
  std::vector<T> c = a;
  c.insert(c.end(), b.begin(), b.end());
  return c;
}

// ‖a − b‖ / ‖b‖ in double.
double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / (den > 0 ? den : 1e-300));
}

bool bitwise_equal(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The accumulated owned gradients (see the file comment). Consumes the gradients:
// the step may scale them in place.
std::vector<float> probe_gradients(TrainBackend& b, int64_t owned) {
  const std::vector<float> zeros(size_t(owned), 0.0f);
  std::vector<float> m(static_cast<size_t>(owned)), v(static_cast<size_t>(owned));
  b.write_moments(zeros, zeros);
  AdamWStep s;
  s.lr = 0, s.beta1 = 0, s.beta2 = 0, s.weight_decay = 0.1, s.t = 1;
  b.optimizer_step(s);
  b.read_moments(m, v);
  return m;
}

std::vector<float> random_values(int64_t n, unsigned seed, float lo, float hi) {
  std::mt19937 g{seed};
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = u(g);
  return v;
}

void check_parts_equal(const LossParts& a, const LossParts& b) {
  CHECK(a.ce == b.ce);
  CHECK(a.lb == b.lb);
  CHECK(a.router_z == b.router_z);
  CHECK(a.lm_z == b.lm_z);
  CHECK(a.expert_counts == b.expert_counts);
}

}  // namespace

TEST_CASE("backend: two micro-batches at grad_scale 1/2 accumulate to the gradient of one batch of both") {
  Node n;
  // LB is count_e · mean_t p_te per batch, a product of two batch means, so the mean
  // of two micro-batches' LB is not the LB of their union; CE, RZ and ZLM are token
  // means, for which accumulation is exact. Compare with LB off (its accumulation
  // is the same code path as every other part's).
  n.loss.lb_coef = 0;
  const int64_t B = 2;
  auto [x1, y1] = n.batch(B, 1);
  auto [x2, y2] = n.batch(B, 2);
  auto acc = n.backend(B);
  // Junk first: zero_grads must clear it.
  acc->forward_backward(x2.data(), y1.data(), 0.8f, 3.0f);
  acc->zero_grads();
  const LossParts p1 = acc->forward_backward(x1.data(), y1.data(), 0.8f, 0.5f);
  const LossParts p2 = acc->forward_backward(x2.data(), y2.data(), 0.8f, 0.5f);
  const std::vector<float> g_acc = probe_gradients(*acc, n.owned());

  auto big = n.backend(2 * B);
  const std::vector<int32_t> x = concat(x1, x2), y = concat(y1, y2);
  const LossParts p = big->forward_backward(x.data(), y.data(), 0.8f, 1.0f);
  const std::vector<float> g_big = probe_gradients(*big, n.owned());

  // Tolerance: fp32, the same sums in another order (GEMMs over 2N rows vs two N).
  CHECK((p1.ce + p2.ce) / 2 == doctest::Approx(p.ce).epsilon(1e-6));
  CHECK((p1.router_z + p2.router_z) / 2 == doctest::Approx(p.router_z).epsilon(1e-6));
  CHECK((p1.lm_z + p2.lm_z) / 2 == doctest::Approx(p.lm_z).epsilon(1e-6));
  const double err = rel_error(g_acc, g_big);
  MESSAGE("accumulated vs one big batch: gradient rel err " << err << " (tol 1e-5)");
  CHECK(err < 1e-5);
  // Per tensor too, so no small tensor hides under the global norm.
  for (const ParamTensor& t : n.layout.tensors) {
    const int64_t g = n.own.space.packed_index(t.offset);
    if (g < 0) continue;
    const std::vector<float> a(g_acc.begin() + g, g_acc.begin() + g + t.numel());
    const std::vector<float> b(g_big.begin() + g, g_big.begin() + g + t.numel());
    CAPTURE(t.name);
    CHECK(rel_error(a, b) < 1e-4);
  }
}

TEST_CASE("backend: grad_sum_squares is the sum over the owned gradients only") {
  Node part(true), all(false);
  auto [x, y] = part.batch(2, 3);
  // The reference: the CPU model's gradients straight into owned space.
  CpuModel model(part.cfg, part.layout, part.own, 2, part.cfg.seq_len);
  std::vector<float> g_ref(size_t(part.owned()), 0.0f);
  model.forward_backward(part.theta.data(), g_ref.data(), x.data(), y.data(), part.loss, 1.0f, 1.0f);
  double ref = 0;
  for (float g : g_ref) ref += double(g) * double(g);

  auto b = part.backend(2);
  b->zero_grads();
  b->forward_backward(x.data(), y.data(), 1.0f, 1.0f);
  const double ss = b->grad_sum_squares();
  MESSAGE("grad_sum_squares " << ss << " vs direct " << ref);
  CHECK(ss == doctest::Approx(ref).epsilon(1e-12));  // double sums, another order
  CHECK(ss == b->grad_sum_squares());                 // deterministic
  // The probe reads exactly these gradients (same model, same order: bitwise).
  CHECK(bitwise_equal(probe_gradients(*b, part.owned()), g_ref));

  // A node owning every expert has more gradient; restricted to the partitioned
  // node's tensors its sum is the same (frozen experts pass activation gradients
  // on unchanged, test_model; aux factor 1, which does not depend on ownership),
  // so the frozen experts are what is left out.
  auto ball = all.backend(2);
  ball->zero_grads();
  ball->forward_backward(x.data(), y.data(), 1.0f, 1.0f);
  const double ss_all = ball->grad_sum_squares();
  const std::vector<float> g_all = probe_gradients(*ball, all.owned());
  double restricted = 0;
  for (const ParamTensor& t : all.layout.tensors) {
    if (part.own.space.packed_index(t.offset) < 0) continue;
    const int64_t g = all.own.space.packed_index(t.offset);
    for (int64_t i = 0; i < t.numel(); ++i) restricted += double(g_all[g + i]) * double(g_all[g + i]);
  }
  CHECK(ss_all > ss);
  CHECK(restricted == doctest::Approx(ss).epsilon(1e-12));
}

TEST_CASE("backend: optimizer_step with grad_scale s equals scaling the gradients by s first") {
  Node n;
  auto [x, y] = n.batch(2, 4);
  // Mid-run moments, small beside (1 − β)·g so the checks below see the gradients.
  const std::vector<float> m0 = random_values(n.owned(), 5, -1e-6f, 1e-6f);
  const std::vector<float> v0 = random_values(n.owned(), 6, 1e-9f, 1e-7f);
  AdamWStep step;
  step.lr = 1e-2, step.beta1 = 0.9, step.beta2 = 0.95, step.eps = 1e-8, step.weight_decay = 0.1, step.t = 5;

  for (const float s : {0.5f, 0.3f}) {
    CAPTURE(s);
    // a: gradients g, the step scales them by s.
    auto a = n.backend(2);
    a->write_moments(m0, v0);
    a->zero_grads();
    a->forward_backward(x.data(), y.data(), 0.9f, 1.0f);
    AdamWStep sa = step;
    sa.grad_scale = s;
    a->optimizer_step(sa);
    // b: the loss scaled by s gives gradients s·g; the step does not scale.
    auto b = n.backend(2);
    b->write_moments(m0, v0);
    b->zero_grads();
    b->forward_backward(x.data(), y.data(), 0.9f, s);
    b->optimizer_step(step);

    std::vector<float> ma(m0.size()), va(m0.size()), mb(m0.size()), vb(m0.size());
    a->read_moments(ma, va);
    b->read_moments(mb, vb);
    a->pull_theta();
    b->pull_theta();
    std::vector<float> ua(n.theta.size()), ub(n.theta.size());
    for (size_t i = 0; i < ua.size(); ++i) {
      ua[i] = a->host_theta()[i] - n.theta[i];
      ub[i] = b->host_theta()[i] - n.theta[i];
    }
    if (s == 0.5f) {
      // A power of two commutes with every rounding of the backward pass and of the
      // scaling (no underflow at these magnitudes), so the results are bitwise equal.
      CHECK(bitwise_equal(a->host_theta(), b->host_theta()));
      CHECK(bitwise_equal(ma, mb));
      CHECK(bitwise_equal(va, vb));
    } else {
      // s = 0.3 is inexact: g·s rounded once vs s carried through the backward
      // pass; fp32 → a few ulps per element.
      CHECK(rel_error(ma, mb) < 1e-5);
      CHECK(rel_error(va, vb) < 1e-5);
      CHECK(rel_error(ua, ub) < 1e-5);
    }
    // And the scale did act: the first moment moved by (1 − β1)·s·g, not (1 − β1)·g.
    auto c = n.backend(2);
    c->write_moments(m0, v0);
    c->zero_grads();
    c->forward_backward(x.data(), y.data(), 0.9f, 1.0f);
    c->optimizer_step(step);
    std::vector<float> mc(m0.size()), vc(m0.size());
    c->read_moments(mc, vc);
    std::vector<float> dma(m0.size()), dmc(m0.size());
    for (size_t i = 0; i < m0.size(); ++i) {
      dma[i] = ma[i] - float(step.beta1) * m0[i];
      dmc[i] = s * (mc[i] - float(step.beta1) * m0[i]);
    }
    CHECK(rel_error(dma, dmc) < 1e-4);  // fp32: m − β1·m0 cancels a little
  }
}

TEST_CASE("backend: forward on rows < micro_batch equals the CPU model at that batch") {
  Node n;
  auto b = n.backend(3);
  for (const int64_t rows : {2, 3, 1, 3}) {
    CAPTURE(rows);
    auto [x, y] = n.batch(rows, unsigned(10 + rows));
    CpuModel model(n.cfg, n.layout, n.own, rows, n.cfg.seq_len);
    const LossParts ref = model.forward(n.theta.data(), x.data(), y.data(), n.loss);
    check_parts_equal(b->forward(x.data(), y.data(), rows), ref);
  }
}

TEST_CASE("backend: read_moments / write_moments round trip; wrong sizes are refused") {
  Node n;
  auto b = n.backend(2);
  const std::vector<float> m = random_values(n.owned(), 1, -1, 1), v = random_values(n.owned(), 2, 0, 1);
  b->write_moments(m, v);
  std::vector<float> m2(m.size()), v2(v.size());
  b->read_moments(m2, v2);
  CHECK(m2 == m);
  CHECK(v2 == v);
  std::vector<float> short_m(m.size() - 1);
  CHECK_THROWS_AS(b->write_moments(short_m, v), Error);
  CHECK_THROWS_AS(b->read_moments(m2, short_m), Error);
}

TEST_CASE("backend: host_theta -> push_theta -> pull_theta round trip, and the backend runs on the pushed θ") {
  Node n, other(true, 99);
  auto b = n.backend(2);
  std::copy(other.theta.begin(), other.theta.end(), b->host_theta().begin());
  b->push_theta();
  b->pull_theta();
  CHECK(bitwise_equal(b->host_theta(), other.theta));
  auto [x, y] = n.batch(2, 21);
  CpuModel model(n.cfg, n.layout, n.own, 2, n.cfg.seq_len);
  check_parts_equal(b->forward(x.data(), y.data(), 2), model.forward(other.theta.data(), x.data(), y.data(), n.loss));
}

TEST_CASE("backend: optimizer state is 12 bytes per owned parameter (grads + m + v, fp32)") {
  Node part(true), all(false);
  CHECK(part.owned() == part.layout.shared_count + 2 * part.layout.expert_block);
  CHECK(all.owned() == all.layout.total);
  CHECK(part.backend(2)->optimizer_state_bytes() == 12 * part.owned());
  CHECK(all.backend(2)->optimizer_state_bytes() == 12 * all.owned());
}

// ---- the GPU memory plan (plain C++: no GPU needed) ---------------------------------

namespace {

// Kernel scratch at odd byte counts, so the alignment padding shows.
KernelScratch scratch_for(int64_t tokens) {
  KernelScratch k;
  k.router_partials = 4 * (3 * tokens + 17);
  k.moe_dispatch = 4 * 1001;
  k.attention_backward = 77 * tokens;
  k.norm_backward = 4099;
  k.embedding_backward = 555555;
  k.global_norm = 8 * 1001;
  k.rope_table = 12345;
  k.gemm_workspace = int64_t(32) << 20;
  return k;
}

constexpr int64_t kAlign = int64_t(kArenaAlign), kGuard = int64_t(kArenaGuardBytes);
int64_t round_up(int64_t b) { return (b + kAlign - 1) / kAlign * kAlign; }
// A buffer's bytes in the arena: padding to the alignment, then the guard (none for an empty buffer).
int64_t slot(int64_t b) { return b == 0 ? 0 : round_up(b) + kGuard; }

}  // namespace

TEST_CASE("gpu memory plan: categories add up to the arena plus the runtime workspace") {
  ModelConfig m = small_model();
  m.d_model = 64, m.n_heads = 2, m.n_kv_heads = 1, m.seq_len = 32, m.vocab_size = 301;
  const ParamLayout layout = make_layout(m);
  for (const bool partitioned : {true, false}) {
    CAPTURE(partitioned);
    const Ownership own = partitioned ? make_ownership(m, layout, 1, 2, OwnershipMode::partitioned, 0)
                                      : make_ownership(m, layout, 0, 1, OwnershipMode::all, 0);
    const int64_t owned = own.space.size(), B = 3, N = B * m.seq_len;
    const GpuMemoryPlan p = plan_gpu_memory(m, layout, own, B, scratch_for(N));

    int64_t raw = 0, padded = 0;
    std::set<std::string> names;
    for (const GpuBuffer& b : p.buffers) {
      raw += b.bytes;
      padded += slot(b.bytes);
      CHECK(b.bytes >= 0);
      CHECK_MESSAGE(names.insert(b.name).second, "buffer named twice: " << b.name);
    }
    int64_t by_category = 0;
    for (MemCategory c : {MemCategory::weights, MemCategory::master, MemCategory::moments, MemCategory::grads,
                          MemCategory::activations, MemCategory::workspace})
      by_category += p.bytes(c);
    // Σ categories = Σ buffers + the runtime's workspace; the arena adds each
    // buffer's padding to the 256-byte alignment and a 256-byte guard after it.
    CHECK(by_category == raw + p.runtime_workspace());
    CHECK(p.arena_bytes() == padded);
    CHECK(p.total() == p.arena_bytes() + p.runtime_workspace());
    CHECK(by_category + (padded - raw) == p.total());
    const int64_t carved =
        std::count_if(p.buffers.begin(), p.buffers.end(), [](const GpuBuffer& b) { return b.bytes > 0; });
    CHECK(padded - raw >= kGuard * carved);
    CHECK(padded - raw < (kAlign + kGuard) * carved);
    CHECK(p.runtime_workspace() == scratch_for(N).gemm_workspace);

    CHECK(p.bytes(MemCategory::weights) == 2 * layout.total);  // bf16 compute copy, whole layout
    CHECK(p.bytes(MemCategory::master) == 4 * owned);
    CHECK(p.bytes(MemCategory::moments) == 8 * owned);
    CHECK(p.bytes(MemCategory::grads) == 4 * owned);
    CHECK(p.frozen_weight_bytes == 2 * (layout.total - owned));
    CHECK((p.frozen_weight_bytes == 0) == !partitioned);
    CHECK(p.sizes.tokens == N);
    CHECK(p.sizes.vocab_stride == 304);  // 301 rounded up to 8: 16-byte logits rows
    CHECK(p.find("logits").bytes == 2 * p.sizes.lm_chunk * p.sizes.vocab_stride);
    // Per-layer buffers are named "<name>.<layer>", one per layer, sized per layer.
    CHECK(p.find("gate_up.1").bytes == 2 * N * m.top_k * 2 * m.expert_hidden);
    CHECK(p.find("lse.0").bytes == 4 * N * m.n_heads);
    CHECK(p.find("down_grads.1").bytes == 8 * m.n_experts);  // one pointer per expert
    CHECK_THROWS(p.find("lse." + std::to_string(m.n_layers)));
    CHECK_THROWS(p.find("no such buffer"));
  }
}

// The imported shapes: Qwen3's q is n_heads·head_dim wide (here 2·d_model), and so are
// the attention output and their gradients; its per-head QK-norm keeps an rstd per
// (token, head); OLMo-2's post-norm reads x_in and h directly (no an1, an2) and takes
// each branch's gradient through its norm in d_c.
TEST_CASE("gpu memory plan: q and the attention output are the q width wide; post-norm drops an1 and an2 for d_c") {
  ModelConfig m = small_model();
  m.d_model = 64, m.n_heads = 4, m.n_kv_heads = 2, m.head_dim_key = 32, m.qk_norm_per_head = true, m.seq_len = 32;
  const ParamLayout layout = make_layout(m);
  const Ownership own = make_ownership(m, layout, 0, 1, OwnershipMode::all, 0);
  const int64_t B = 3, N = B * m.seq_len;
  const GpuMemoryPlan p = plan_gpu_memory(m, layout, own, B, scratch_for(N));
  for (const char* name : {"q_raw.0", "q.1", "att.0", "d_att", "d_q", "d_q_raw"}) {
    CAPTURE(name);
    CHECK(p.find(name).bytes == 2 * N * 128);
  }
  CHECK(p.find("k_raw.0").bytes == 2 * N * 64);
  CHECK(p.find("attn_out.0").bytes == 2 * N * 64);
  CHECK(p.find("rstd_q.0").bytes == 4 * N * 4);
  CHECK(p.find("rstd_k.1").bytes == 4 * N * 2);
  CHECK(p.find("an1.0").bytes == 2 * N * 64);
  CHECK(p.find("d_c").bytes == 0);
  m.post_norm = true;
  const GpuMemoryPlan post = plan_gpu_memory(m, layout, own, B, scratch_for(N));
  CHECK(post.find("an1.0").bytes == 0);
  CHECK(post.find("an2.1").bytes == 0);
  CHECK(post.find("d_c").bytes == 2 * N * 64);
  CHECK(post.bytes(MemCategory::activations) == p.bytes(MemCategory::activations) - 2 * m.n_layers * 2 * N * 64 +
                                                   2 * N * 64);
}

TEST_CASE("gpu memory plan: activations grow linearly with micro_batch; the lm chunk never exceeds the tokens") {
  ModelConfig m = small_model();
  m.d_model = 64, m.n_heads = 2, m.n_kv_heads = 1, m.seq_len = 32, m.vocab_size = 301;
  const ParamLayout layout = make_layout(m);
  const Ownership own = make_ownership(m, layout, 1, 2, OwnershipMode::partitioned, 0);
  auto plan = [&](int64_t B) { return plan_gpu_memory(m, layout, own, B, scratch_for(B * m.seq_len)); };
  const GpuMemoryPlan p1 = plan(1), p2 = plan(2);
  // Activations: a part per token, and per layer a few of fixed size: the expert
  // offsets, LB weights and aux losses, and the experts' four pointer tables.
  const int64_t per_sequence = p2.bytes(MemCategory::activations) - p1.bytes(MemCategory::activations);
  const int64_t fixed = p1.bytes(MemCategory::activations) - per_sequence;
  CHECK(fixed == m.n_layers * (4 * (m.n_experts + 1) + 4 * m.n_experts + 8 + 4 * 8 * m.n_experts));
  for (int64_t B : {2, 3, 5, 8}) {
    CAPTURE(B);
    const GpuMemoryPlan p = plan(B);
    // Small vocabulary: one chunk holds every token, so every activation is per token.
    CHECK(p.sizes.lm_chunk == p.sizes.tokens);
    CHECK(p.bytes(MemCategory::activations) == fixed + B * per_sequence);
    // Parameters and optimizer state do not depend on the batch.
    for (MemCategory c : {MemCategory::weights, MemCategory::master, MemCategory::moments, MemCategory::grads})
      CHECK(p.bytes(c) == p1.bytes(c));
  }

  // A 151k vocabulary: the logits chunk caps at ~1 GiB, a multiple of 128 rows, so
  // activations grow linearly apart from the logits buffer, which holds one chunk.
  ModelConfig big = m;
  big.vocab_size = 151665;
  const ParamLayout big_layout = make_layout(big);
  const Ownership big_own = make_ownership(big, big_layout, 0, 1, OwnershipMode::all, 0);
  auto big_plan = [&](int64_t B) {
    return plan_gpu_memory(big, big_layout, big_own, B, scratch_for(B * big.seq_len));
  };
  const int64_t chunk = lm_chunk_tokens(int64_t(1) << 20, big.vocab_size);
  CHECK(chunk % 128 == 0);
  CHECK(2 * chunk * big.vocab_size <= int64_t(1) << 30);
  // By hand: 2^29 / 151665 = 3539.9 rows, 3456 in multiples of 128. A 16384-token
  // micro-batch needs 5 chunks; equal ones of 3276.8 rows round up to 3328 (4 × 3328 + 3072),
  // where full chunks of 3456 would leave a 2560-row runt.
  CHECK(lm_chunk_tokens(3456, big.vocab_size) == 3456);
  CHECK(lm_chunk_tokens(3457, big.vocab_size) == 1792);  // two chunks of 1728.5 → 1792
  CHECK(lm_chunk_tokens(16384, big.vocab_size) == 3328);
  // 108, 216 and 432 sequences of 32 are 1, 2 and 4 chunks of exactly 3456 tokens.
  const GpuMemoryPlan q1 = big_plan(108), q2 = big_plan(216), q4 = big_plan(432);
  CHECK(q1.sizes.lm_chunk == chunk);
  CHECK(q4.sizes.lm_chunk == chunk);
  const auto non_logits = [&](const GpuMemoryPlan& p) {
    return p.bytes(MemCategory::activations) - p.find("logits").bytes - fixed;
  };
  CHECK(non_logits(q2) == 2 * non_logits(q1));
  CHECK(non_logits(q4) == 4 * non_logits(q1));
  CHECK(q1.find("logits").bytes == q4.find("logits").bytes);

  for (const int64_t V : {int64_t(2), int64_t(301), int64_t(50257), int64_t(151665), int64_t(1) << 22})
    for (const int64_t tokens : {int64_t(1), int64_t(100), int64_t(128), int64_t(767), int64_t(768),
                                 int64_t(4096), int64_t(16384)}) {
      CAPTURE(V);
      CAPTURE(tokens);
      const int64_t c = lm_chunk_tokens(tokens, V);
      CHECK(c >= 1);
      CHECK(c <= tokens);
      CHECK((c == tokens || c % 128 == 0));
      // Equal chunks: the last one is short by less than 128 rows per chunk.
      const int64_t chunks = (tokens + c - 1) / c;
      CHECK(tokens - (chunks - 1) * c > c - 128 * chunks);
    }
}

// ---- MFU's numerator ------------------------------------------------------------------

TEST_CASE("flops: training FLOPs per token on hand-computed configs") {
  // d 4, 2 heads of 2 (kv: 1 head → width 2), 3 experts top-2 of hidden 5, 2 layers,
  // vocab 7, context 6. Per layer: q,o 2·4·4 = 32, k,v 2·4·2 = 16, router 3·4 = 12,
  // experts 2·3·4·5 = 120 → 180; ×2 layers + lm head 7·4 = 28 → 388 active.
  // 6·388 + causal attention 6·L·T·d = 6·2·6·4 = 288 → 2616.
  ModelConfig m;
  m.d_model = 4, m.n_heads = 2, m.n_kv_heads = 1, m.n_experts = 3, m.top_k = 2, m.expert_hidden = 5;
  m.n_layers = 2, m.vocab_size = 7, m.seq_len = 6;
  CHECK(active_matmul_params(m) == 388.0);
  CHECK(train_flops_per_token(m) == 2616.0);

  // configs/spes-1b.toml: per layer 2·768² + 2·768·768 = 2,359,296 attention,
  // 16·768 = 12,288 router, 2·3·768·2048 = 9,437,184 routed experts → 11,808,768;
  // ×12 + lm head 151665·768 = 116,478,720 → 258,183,936 active parameters;
  // 6× that + 6·12·2048·768 = 113,246,208 → 1,662,349,824 FLOPs per token.
  ModelConfig s;
  s.vocab_size = 151665, s.d_model = 768, s.n_layers = 12, s.n_heads = 12, s.n_kv_heads = 12;
  s.n_experts = 16, s.top_k = 2, s.expert_hidden = 2048, s.seq_len = 2048;
  CHECK(active_matmul_params(s) == 258183936.0);
  CHECK(train_flops_per_token(s) == 1662349824.0);
  // Frozen experts change no FLOPs per token (ownership is not in the formula), and
  // only the routed top_k experts count: doubling E adds router FLOPs alone.
  ModelConfig s2 = s;
  s2.n_experts = 32;
  CHECK(active_matmul_params(s2) - active_matmul_params(s) == 12.0 * 16 * 768);
}
