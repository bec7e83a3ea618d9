// Tests of the CPU reference ops (engine/ops): finite-difference gradient checks for
// every backward, forward checks against naive double-precision formulas, the
// semantics of the op interface (overwrite vs accumulate, frozen weights, aliasing),
// and determinism across runs and thread counts.
//
// Gradient checks: L = Σ r ⊙ forward(inputs) for a fixed random r, evaluated in
// double from the fp32 outputs; numeric dL/dx_i by central differences with step
// eps (the denominator is the actually representable step). Reported error is
// ‖analytic − numeric‖₂ / ‖numeric‖₂ over the whole gradient tensor.
#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "model/cpu/ops.hpp"

using namespace spes::cpu;

namespace {

using Vec = std::vector<float>;

Vec randn(int64_t n, std::mt19937_64& rng, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  Vec v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

double dot(const Vec& r, const float* out) {
  double s = 0.0;
  for (size_t i = 0; i < r.size(); ++i) s += static_cast<double>(r[i]) * out[i];
  return s;
}

// Central differences of `loss` with respect to every element of x (x is restored).
std::vector<double> numeric_grad(Vec& x, const std::function<double()>& loss, float eps) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float x0 = x[i];
    const float xp = x0 + eps;
    const float xm = x0 - eps;
    x[i] = xp;
    const double lp = loss();
    x[i] = xm;
    const double lm = loss();
    x[i] = x0;
    g[i] = (lp - lm) / (static_cast<double>(xp) - static_cast<double>(xm));
  }
  return g;
}

double rel_err(const Vec& analytic, const std::vector<double>& numeric) {
  REQUIRE(analytic.size() == numeric.size());
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < numeric.size(); ++i) {
    const double d = analytic[i] - numeric[i];
    num += d * d;
    den += numeric[i] * numeric[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

// FD check of one gradient tensor; prints the error so the tolerance can be judged.
void check_grad(const char* what, const Vec& analytic, Vec& x, const std::function<double()>& loss,
                float eps, double tol) {
  const auto numeric = numeric_grad(x, loss, eps);
  const double err = rel_err(analytic, numeric);
  double norm = 0.0;
  for (double g : numeric) norm += g * g;
  MESSAGE(std::string(what) << ": rel err " << err << " (tol " << tol << ", |grad| " << std::sqrt(norm) << ")");
  CHECK(std::sqrt(norm) > 1e-3);  // a vanishing gradient would make the check vacuous
  CHECK(err < tol);
}

bool bitwise_equal(const Vec& a, const Vec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

double max_abs_diff(const float* a, const double* b, size_t n) {
  double m = 0.0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// Runs f under 1, 2 and 3 OpenMP threads (twice under 2) and checks that every run
// produces bitwise the same outputs.
void check_deterministic(const char* what, const std::function<std::vector<Vec>()>& f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  const auto ref = f();
  for (int threads : {2, 1, 3}) {
    omp_set_num_threads(threads);
    const auto got = f();
    REQUIRE(got.size() == ref.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      INFO(what << " output " << i << " with " << threads << " threads");
      CHECK(bitwise_equal(got[i], ref[i]));
    }
  }
  omp_set_num_threads(saved);
}

// ---- naive double-precision references ---------------------------------------

// Causal GQA attention with the explicit T×T softmax matrix.
void naive_attention(std::vector<double>& out, std::vector<double>& lse, const Vec& q, const Vec& k,
                     const Vec& v, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D) {
  out.assign(static_cast<size_t>(B * T * H * D), 0.0);
  lse.assign(static_cast<size_t>(B * H * T), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kvh = h / (H / Hkv);
      std::vector<double> P(static_cast<size_t>(T * T), 0.0);
      for (int64_t i = 0; i < T; ++i) {
        double m = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          double s = 0.0;
          for (int64_t d = 0; d < D; ++d)
            s += static_cast<double>(q[((b * T + i) * H + h) * D + d]) * k[((b * T + j) * Hkv + kvh) * D + d];
          P[i * T + j] = s * scale;
          m = std::max(m, s * scale);
        }
        double z = 0.0;
        for (int64_t j = 0; j <= i; ++j) z += std::exp(P[i * T + j] - m);
        for (int64_t j = 0; j <= i; ++j) P[i * T + j] = std::exp(P[i * T + j] - m) / z;
        lse[(b * H + h) * T + i] = m + std::log(z);
      }
      for (int64_t i = 0; i < T; ++i)
        for (int64_t d = 0; d < D; ++d) {
          double o = 0.0;
          for (int64_t j = 0; j < T; ++j) o += P[i * T + j] * v[((b * T + j) * Hkv + kvh) * D + d];
          out[((b * T + i) * H + h) * D + d] = o;
        }
    }
}

// Its backward from the same explicit matrix: dP = g·vᵀ, dS = P⊙(dP − rowsum(P⊙dP)),
// dq = scale·dS·k, dk = scale·dSᵀ·q, dv = Pᵀ·g (summed over the heads of a group).
void naive_attention_backward(std::vector<double>& dq, std::vector<double>& dk, std::vector<double>& dv,
                              const Vec& g, const Vec& q, const Vec& k, const Vec& v, int64_t B, int64_t T,
                              int64_t H, int64_t Hkv, int64_t D) {
  dq.assign(q.size(), 0.0);
  dk.assign(k.size(), 0.0);
  dv.assign(v.size(), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto Q = [&](int64_t b, int64_t t, int64_t h) { return ((b * T + t) * H + h) * D; };
  auto KV = [&](int64_t b, int64_t t, int64_t h) { return ((b * T + t) * Hkv + h) * D; };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kvh = h / (H / Hkv);
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> p(static_cast<size_t>(i + 1)), dp(static_cast<size_t>(i + 1));
        double m = -1e300, z = 0.0, delta = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          double s = 0.0, gv = 0.0;
          for (int64_t d = 0; d < D; ++d) {
            s += static_cast<double>(q[Q(b, i, h) + d]) * k[KV(b, j, kvh) + d];
            gv += static_cast<double>(g[Q(b, i, h) + d]) * v[KV(b, j, kvh) + d];
          }
          p[j] = s * scale;
          dp[j] = gv;
          m = std::max(m, p[j]);
        }
        for (int64_t j = 0; j <= i; ++j) z += std::exp(p[j] - m);
        for (int64_t j = 0; j <= i; ++j) {
          p[j] = std::exp(p[j] - m) / z;
          delta += p[j] * dp[j];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - delta) * scale;
          for (int64_t d = 0; d < D; ++d) {
            dq[Q(b, i, h) + d] += ds * k[KV(b, j, kvh) + d];
            dk[KV(b, j, kvh) + d] += ds * q[Q(b, i, h) + d];
            dv[KV(b, j, kvh) + d] += p[j] * g[Q(b, i, h) + d];
          }
        }
      }
    }
}

}  // namespace

// ============================== embedding ======================================

TEST_CASE("embedding: forward copies rows, backward scatter-adds (FD, accumulate)") {
  std::mt19937_64 rng(1);
  const int64_t N = 9, V = 5, C = 6;
  const std::vector<int32_t> tokens = {3, 0, 3, 4, 3, 1, 0, 4, 2};  // repeats
  Vec table = randn(V * C, rng);
  Vec out(N * C);
  embedding_forward(out.data(), tokens.data(), table.data(), N, C);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) CHECK(out[n * C + c] == table[tokens[n] * C + c]);

  const Vec r = randn(N * C, rng);
  Vec dtable(V * C, 0.0f);
  embedding_backward(dtable.data(), r.data(), tokens.data(), N, C);
  auto loss = [&] {
    embedding_forward(out.data(), tokens.data(), table.data(), N, C);
    return dot(r, out.data());
  };
  check_grad("embedding dtable", dtable, table, loss, 1e-2f, 1e-4);

  // Weight gradients accumulate (+=).
  Vec acc(V * C, 0.5f);
  embedding_backward(acc.data(), r.data(), tokens.data(), N, C);
  for (int64_t i = 0; i < V * C; ++i) CHECK(acc[i] == doctest::Approx(0.5f + dtable[i]).epsilon(1e-6));
}

// ============================== matmul =========================================

TEST_CASE("matmul: forward vs naive, FD grads, dweight accumulates, null pointers skip") {
  std::mt19937_64 rng(2);
  const int64_t N = 5, C = 7, OC = 3;
  Vec inp = randn(N * C, rng), w = randn(OC * C, rng);
  Vec out(N * OC);
  matmul_forward(out.data(), inp.data(), w.data(), N, C, OC);
  std::vector<double> ref(N * OC);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double s = 0.0;
      for (int64_t c = 0; c < C; ++c) s += static_cast<double>(inp[n * C + c]) * w[o * C + c];
      ref[n * OC + o] = s;
    }
  CHECK(max_abs_diff(out.data(), ref.data(), ref.size()) < 1e-5);

  const Vec r = randn(N * OC, rng);
  Vec dinp(N * C, 123.0f);  // overwritten, so garbage in must not matter
  Vec dw(OC * C, 0.0f);
  matmul_backward(dinp.data(), dw.data(), r.data(), inp.data(), w.data(), N, C, OC);
  auto loss = [&] {
    matmul_forward(out.data(), inp.data(), w.data(), N, C, OC);
    return dot(r, out.data());
  };
  check_grad("matmul dinp", dinp, inp, loss, 1e-2f, 1e-4);
  check_grad("matmul dweight", dw, w, loss, 1e-2f, 1e-4);

  // Accumulate: starting from w0, dweight becomes w0 + grad.
  Vec dw_acc(OC * C);
  for (int64_t i = 0; i < OC * C; ++i) dw_acc[i] = 0.25f * static_cast<float>(i);
  const Vec dw0 = dw_acc;
  matmul_backward(nullptr, dw_acc.data(), r.data(), inp.data(), w.data(), N, C, OC);
  for (int64_t i = 0; i < OC * C; ++i) CHECK(dw_acc[i] == doctest::Approx(dw0[i] + dw[i]).epsilon(1e-5));

  // Frozen weight: null dweight still produces the same dinp.
  Vec dinp2(N * C, -7.0f);
  matmul_backward(dinp2.data(), nullptr, r.data(), inp.data(), w.data(), N, C, OC);
  CHECK(bitwise_equal(dinp2, dinp));

  // An expert with no tokens: nothing happens, dweight unchanged.
  Vec dw_empty = dw0;
  matmul_backward(nullptr, dw_empty.data(), r.data(), inp.data(), w.data(), 0, C, OC);
  CHECK(bitwise_equal(dw_empty, dw0));
}

// ============================== rmsnorm ========================================

TEST_CASE("rmsnorm: forward vs naive, FD grads, dweight accumulates, null dweight") {
  std::mt19937_64 rng(3);
  const int64_t N = 4, C = 8;
  const float eps = 1e-5f;
  Vec inp = randn(N * C, rng), w = randn(C, rng, 0.5f);
  for (auto& x : w) x += 1.0f;
  Vec out(N * C), rstd(N);
  rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, eps);
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0.0;
    for (int64_t c = 0; c < C; ++c) ms += static_cast<double>(inp[n * C + c]) * inp[n * C + c];
    const double r = 1.0 / std::sqrt(ms / C + eps);
    CHECK(rstd[n] == doctest::Approx(r).epsilon(1e-6));
    for (int64_t c = 0; c < C; ++c) CHECK(out[n * C + c] == doctest::Approx(inp[n * C + c] * r * w[c]).epsilon(1e-5));
  }

  const Vec r = randn(N * C, rng);
  Vec dinp(N * C), dw(C, 0.0f);
  rmsnorm_backward(dinp.data(), dw.data(), r.data(), inp.data(), w.data(), rstd.data(), N, C);
  Vec rs(N);
  auto loss = [&] {
    rmsnorm_forward(out.data(), rs.data(), inp.data(), w.data(), N, C, eps);
    return dot(r, out.data());
  };
  check_grad("rmsnorm dinp", dinp, inp, loss, 1e-3f, 2e-3);
  check_grad("rmsnorm dweight", dw, w, loss, 1e-3f, 1e-3);

  Vec dw_acc(C, 1.0f);
  Vec dinp2(N * C);
  rmsnorm_backward(dinp2.data(), dw_acc.data(), r.data(), inp.data(), w.data(), rstd.data(), N, C);
  for (int64_t c = 0; c < C; ++c) CHECK(dw_acc[c] == doctest::Approx(1.0f + dw[c]).epsilon(1e-6));
  Vec dinp3(N * C);
  rmsnorm_backward(dinp3.data(), nullptr, r.data(), inp.data(), w.data(), rstd.data(), N, C);
  CHECK(bitwise_equal(dinp3, dinp));
}

// ============================== rope ===========================================

TEST_CASE("rope: matches the rotate_half formula, aliasing, FD grad") {
  std::mt19937_64 rng(4);
  const int64_t B = 2, T = 5, H = 3, D = 8;
  const double theta = 100.0;  // small theta: every frequency turns visibly over T
  Vec x = randn(B * T * H * D, rng);
  Vec out(x.size());
  rope_forward(out.data(), x.data(), B, T, H, D, theta);

  // HF: inv_freq = θ^(−arange(0,D,2)/D); emb = cat(freqs, freqs);
  // out = x·cos(emb) + rotate_half(x)·sin(emb), rotate_half(x) = cat(−x₂, x₁).
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const int64_t i = d % (D / 2);
          const double ang = static_cast<double>(t) * std::pow(theta, -2.0 * i / D);
          const float* xr = x.data() + ((b * T + t) * H + h) * D;
          const double rot = d < D / 2 ? -xr[d + D / 2] : xr[d - D / 2];
          const double ref = xr[d] * std::cos(ang) + rot * std::sin(ang);
          CHECK(out[((b * T + t) * H + h) * D + d] == doctest::Approx(ref).epsilon(1e-5).scale(1.0));
        }
  // Position 0 is the identity.
  for (int64_t i = 0; i < H * D; ++i) CHECK(out[i] == x[i]);

  // out may alias x (and dx may alias dout).
  Vec inplace = x;
  rope_forward(inplace.data(), inplace.data(), B, T, H, D, theta);
  CHECK(bitwise_equal(inplace, out));
  const Vec r = randn(x.size(), rng);
  Vec dx(x.size());
  rope_backward(dx.data(), r.data(), B, T, H, D, theta);
  Vec dx_inplace = r;
  rope_backward(dx_inplace.data(), dx_inplace.data(), B, T, H, D, theta);
  CHECK(bitwise_equal(dx_inplace, dx));

  auto loss = [&] {
    rope_forward(out.data(), x.data(), B, T, H, D, theta);
    return dot(r, out.data());
  };
  check_grad("rope dx", dx, x, loss, 1e-2f, 1e-4);
}

// ============================== attention ======================================

TEST_CASE("attention: forward and lse vs explicit softmax matrix (MHA and GQA)") {
  std::mt19937_64 rng(5);
  const int64_t B = 2, T = 7, H = 4, D = 8;
  for (int64_t Hkv : {4, 2, 1}) {
    CAPTURE(Hkv);
    Vec q = randn(B * T * H * D, rng), k = randn(B * T * Hkv * D, rng), v = randn(B * T * Hkv * D, rng);
    Vec out(q.size()), lse(B * H * T);
    attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), B, T, H, Hkv, D);
    std::vector<double> ref_out, ref_lse;
    naive_attention(ref_out, ref_lse, q, k, v, B, T, H, Hkv, D);
    CHECK(max_abs_diff(out.data(), ref_out.data(), ref_out.size()) < 1e-5);
    CHECK(max_abs_diff(lse.data(), ref_lse.data(), ref_lse.size()) < 1e-5);
  }
}

TEST_CASE("attention: forward and backward vs explicit matrices over several query blocks") {
  // T = 150 crosses the 64-row query blocks of the implementation (two full, one partial).
  std::mt19937_64 rng(18);
  const int64_t B = 1, T = 150, H = 4, Hkv = 2, D = 16;
  Vec q = randn(B * T * H * D, rng), k = randn(B * T * Hkv * D, rng), v = randn(B * T * Hkv * D, rng);
  const Vec g = randn(q.size(), rng);
  Vec out(q.size()), lse(B * H * T), dq(q.size()), dk(k.size()), dv(v.size());
  attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), B, T, H, Hkv, D);
  attention_backward(dq.data(), dk.data(), dv.data(), g.data(), q.data(), k.data(), v.data(), out.data(),
                     lse.data(), B, T, H, Hkv, D);
  std::vector<double> ro, rl, rdq, rdk, rdv;
  naive_attention(ro, rl, q, k, v, B, T, H, Hkv, D);
  naive_attention_backward(rdq, rdk, rdv, g, q, k, v, B, T, H, Hkv, D);
  CHECK(max_abs_diff(out.data(), ro.data(), ro.size()) < 1e-5);
  CHECK(max_abs_diff(lse.data(), rl.data(), rl.size()) < 1e-5);
  CHECK(max_abs_diff(dq.data(), rdq.data(), rdq.size()) < 1e-4);
  CHECK(max_abs_diff(dk.data(), rdk.data(), rdk.size()) < 1e-4);
  CHECK(max_abs_diff(dv.data(), rdv.data(), rdv.size()) < 1e-4);
}

TEST_CASE("attention: causal (future keys do not change past rows)") {
  std::mt19937_64 rng(6);
  const int64_t B = 1, T = 6, H = 2, Hkv = 2, D = 4;
  Vec q = randn(B * T * H * D, rng), k = randn(B * T * Hkv * D, rng), v = randn(B * T * Hkv * D, rng);
  Vec out(q.size()), lse(B * H * T);
  attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), B, T, H, Hkv, D);
  const int64_t last = (T - 1) * Hkv * D;
  for (int64_t i = 0; i < Hkv * D; ++i) {
    k[last + i] += 3.0f;
    v[last + i] -= 2.0f;
  }
  Vec out2(q.size()), lse2(B * H * T);
  attention_forward(out2.data(), lse2.data(), q.data(), k.data(), v.data(), B, T, H, Hkv, D);
  const int64_t past = (T - 1) * H * D;
  CHECK(std::memcmp(out.data(), out2.data(), past * sizeof(float)) == 0);
  CHECK(std::memcmp(out.data() + past, out2.data() + past, H * D * sizeof(float)) != 0);
  // Row 0 attends only to itself: out = v_0.
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < D; ++d) CHECK(out[h * D + d] == doctest::Approx(v[h * D + d]).epsilon(1e-6));
}

TEST_CASE("attention: GQA equals MHA with kv heads repeated") {
  std::mt19937_64 rng(7);
  const int64_t B = 2, T = 9, H = 4, Hkv = 2, D = 8, group = H / Hkv;
  Vec q = randn(B * T * H * D, rng), k = randn(B * T * Hkv * D, rng), v = randn(B * T * Hkv * D, rng);
  Vec k4(B * T * H * D), v4(B * T * H * D);
  for (int64_t bt = 0; bt < B * T; ++bt)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        k4[(bt * H + h) * D + d] = k[(bt * Hkv + h / group) * D + d];
        v4[(bt * H + h) * D + d] = v[(bt * Hkv + h / group) * D + d];
      }
  Vec out(q.size()), lse(B * H * T), out4(q.size()), lse4(B * H * T);
  attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), B, T, H, Hkv, D);
  attention_forward(out4.data(), lse4.data(), q.data(), k4.data(), v4.data(), B, T, H, H, D);
  CHECK(bitwise_equal(out, out4));
  CHECK(bitwise_equal(lse, lse4));

  const Vec g = randn(q.size(), rng);
  Vec dq(q.size()), dk(k.size()), dv(v.size()), dq4(q.size()), dk4(k4.size()), dv4(v4.size());
  attention_backward(dq.data(), dk.data(), dv.data(), g.data(), q.data(), k.data(), v.data(), out.data(),
                     lse.data(), B, T, H, Hkv, D);
  attention_backward(dq4.data(), dk4.data(), dv4.data(), g.data(), q.data(), k4.data(), v4.data(),
                     out4.data(), lse4.data(), B, T, H, H, D);
  CHECK(bitwise_equal(dq, dq4));
  // A shared kv head's gradient is the sum over the query heads of its group.
  for (int64_t bt = 0; bt < B * T; ++bt)
    for (int64_t kvh = 0; kvh < Hkv; ++kvh)
      for (int64_t d = 0; d < D; ++d) {
        float sk = 0.0f, sv = 0.0f;
        for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
          sk += dk4[(bt * H + h) * D + d];
          sv += dv4[(bt * H + h) * D + d];
        }
        CHECK(dk[(bt * Hkv + kvh) * D + d] == doctest::Approx(sk).epsilon(1e-5).scale(1.0));
        CHECK(dv[(bt * Hkv + kvh) * D + d] == doctest::Approx(sv).epsilon(1e-5).scale(1.0));
      }
}

TEST_CASE("attention: FD gradients of q, k, v (MHA and GQA)") {
  std::mt19937_64 rng(8);
  const int64_t B = 2, T = 5, H = 4, D = 4;
  for (int64_t Hkv : {4, 2}) {
    CAPTURE(Hkv);
    Vec q = randn(B * T * H * D, rng), k = randn(B * T * Hkv * D, rng), v = randn(B * T * Hkv * D, rng);
    Vec out(q.size()), lse(B * H * T);
    attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), B, T, H, Hkv, D);
    const Vec r = randn(q.size(), rng);
    Vec dq(q.size(), 9.0f), dk(k.size(), 9.0f), dv(v.size(), 9.0f);  // overwritten
    attention_backward(dq.data(), dk.data(), dv.data(), r.data(), q.data(), k.data(), v.data(), out.data(),
                       lse.data(), B, T, H, Hkv, D);
    Vec o(q.size()), l(B * H * T);
    auto loss = [&] {
      attention_forward(o.data(), l.data(), q.data(), k.data(), v.data(), B, T, H, Hkv, D);
      return dot(r, o.data());
    };
    check_grad("attention dq", dq, q, loss, 1e-2f, 2e-3);
    check_grad("attention dk", dk, k, loss, 1e-2f, 2e-3);
    check_grad("attention dv", dv, v, loss, 1e-2f, 2e-3);
  }
}

// ============================== router =========================================

TEST_CASE("router: softmax, lse, top-k order, ties to the lower index, renorm") {
  const int64_t E = 5;
  // Row 0: three-way tie at 3 → experts 1, 2 (then 4). Row 1: all equal → 0, 1, 2.
  // Row 2: distinct → descending order.
  const Vec logits = {1, 3, 3, 0, 3, /**/ 0, 0, 0, 0, 0, /**/ 0.5f, -1, 2, 1.5f, 0};
  const int64_t N = 3;
  for (int64_t K : {2, 3}) {
    for (bool renorm : {false, true}) {
      CAPTURE(K);
      CAPTURE(renorm);
      Vec probs(N * E), lse(N), w(N * K);
      std::vector<int32_t> idx(N * K);
      router_forward(probs.data(), lse.data(), idx.data(), w.data(), logits.data(), N, E, K, renorm);
      for (int64_t n = 0; n < N; ++n) {
        double m = -1e30, z = 0.0, psum = 0.0;
        for (int64_t e = 0; e < E; ++e) m = std::max(m, static_cast<double>(logits[n * E + e]));
        for (int64_t e = 0; e < E; ++e) z += std::exp(logits[n * E + e] - m);
        CHECK(lse[n] == doctest::Approx(m + std::log(z)).epsilon(1e-6));
        for (int64_t e = 0; e < E; ++e) {
          CHECK(probs[n * E + e] == doctest::Approx(std::exp(logits[n * E + e] - m) / z).epsilon(1e-6));
          psum += probs[n * E + e];
        }
        CHECK(psum == doctest::Approx(1.0).epsilon(1e-6));
        double wsum = 0.0, psel = 0.0;
        for (int64_t kk = 0; kk < K; ++kk) {
          wsum += w[n * K + kk];
          psel += probs[n * E + idx[n * K + kk]];
        }
        for (int64_t kk = 0; kk < K; ++kk) {
          const double expect = probs[n * E + idx[n * K + kk]] / (renorm ? psel : 1.0);
          CHECK(w[n * K + kk] == doctest::Approx(expect).epsilon(1e-6));
        }
        if (renorm) CHECK(wsum == doctest::Approx(1.0).epsilon(1e-6));
      }
      const std::vector<int32_t> want2 = {1, 2, 0, 1, 2, 3};
      const std::vector<int32_t> want3 = {1, 2, 4, 0, 1, 2, 2, 3, 0};
      CHECK(idx == (K == 2 ? want2 : want3));
    }
  }
}

TEST_CASE("router: FD gradient of routing weights + LB + z-loss, with and without renorm") {
  std::mt19937_64 rng(9);
  const int64_t N = 6, E = 6, K = 2;
  // Logits spaced 0.6 apart (shuffled per token) so an eps-step never changes top-k.
  Vec logits(N * E);
  std::vector<int> perm(E);
  std::iota(perm.begin(), perm.end(), 0);
  std::normal_distribution<float> jitter(0.0f, 0.05f);
  for (int64_t n = 0; n < N; ++n) {
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t e = 0; e < E; ++e) logits[n * E + e] = 0.6f * perm[e] - 1.5f + jitter(rng);
  }
  const Vec r = randn(N * K, rng);      // dL/dtopk_w
  const Vec lb = randn(E, rng, 0.3f);  // LB coefficient per expert
  const float rz = 0.05f;
  for (bool renorm : {false, true}) {
    for (bool with_lb : {true, false}) {
      CAPTURE(renorm);
      CAPTURE(with_lb);
      Vec probs(N * E), lse(N), w(N * K);
      std::vector<int32_t> idx(N * K);
      router_forward(probs.data(), lse.data(), idx.data(), w.data(), logits.data(), N, E, K, renorm);
      Vec dlogits(N * E);
      router_backward(dlogits.data(), r.data(), probs.data(), lse.data(), idx.data(), w.data(),
                      with_lb ? lb.data() : nullptr, rz, N, E, K, renorm);
      Vec p2(N * E), l2(N), w2(N * K);
      std::vector<int32_t> i2(N * K);
      auto loss = [&] {
        router_forward(p2.data(), l2.data(), i2.data(), w2.data(), logits.data(), N, E, K, renorm);
        REQUIRE(i2 == idx);  // the step did not change the selection
        double L = dot(r, w2.data());
        for (int64_t n = 0; n < N; ++n) {
          if (with_lb)
            for (int64_t e = 0; e < E; ++e) L += static_cast<double>(lb[e]) * p2[n * E + e];
          L += static_cast<double>(rz) * l2[n] * l2[n];
        }
        return L;
      };
      check_grad("router dlogits", dlogits, logits, loss, 1e-3f, 2e-3);
    }
  }
}

// ============================== moe dispatch / combine =========================

TEST_CASE("moe: dispatch indices are a stable expert-major permutation") {
  std::mt19937_64 rng(10);
  const int64_t N = 13, E = 5, K = 2;
  // Random distinct pairs from experts 0..3: expert 4 gets no tokens.
  std::vector<int32_t> topk(N * K);
  std::uniform_int_distribution<int32_t> pick(0, 3);
  for (int64_t t = 0; t < N; ++t) {
    topk[t * K] = pick(rng);
    do topk[t * K + 1] = pick(rng);
    while (topk[t * K + 1] == topk[t * K]);
  }
  std::vector<int32_t> offsets(E + 1, -1), slot_token(N * K, -1), token_slot(N * K, -1);
  moe_dispatch_indices(offsets.data(), slot_token.data(), token_slot.data(), topk.data(), N, E, K);
  CHECK(offsets[0] == 0);
  CHECK(offsets[E] == N * K);
  for (int64_t e = 0; e < E; ++e) {
    const auto count = std::count(topk.begin(), topk.end(), static_cast<int32_t>(e));
    CHECK(offsets[e + 1] - offsets[e] == count);
    // Stable: within an expert, tokens in increasing order.
    for (int32_t s = offsets[e] + 1; s < offsets[e + 1]; ++s) CHECK(slot_token[s - 1] < slot_token[s]);
  }
  CHECK(offsets[4] == offsets[5]);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t kk = 0; kk < K; ++kk) {
      const int32_t s = token_slot[t * K + kk];
      const int32_t e = topk[t * K + kk];
      REQUIRE(s >= 0);
      REQUIRE(s < N * K);
      CHECK(slot_token[s] == t);
      CHECK(s >= offsets[e]);
      CHECK(s < offsets[e + 1]);
    }

  // Gather forward copies rows; gather backward of ones gives K per token.
  const int64_t C = 3;
  Vec x = randn(N * C, rng), xe(N * K * C);
  moe_gather_forward(xe.data(), x.data(), slot_token.data(), N * K, C);
  for (int64_t s = 0; s < N * K; ++s)
    for (int64_t c = 0; c < C; ++c) CHECK(xe[s * C + c] == x[slot_token[s] * C + c]);
  Vec ones(N * K * C, 1.0f), dx(N * C, -1.0f);
  moe_gather_backward(dx.data(), ones.data(), token_slot.data(), N, K, C);
  for (float d : dx) CHECK(d == static_cast<float>(K));

  // Round trip: identity experts combined with weights summing to 1 give x back.
  Vec wts(N * K);
  for (int64_t t = 0; t < N; ++t) {
    wts[t * K] = 0.3f;
    wts[t * K + 1] = 0.7f;
  }
  Vec y(N * C);
  moe_combine_forward(y.data(), xe.data(), wts.data(), token_slot.data(), N, K, C);
  for (int64_t i = 0; i < N * C; ++i) CHECK(y[i] == doctest::Approx(x[i]).epsilon(1e-6));
}

TEST_CASE("moe: gather and combine FD gradients") {
  std::mt19937_64 rng(11);
  const int64_t N = 7, E = 3, K = 2, C = 4, S = N * K;
  const std::vector<int32_t> topk = {0, 2, 1, 0, 2, 1, 0, 1, 2, 0, 1, 2, 0, 2};
  std::vector<int32_t> offsets(E + 1), slot_token(S), token_slot(S);
  moe_dispatch_indices(offsets.data(), slot_token.data(), token_slot.data(), topk.data(), N, E, K);

  // Combine: out[t] = Σ_k w[t,k]·ye[slot(t,k)].
  Vec ye = randn(S * C, rng), w = randn(N * K, rng);
  Vec out(N * C);
  moe_combine_forward(out.data(), ye.data(), w.data(), token_slot.data(), N, K, C);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double ref = 0.0;
      for (int64_t kk = 0; kk < K; ++kk)
        ref += static_cast<double>(w[t * K + kk]) * ye[token_slot[t * K + kk] * C + c];
      CHECK(out[t * C + c] == doctest::Approx(ref).epsilon(1e-6).scale(1.0));
    }
  const Vec r = randn(N * C, rng);
  Vec dye(S * C, 5.0f), dw(N * K, 5.0f);
  moe_combine_backward(dye.data(), dw.data(), r.data(), ye.data(), w.data(), token_slot.data(), N, K, C);
  auto closs = [&] {
    moe_combine_forward(out.data(), ye.data(), w.data(), token_slot.data(), N, K, C);
    return dot(r, out.data());
  };
  check_grad("combine dye", dye, ye, closs, 1e-2f, 1e-4);
  check_grad("combine dtopk_w", dw, w, closs, 1e-2f, 1e-4);

  // Gather: xe[s] = x[slot_token[s]].
  Vec x = randn(N * C, rng), xe(S * C);
  const Vec rg = randn(S * C, rng);
  Vec dx(N * C, 5.0f);
  moe_gather_backward(dx.data(), rg.data(), token_slot.data(), N, K, C);
  auto gloss = [&] {
    moe_gather_forward(xe.data(), x.data(), slot_token.data(), S, C);
    return dot(rg, xe.data());
  };
  check_grad("gather dx", dx, x, gloss, 1e-2f, 1e-4);
}

// ============================== swiglu =========================================

TEST_CASE("swiglu: forward vs formula, FD gradients") {
  std::mt19937_64 rng(12);
  const int64_t n = 40;
  Vec gate = randn(n, rng, 2.0f), up = randn(n, rng);
  Vec h(n);
  swiglu_forward(h.data(), gate.data(), up.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    CHECK(h[i] == doctest::Approx(g / (1.0 + std::exp(-g)) * up[i]).epsilon(1e-6).scale(1.0));
  }
  const Vec r = randn(n, rng);
  Vec dg(n), du(n);
  swiglu_backward(dg.data(), du.data(), r.data(), gate.data(), up.data(), n);
  auto loss = [&] {
    swiglu_forward(h.data(), gate.data(), up.data(), n);
    return dot(r, h.data());
  };
  check_grad("swiglu dgate", dg, gate, loss, 1e-3f, 1e-3);
  check_grad("swiglu dup", du, up, loss, 1e-2f, 1e-4);

  // Saturated gates stay finite and exact-ish: silu(g) → g for g ≫ 0, → 0 for g ≪ 0.
  const Vec big = {-1e6f, -1000.0f, -100.0f, -88.5f, -30.0f, 30.0f, 88.5f, 100.0f, 1000.0f, 1e6f};
  const Vec ones(big.size(), 1.0f);
  Vec hb(big.size()), dgb(big.size()), dub(big.size());
  swiglu_forward(hb.data(), big.data(), ones.data(), static_cast<int64_t>(big.size()));
  swiglu_backward(dgb.data(), dub.data(), ones.data(), big.data(), ones.data(), static_cast<int64_t>(big.size()));
  for (size_t i = 0; i < big.size(); ++i) {
    CAPTURE(big[i]);
    const double gd = big[i], sig = 1.0 / (1.0 + std::exp(-gd));
    CHECK(std::isfinite(hb[i]));
    CHECK(std::isfinite(dgb[i]));
    CHECK(hb[i] == doctest::Approx(gd * sig).epsilon(1e-6).scale(1.0));
    CHECK(dgb[i] == doctest::Approx(sig * (1.0 + gd * (1.0 - sig))).epsilon(1e-6).scale(1.0));
  }
}

// ============================== cross-entropy ==================================

TEST_CASE("crossentropy: forward vs naive, FD gradient with z-loss, in place") {
  std::mt19937_64 rng(13);
  const int64_t N = 5, V = 11;
  Vec logits = randn(N * V, rng, 2.0f);
  const std::vector<int32_t> targets = {0, 10, 3, 3, 7};
  Vec losses(N), lse(N);
  crossentropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
  for (int64_t n = 0; n < N; ++n) {
    double z = 0.0;
    for (int64_t i = 0; i < V; ++i) z += std::exp(static_cast<double>(logits[n * V + i]));
    CHECK(lse[n] == doctest::Approx(std::log(z)).epsilon(1e-6));
    CHECK(losses[n] == doctest::Approx(std::log(z) - logits[n * V + targets[n]]).epsilon(1e-5));
  }

  const float ce_scale = 1.0f / N, z_scale = 0.1f;
  Vec dlogits(N * V);
  crossentropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), N, V, ce_scale, z_scale);
  Vec l2(N), s2(N);
  auto loss = [&] {
    crossentropy_forward(l2.data(), s2.data(), logits.data(), targets.data(), N, V);
    double L = 0.0;
    for (int64_t n = 0; n < N; ++n) L += static_cast<double>(ce_scale) * l2[n] + static_cast<double>(z_scale) * s2[n] * s2[n];
    return L;
  };
  check_grad("crossentropy dlogits", dlogits, logits, loss, 1e-3f, 2e-3);

  // dlogits may alias logits: same bits as out of place.
  Vec inplace = logits;
  crossentropy_backward(inplace.data(), inplace.data(), lse.data(), targets.data(), N, V, ce_scale, z_scale);
  CHECK(bitwise_equal(inplace, dlogits));

  // Without the z-loss every row of the gradient sums to zero.
  crossentropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), N, V, 1.0f, 0.0f);
  for (int64_t n = 0; n < N; ++n) {
    double s = 0.0;
    for (int64_t i = 0; i < V; ++i) s += dlogits[n * V + i];
    CHECK(std::fabs(s) < 1e-6);
  }
}

// ============================== adamw & norms ==================================

TEST_CASE("adamw: one hand-computed step, then several steps vs a double reference") {
  // p=1, g=0.5, lr=0.1, wd=0.1, t=1: decay → 0.99; m=0.05, v=2.5e-4; m̂=0.5, v̂=0.25;
  // step = 0.1·0.5/(0.5+1e-8) ≈ 0.1  →  p = 0.89.
  float p = 1.0f, g = 0.5f, m = 0.0f, v = 0.0f;
  adamw_update(&p, &g, &m, &v, 1, 0.1f, 0.9f, 0.999f, 1e-8f, 0.1f, 1);
  CHECK(m == doctest::Approx(0.05).epsilon(1e-6));
  CHECK(v == doctest::Approx(2.5e-4).epsilon(1e-6));
  CHECK(p == doctest::Approx(0.89).epsilon(1e-6));

  std::mt19937_64 rng(14);
  const int64_t n = 100;
  Vec param = randn(n, rng), mm(n, 0.0f), vv(n, 0.0f);
  std::vector<double> pd(param.begin(), param.end()), md(n, 0.0), vd(n, 0.0);
  const float lr = 3e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  for (int64_t t = 1; t <= 5; ++t) {
    const Vec grad = randn(n, rng);
    adamw_update(param.data(), grad.data(), mm.data(), vv.data(), n, lr, b1, b2, eps, wd, t);
    for (int64_t i = 0; i < n; ++i) {
      pd[i] *= 1.0 - static_cast<double>(lr) * wd;
      md[i] = b1 * md[i] + (1.0 - b1) * grad[i];
      vd[i] = b2 * vd[i] + (1.0 - b2) * grad[i] * grad[i];
      const double mhat = md[i] / (1.0 - std::pow(static_cast<double>(b1), t));
      const double vhat = vd[i] / (1.0 - std::pow(static_cast<double>(b2), t));
      pd[i] -= lr * mhat / (std::sqrt(vhat) + eps);
    }
  }
  CHECK(max_abs_diff(param.data(), pd.data(), n) < 1e-6);
  CHECK(max_abs_diff(mm.data(), md.data(), n) < 1e-6);
  CHECK(max_abs_diff(vv.data(), vd.data(), n) < 1e-6);

  // Zero weight decay and zero gradient leave a parameter untouched.
  float p0 = 0.7f, g0 = 0.0f, m0 = 0.0f, v0 = 0.0f;
  adamw_update(&p0, &g0, &m0, &v0, 1, 0.1f, 0.9f, 0.999f, 1e-8f, 0.0f, 1);
  CHECK(p0 == 0.7f);
}

TEST_CASE("sum_squares and scale_inplace") {
  std::mt19937_64 rng(15);
  for (int64_t n : {0, 1, 5, 63, 64, 1000, 100003}) {
    CAPTURE(n);
    Vec g = randn(n, rng);
    double ref = 0.0;
    for (float x : g) ref += static_cast<double>(x) * x;
    CHECK(sum_squares(g.data(), n) == doctest::Approx(ref).epsilon(1e-12));
    Vec s = g;
    scale_inplace(s.data(), n, 0.5f);
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) wrong += s[i] != g[i] * 0.5f;
    CHECK(wrong == 0);
  }
}

// ============================== determinism ====================================

TEST_CASE("every op is bitwise deterministic across runs and thread counts") {
  std::mt19937_64 rng(16);
  const int64_t B = 2, T = 97, H = 4, Hkv = 2, D = 16, N = B * T, C = 48, V = 37, E = 6, K = 2;
  const Vec q = randn(B * T * H * D, rng), k = randn(B * T * Hkv * D, rng), v = randn(B * T * Hkv * D, rng);
  const Vec x = randn(N * C, rng), gx = randn(N * C, rng), w = randn(C, rng), lb = randn(E, rng);
  const Vec wmat = randn(C * C, rng), logits = randn(N * V, rng), rl = randn(N * E, rng);
  const Vec gq = randn(q.size(), rng), gk = randn(N * K, rng);
  std::vector<int32_t> tokens(N), targets(N);
  for (int64_t n = 0; n < N; ++n) {
    tokens[n] = static_cast<int32_t>((n * 7) % 5);  // many repeats
    targets[n] = static_cast<int32_t>((n * 13) % V);
  }

  check_deterministic("embedding", [&] {
    Vec out(N * C), dt(5 * C, 0.0f);
    embedding_forward(out.data(), tokens.data(), x.data(), N, C);
    embedding_backward(dt.data(), gx.data(), tokens.data(), N, C);
    return std::vector<Vec>{out, dt};
  });
  check_deterministic("matmul", [&] {
    Vec out(N * C), di(N * C), dw(C * C, 0.0f);
    matmul_forward(out.data(), x.data(), wmat.data(), N, C, C);
    matmul_backward(di.data(), dw.data(), gx.data(), x.data(), wmat.data(), N, C, C);
    return std::vector<Vec>{out, di, dw};
  });
  check_deterministic("rmsnorm", [&] {
    Vec out(N * C), rs(N), di(N * C), dw(C, 0.0f);
    rmsnorm_forward(out.data(), rs.data(), x.data(), w.data(), N, C, 1e-5f);
    rmsnorm_backward(di.data(), dw.data(), gx.data(), x.data(), w.data(), rs.data(), N, C);
    return std::vector<Vec>{out, rs, di, dw};
  });
  check_deterministic("rope", [&] {
    Vec out(q.size()), dx(q.size());
    rope_forward(out.data(), q.data(), B, T, H, D, 10000.0);
    rope_backward(dx.data(), gq.data(), B, T, H, D, 10000.0);
    return std::vector<Vec>{out, dx};
  });
  check_deterministic("attention", [&] {
    Vec out(q.size()), lse(B * H * T), dq(q.size()), dk(k.size()), dv(v.size());
    attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), B, T, H, Hkv, D);
    attention_backward(dq.data(), dk.data(), dv.data(), gq.data(), q.data(), k.data(), v.data(), out.data(),
                       lse.data(), B, T, H, Hkv, D);
    return std::vector<Vec>{out, lse, dq, dk, dv};
  });
  check_deterministic("router+moe", [&] {
    Vec probs(N * E), lse(N), tw(N * K), dl(N * E);
    std::vector<int32_t> idx(N * K), offsets(E + 1), slot_token(N * K), token_slot(N * K);
    router_forward(probs.data(), lse.data(), idx.data(), tw.data(), rl.data(), N, E, K, true);
    router_backward(dl.data(), gk.data(), probs.data(), lse.data(), idx.data(), tw.data(), lb.data(), 0.01f,
                    N, E, K, true);
    moe_dispatch_indices(offsets.data(), slot_token.data(), token_slot.data(), idx.data(), N, E, K);
    Vec xe(N * K * C), dx(N * C), y(N * C), dye(N * K * C), dtw(N * K);
    moe_gather_forward(xe.data(), x.data(), slot_token.data(), N * K, C);
    moe_gather_backward(dx.data(), xe.data(), token_slot.data(), N, K, C);
    moe_combine_forward(y.data(), xe.data(), tw.data(), token_slot.data(), N, K, C);
    moe_combine_backward(dye.data(), dtw.data(), gx.data(), xe.data(), tw.data(), token_slot.data(), N, K, C);
    Vec idxf(idx.begin(), idx.end()), slots(token_slot.begin(), token_slot.end());
    return std::vector<Vec>{probs, lse, tw, dl, idxf, slots, xe, dx, y, dye, dtw};
  });
  check_deterministic("swiglu+crossentropy", [&] {
    Vec h(N * C), dg(N * C), du(N * C), losses(N), lse(N), dlog(N * V);
    swiglu_forward(h.data(), x.data(), gx.data(), N * C);
    swiglu_backward(dg.data(), du.data(), w.data(), x.data(), gx.data(), C);
    crossentropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
    crossentropy_backward(dlog.data(), logits.data(), lse.data(), targets.data(), N, V, 0.1f, 1e-3f);
    return std::vector<Vec>{h, dg, du, losses, lse, dlog};
  });
  check_deterministic("adamw+sum_squares", [&] {
    Vec p = x, m(N * C, 0.0f), vv(N * C, 0.0f);
    adamw_update(p.data(), gx.data(), m.data(), vv.data(), N * C, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3);
    const double ss = sum_squares(gx.data(), N * C);
    Vec ssv(2);
    std::memcpy(ssv.data(), &ss, sizeof(double));
    return std::vector<Vec>{p, m, vv, ssv};
  });
}

// ============================== timing (opt-in) ================================
// Not a test: `spes_tests --test-case='ops timing*' --no-skip` prints per-op times
// (best of several runs, wall clock) at the tiny config (d 128, 4 heads of 32, seq 256,
// micro-batch 8, 8 experts top-2, expert hidden 256, vocab 256, 4 layers) and the sum
// of all op calls of one micro-batch forward+backward.

TEST_CASE("ops timing at the tiny config" * doctest::skip()) {
  std::mt19937_64 rng(17);
  const int64_t B = 8, T = 256, H = 4, D = 32, N = B * T, C = 128, F = 256, V = 256, E = 8, K = 2;
  const int64_t L = 4, S = N * K, Ne = S / E;  // Ne: tokens per expert when balanced
  auto time_ms = [](int reps, const std::function<void()>& f) {
    f();  // warm up
    double best = 1e30;
    for (int i = 0; i < reps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      f();
      best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  double step = 0.0;
  auto report = [&](const char* what, double ms, int64_t calls) {
    std::printf("%-44s %8.3f ms  x%-3ld\n", what, ms, static_cast<long>(calls));
    step += ms * static_cast<double>(calls);
  };
  std::printf("OpenMP threads %d\n", omp_get_max_threads());

  const Vec q = randn(N * C, rng), k = randn(N * C, rng), v = randn(N * C, rng), g = randn(N * C, rng);
  Vec out(N * C), lse(B * H * T), dq(N * C), dk(N * C), dv(N * C);
  report("attention_forward  B8 T256 H4 D32", time_ms(10, [&] {
    attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), B, T, H, H, D);
  }), L);
  report("attention_backward B8 T256 H4 D32", time_ms(10, [&] {
    attention_backward(dq.data(), dk.data(), dv.data(), g.data(), q.data(), k.data(), v.data(), out.data(),
                       lse.data(), B, T, H, H, D);
  }), L);

  const Vec w = randn(V * C, rng), x = randn(N * F, rng), gy = randn(N * V, rng);
  Vec y(N * V), dx(N * F), dw(V * C, 0.0f);
  report("matmul_forward  N2048 C128 OC128 (q,k,v,o)", time_ms(20, [&] {
    matmul_forward(y.data(), x.data(), w.data(), N, C, C);
  }), 4 * L);
  report("matmul_backward N2048 C128 OC128 (q,k,v,o)", time_ms(20, [&] {
    matmul_backward(dx.data(), dw.data(), gy.data(), x.data(), w.data(), N, C, C);
  }), 4 * L);
  report("matmul_forward  N512 C128 OC256 (expert gate/up)", time_ms(20, [&] {
    matmul_forward(y.data(), x.data(), w.data(), Ne, C, F);
  }), 2 * E * L);
  report("matmul_backward N512 C128 OC256 (expert gate/up)", time_ms(20, [&] {
    matmul_backward(dx.data(), dw.data(), gy.data(), x.data(), w.data(), Ne, C, F);
  }), 2 * E * L);
  report("matmul_forward  N512 C256 OC128 (expert down)", time_ms(20, [&] {
    matmul_forward(y.data(), x.data(), w.data(), Ne, F, C);
  }), E * L);
  report("matmul_backward N512 C256 OC128 (expert down)", time_ms(20, [&] {
    matmul_backward(dx.data(), dw.data(), gy.data(), x.data(), w.data(), Ne, F, C);
  }), E * L);
  report("matmul_forward  N2048 C128 OC8 (router)", time_ms(20, [&] {
    matmul_forward(y.data(), x.data(), w.data(), N, C, E);
  }), L);
  report("matmul_backward N2048 C128 OC8 (router)", time_ms(20, [&] {
    matmul_backward(dx.data(), dw.data(), gy.data(), x.data(), w.data(), N, C, E);
  }), L);
  report("matmul_forward  N2048 C128 OC256 (lm_head)", time_ms(20, [&] {
    matmul_forward(y.data(), x.data(), w.data(), N, C, V);
  }), 1);
  report("matmul_backward N2048 C128 OC256 (lm_head)", time_ms(20, [&] {
    matmul_backward(dx.data(), dw.data(), gy.data(), x.data(), w.data(), N, C, V);
  }), 1);

  Vec h(S * F), dg(S * F), du(S * F);
  const Vec up = randn(S * F, rng), gate = randn(S * F, rng);
  report("swiglu fwd+bwd n=4096*256", time_ms(20, [&] {
    swiglu_forward(h.data(), gate.data(), up.data(), S * F);
    swiglu_backward(dg.data(), du.data(), h.data(), gate.data(), up.data(), S * F);
  }), L);
  Vec rs(N), nrm(N * C), wn(C, 1.0f), dwn(C, 0.0f);
  report("rmsnorm fwd+bwd N2048 C128", time_ms(20, [&] {
    rmsnorm_forward(nrm.data(), rs.data(), q.data(), wn.data(), N, C, 1e-5f);
    rmsnorm_backward(dq.data(), dwn.data(), g.data(), q.data(), wn.data(), rs.data(), N, C);
  }), 4 * L + 1);
  report("rope fwd+bwd B8 T256 H4 D32", time_ms(20, [&] {
    rope_forward(out.data(), q.data(), B, T, H, D, 10000.0);
    rope_backward(dq.data(), g.data(), B, T, H, D, 10000.0);
  }), 2 * L);

  Vec probs(N * E), rlse(N), tw(N * K), dl(N * E), dtw(N * K, 0.1f), lb(E, 0.01f);
  std::vector<int32_t> idx(N * K), offsets(E + 1), slot_token(S), token_slot(S);
  const Vec logits8 = randn(N * E, rng);
  report("router fwd+bwd + dispatch N2048 E8 K2", time_ms(20, [&] {
    router_forward(probs.data(), rlse.data(), idx.data(), tw.data(), logits8.data(), N, E, K, false);
    router_backward(dl.data(), dtw.data(), probs.data(), rlse.data(), idx.data(), tw.data(), lb.data(), 1e-3f, N,
                    E, K, false);
    moe_dispatch_indices(offsets.data(), slot_token.data(), token_slot.data(), idx.data(), N, E, K);
  }), L);
  Vec xe(S * C), ye(S * C), dye(S * C), mo(N * C), dtw2(N * K);
  report("moe gather+combine fwd+bwd N2048 K2 C128", time_ms(20, [&] {
    moe_gather_forward(xe.data(), q.data(), slot_token.data(), S, C);
    moe_combine_forward(mo.data(), xe.data(), tw.data(), token_slot.data(), N, K, C);
    moe_combine_backward(dye.data(), dtw2.data(), g.data(), xe.data(), tw.data(), token_slot.data(), N, K, C);
    moe_gather_backward(dq.data(), dye.data(), token_slot.data(), N, K, C);
  }), L);

  std::vector<int32_t> targets(N);
  for (int64_t n = 0; n < N; ++n) targets[n] = static_cast<int32_t>(n % V);
  Vec losses(N), clse(N), dlog(N * V);
  report("crossentropy fwd+bwd N2048 V256", time_ms(20, [&] {
    crossentropy_forward(losses.data(), clse.data(), gy.data(), targets.data(), N, V);
    crossentropy_backward(dlog.data(), gy.data(), clse.data(), targets.data(), N, V, 1.0f / N, 1e-5f);
  }), 1);
  std::vector<int32_t> tokens(N);
  for (int64_t n = 0; n < N; ++n) tokens[n] = static_cast<int32_t>((n * 31) % V);
  Vec table = randn(V * C, rng), dtable(V * C, 0.0f);
  report("embedding fwd+bwd N2048 C128", time_ms(20, [&] {
    embedding_forward(out.data(), tokens.data(), table.data(), N, C);
    embedding_backward(dtable.data(), g.data(), tokens.data(), N, C);
  }), 1);
  std::printf("sum of op calls per micro-batch (fwd+bwd, %ld tokens): %.1f ms -> %.0f tokens/s\n",
              static_cast<long>(N), step, static_cast<double>(N) / (step / 1000.0));
}
