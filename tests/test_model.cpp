// The whole model: finite-difference gradient checks for every parameter kind,
// frozen experts, LB = 1 for uniform routing, initial loss ≈ ln(vocab).
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "model/layout.hpp"
#include "model/cpu/cpu_model.hpp"

using namespace spes;

namespace {

ModelConfig small_model() {
  ModelConfig m;
  m.vocab_size = 37;
  m.d_model = 16;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;  // GQA
  m.n_experts = 4;
  m.top_k = 2;
  m.expert_hidden = 12;
  m.seq_len = 7;
  m.rope_theta = 10000.0;
  m.qk_norm = true;
  m.init_std = 0.3;  // large enough that every path carries a clear gradient signal
  return m;
}

LossConfig strong_aux() {
  LossConfig c;
  c.lb_coef = 0.1;
  c.router_z_coef = 0.05;
  c.lm_z_coef = 0.02;
  return c;
}

struct Fixture {
  ModelConfig cfg;
  ParamLayout layout = make_layout(cfg);
  int64_t B = 2, T = cfg.seq_len;
  std::vector<float> params;
  std::vector<int32_t> inputs, targets;

  explicit Fixture(uint64_t seed = 7, const ModelConfig& model = small_model()) : cfg(model) {
    params.resize(layout.total);
    init_parameters(params.data(), cfg, layout, seed);
    std::mt19937 g{unsigned(seed)};
    // Norm weights away from 1 so their gradients are exercised non-trivially.
    std::uniform_real_distribution<float> u(0.7f, 1.3f);
    for (const auto& t : layout.tensors)
      if (t.is_norm())
        for (int64_t i = 0; i < t.numel(); ++i) params[t.offset + i] = u(g);
    std::uniform_int_distribution<int> tok(0, int(cfg.vocab_size) - 1);
    for (int64_t i = 0; i < B * T; ++i) {
      inputs.push_back(tok(g));
      targets.push_back(tok(g));
    }
  }
};

}  // namespace

namespace {

// Every owned tensor's analytic gradient against central differences along a random direction.
// With richardson, (4·D(h) − D(2h)) / 3 at h = 2e-3 against a looser tolerance: post-norm and narrow
// heads curve the loss more (the largest error measured was 1.5%; a wrong term is far above it).
void check_gradients(const ModelConfig& cfg, bool richardson = false) {
  Fixture f(7, cfg);
  const LossConfig loss = strong_aux();
  // Owns experts 0 and 1 of 4; the decayed aux factor 0.8 scales their LB counts.
  Ownership own = make_ownership(f.cfg, f.layout, 0, cfg.n_experts > 1 ? 2 : 1, OwnershipMode::partitioned, 0);
  const float aux = 0.8f;
  CpuModel model(f.cfg, f.layout, own, f.B, f.T);
  std::vector<float> grads(own.space.size(), 0.0f);
  model.forward_backward(f.params.data(), grads.data(), f.inputs.data(), f.targets.data(), loss, aux, 1.0f);

  auto loss_at = [&](const std::vector<float>& p) {
    return model.forward(p.data(), f.inputs.data(), f.targets.data(), loss, aux).total(loss);
  };
  // Directional derivative along a random direction over one whole tensor: the
  // analytic Σ g·dir against (L(θ+h·dir) − L(θ−h·dir)) / 2h. Summing over a tensor
  // gives a signal far above fp32 rounding; h small keeps top-k choices fixed
  // (at h = 1e-3 fp32 rounding alone reached 2% on the smallest gradients).
  std::mt19937 g(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  int checked_kinds[6] = {0, 0, 0, 0, 0, 0};
  for (const ParamTensor& t : f.layout.tensors) {
    const int64_t gi = own.space.packed_index(t.offset);
    if (gi < 0) continue;
    std::vector<float> dir(t.numel());
    for (auto& x : dir) x = nd(g);
    double analytic = 0;
    for (int64_t i = 0; i < t.numel(); ++i) analytic += double(grads[gi + i]) * dir[i];
    auto central = [&](float h) {
      std::vector<float> plus = f.params, minus = f.params;
      for (int64_t i = 0; i < t.numel(); ++i) {
        plus[t.offset + i] += h * dir[i];
        minus[t.offset + i] -= h * dir[i];
      }
      return (loss_at(plus) - loss_at(minus)) / (2.0 * h);
    };
    const float h = richardson ? 2e-3f : 4e-3f;
    const double numeric = richardson ? (4 * central(h) - central(2 * h)) / 3 : central(h);
    const double err = std::fabs(analytic - numeric) / std::max(std::fabs(numeric), 1e-3);
    CAPTURE(t.name);
    CAPTURE(analytic);
    CAPTURE(numeric);
    CHECK(err < (richardson ? 3e-2 : 1e-2));  // tolerance: fp32 forward, central differences, h = 4e-3
    checked_kinds[int(t.kind)]++;
  }
  // Every kind was covered: embedding, norms (incl. q/k norm), attention, router,
  // lm_head and owned experts' gate/up/down.
  for (int k = 0; k < 6; ++k) CHECK((checked_kinds[k] > 0 || (k == int(ParamKind::lm_head) && cfg.tie_embeddings)));
}

}  // namespace

TEST_CASE("whole-model gradients match finite differences for every parameter kind") { check_gradients(small_model()); }

// The imported architectures' options: Qwen3 (per-head QK-norm, head_dim != d_model / n_heads, GQA 2:1,
// tied embeddings, rope_theta 1e6) and OLMo-2 (post-norm, whole-projection QK-norm). Every token goes
// to every expert (top_k = n_experts), so no perturbation flips a routing choice: these shapes put
// some choices close enough to a tie for h = 4e-3 to flip them.
TEST_CASE("gradients match finite differences with Qwen3 and OLMo-2 options") {
  ModelConfig base = small_model();
  base.top_k = base.n_experts;
  ModelConfig qwen3 = base;
  qwen3.qk_norm_per_head = true;
  qwen3.head_dim_key = 6;  // q is 4·6 = 24 wide on d_model 16
  qwen3.tie_embeddings = true;
  qwen3.rope_theta = 1e6;
  SUBCASE("qwen3 moe") { check_gradients(qwen3, true); }
  ModelConfig olmo2 = base;
  olmo2.post_norm = true;
  SUBCASE("olmo2 post-norm moe") { check_gradients(olmo2, true); }
  olmo2.head_dim_key = 2;  // q narrower than d_model
  SUBCASE("olmo2 post-norm, narrow heads") { check_gradients(olmo2, true); }
  ModelConfig dense = olmo2;
  dense.n_experts = dense.top_k = 1;
  SUBCASE("olmo2 dense") { check_gradients(dense, true); }
}

TEST_CASE("frozen experts: no weight gradients, activation gradients still flow") {
  Fixture f;
  const LossConfig loss = strong_aux();
  Ownership all = make_ownership(f.cfg, f.layout, 0, 1, OwnershipMode::all, 0);
  Ownership half = make_ownership(f.cfg, f.layout, 1, 2, OwnershipMode::partitioned, 0);  // owns experts 2, 3
  REQUIRE(half.space.size() == f.layout.shared_count + 2 * f.layout.expert_block);
  REQUIRE(half.space.ranges().size() == 2);
  CpuModel m_all(f.cfg, f.layout, all, f.B, f.T), m_half(f.cfg, f.layout, half, f.B, f.T);
  std::vector<float> g_all(all.space.size(), 0.0f), g_half(half.space.size(), 0.0f);
  m_all.forward_backward(f.params.data(), g_all.data(), f.inputs.data(), f.targets.data(), loss, 1.0f, 1.0f);
  m_half.forward_backward(f.params.data(), g_half.data(), f.inputs.data(), f.targets.data(), loss, 1.0f, 1.0f);
  // Every gradient the half-owner has equals the full owner's, bitwise: the frozen
  // experts' activation gradients reach the shared parameters unchanged.
  for (const ParamTensor& t : f.layout.tensors) {
    const int64_t gh = half.space.packed_index(t.offset), ga = all.space.packed_index(t.offset);
    REQUIRE(ga >= 0);
    if (t.expert >= 0) CHECK((gh >= 0) == (t.expert >= 2));
    if (gh < 0) continue;
    for (int64_t i = 0; i < t.numel(); ++i) REQUIRE(g_half[gh + i] == g_all[ga + i]);
  }
}

TEST_CASE("load-balancing loss is 1 for uniform routing") {
  Fixture f;
  for (const auto& L : f.layout.layers)
    for (int64_t i = 0; i < f.cfg.n_experts * f.cfg.d_model; ++i) f.params[L.router + i] = 0.0f;
  Ownership all = make_ownership(f.cfg, f.layout, 0, 1, OwnershipMode::all, 0);
  CpuModel model(f.cfg, f.layout, all, f.B, f.T);
  LossParts p = model.forward(f.params.data(), f.inputs.data(), f.targets.data(), LossConfig{});
  CHECK(p.lb == doctest::Approx(1.0).epsilon(1e-6));
  // Zero logits: router z-loss = (ln E)².
  CHECK(p.router_z == doctest::Approx(std::log(4.0) * std::log(4.0)).epsilon(1e-5));
}

TEST_CASE("initial loss is close to ln(vocab)") {
  ModelConfig m = small_model();
  m.vocab_size = 256;
  m.init_std = 0.02;
  ParamLayout layout = make_layout(m);
  std::vector<float> params(layout.total);
  init_parameters(params.data(), m, layout, 1);
  Ownership all = make_ownership(m, layout, 0, 1, OwnershipMode::all, 0);
  CpuModel model(m, layout, all, 2, m.seq_len);
  std::vector<int32_t> x(2 * m.seq_len), y(2 * m.seq_len);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = int32_t((i * 37) % 256);
    y[i] = int32_t((i * 91 + 5) % 256);
  }
  LossParts p = model.forward(params.data(), x.data(), y.data(), LossConfig{});
  CHECK(p.ce == doctest::Approx(std::log(256.0)).epsilon(0.01));
}

TEST_CASE("initialisation: seeded, truncated at 3 sigma, norms at 1, independent of ownership") {
  ModelConfig m = small_model();
  m.init_std = 0.02;
  ParamLayout layout = make_layout(m);
  std::vector<float> a(layout.total), b(layout.total), c(layout.total);
  init_parameters(a.data(), m, layout, 5);
  init_parameters(b.data(), m, layout, 5);
  init_parameters(c.data(), m, layout, 6);
  CHECK(a == b);
  CHECK(a != c);
  double sum2 = 0;
  int64_t n = 0;
  for (const auto& t : layout.tensors)
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float w = a[t.offset + i];
      if (t.is_norm()) {
        REQUIRE(w == 1.0f);
      } else {
        REQUIRE(std::fabs(w) <= 3 * 0.02f + 1e-7f);
        sum2 += double(w) * w;
        ++n;
      }
    }
  // Truncation at ±3σ shrinks the std by ~1.3%.
  CHECK(std::sqrt(sum2 / double(n)) == doctest::Approx(0.02 * 0.9866).epsilon(0.03));
}

TEST_CASE("layout: shared first, expert-major blocks, HF names, ownership ranges") {
  ModelConfig m = small_model();
  ParamLayout L = make_layout(m);
  CHECK(L.tensors.front().name == "model.embed_tokens.weight");
  CHECK(L.find("lm_head.weight")->offset < L.shared_count);
  CHECK(L.find("model.layers.1.self_attn.k_norm.weight")->numel() == m.kv_dim());
  const ParamTensor* g = L.find("model.layers.1.mlp.experts.2.gate_proj.weight");
  REQUIRE(g);
  CHECK(g->offset >= L.expert_begin(2));
  CHECK(g->offset + g->numel() <= L.expert_begin(3));
  CHECK(L.find("model.layers.0.mlp.experts.3.down_proj.weight")->rows == m.d_model);
  int64_t sum = 0;
  for (const auto& t : L.tensors) sum += t.numel();
  CHECK(sum == L.total);
  // 4 experts, 2 nodes x 3 experts: replicated experts (p·k + i) mod E.
  Ownership o = make_ownership(m, L, 1, 2, OwnershipMode::partitioned, 3);
  // Node 0 owns {0, 1, 2}, node 1 owns {3, 0, 1}.
  CHECK(o.owners[0] == std::vector<int>{0, 1});
  CHECK(o.owners[1] == std::vector<int>{0, 1});
  CHECK(o.owners[2] == std::vector<int>{0});
  CHECK(o.owners[3] == std::vector<int>{1});
  CHECK(o.owned == std::vector<bool>{true, true, false, true});
  CHECK(o.space.packed_index(L.expert_begin(2)) == -1);
  CHECK(o.space.packed_index(L.expert_begin(3)) == L.shared_count + 2 * L.expert_block);
  Ownership o0 = make_ownership(m, L, 0, 2, OwnershipMode::partitioned, 3);
  CHECK(model_fingerprint(m, L, o) == model_fingerprint(m, L, o0));  // one run, one fingerprint
  Ownership solo = make_ownership(m, L, 0, 1, OwnershipMode::all, 0);
  CHECK(model_fingerprint(m, L, solo) != model_fingerprint(m, L, o0));
}
