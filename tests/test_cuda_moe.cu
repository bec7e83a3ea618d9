// CUDA router, dispatch/combine and SwiGLU against the CPU reference ops
// (model/cpu/ops.hpp); the experts' GEMMs are test_cuda_grouped_gemm's, the whole MoE
// block in the model test_gpu_step's. Inputs are drawn fresh every run, every output buffer
// is NaN-poisoned first (0xFF bytes: NaN in fp32 and bf16), and the CPU reference
// sees exactly the bf16 values the GPU sees, so what is measured is the GPU's own
// rounding. Tolerances (‖gpu − cpu‖ / ‖cpu‖):
//   fp32 router math (probs, lse, weights, LB, RZ, fp32 dlogits): 1e-5 … 1e-4
//     (summation order only);
//   bf16 outputs of one rounding (gather/combine, SwiGLU, bf16 dlogits): 1e-2
//     (bf16 has a 2^-9 relative step, ≈ 2e-3 per rounding).
// Router logits are built from values on a 1/8 grid so the fp32 logits are exact on
// both sides whatever the summation order: top-k choices (many exact ties, broken to
// the lower index) then must agree exactly, not just "almost always".
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/check.cuh"
#include "cuda/moe.cuh"
#include "cuda/router.cuh"
#include "cuda/swiglu.cuh"
#include "model/cpu/ops.hpp"
#include "tests/cuda_test.cuh"
#include "tests/kernel_cases.hpp"

namespace {

using spes::cuda::bf16;
using Vec = std::vector<float>;
using IVec = std::vector<int32_t>;

// ---- small device helpers ---------------------------------------------------------
// Everything runs on the runtime's stream (tests/cuda_test.cuh), kernels included.
cudaStream_t stream() { return spes::test::stream(); }

// A poisoned device array, optionally filled from a host vector.
template <typename T>
class Dev {
 public:
  explicit Dev(int64_t n) : t_(n) { poison(); }
  explicit Dev(const std::vector<T>& v) : Dev(static_cast<int64_t>(v.size())) { upload(v); }
  T* get() const { return t_.get(); }
  int64_t size() const { return t_.n; }
  void poison() { t_.poison(); }
  void upload(const std::vector<T>& v) { spes::test::copy_to_device(get(), v.data(), static_cast<int64_t>(v.size())); }
  std::vector<T> download() const { return spes::test::copy_to_host(get(), t_.n); }

 private:
  spes::test::DevTensor<T> t_;
};

std::vector<bf16> to_bf16(const Vec& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16_rn(v[i]);
  return out;
}
Vec to_float(const std::vector<bf16>& v) {
  Vec out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}
// Values the GPU can hold exactly in bf16.
Vec round_bf16(const Vec& v) { return to_float(to_bf16(v)); }

// Normal values snapped to a grid of `step`, clipped to ±clip (exact in bf16 when
// clip/step < 256).
Vec grid_vector(int64_t n, float scale, float step, float clip) {
  Vec v = spes::test::random_vector(n, scale);
  for (auto& x : v) x = std::clamp(std::round(x / step) * step, -clip, clip);
  return v;
}

Vec uniform_vector(int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  Vec v(n);
  for (auto& x : v) x = d(spes::test::rng());
  return v;
}

// K distinct experts per token, drawn from `allowed`.
IVec random_topk(int64_t N, int64_t K, std::vector<int32_t> allowed) {
  IVec idx(N * K);
  for (int64_t t = 0; t < N; ++t) {
    std::shuffle(allowed.begin(), allowed.end(), spes::test::rng());
    for (int64_t k = 0; k < K; ++k) idx[t * K + k] = allowed[k];
  }
  return idx;
}

template <typename T>
int64_t first_mismatch(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return -1;
}

// Exact equality of two vectors; prints the first mismatch.
#define CHECK_SAME(name, a, b)                                                                     \
  do {                                                                                             \
    const auto& a_ = (a);                                                                          \
    const auto& b_ = (b);                                                                          \
    const int64_t at_ = first_mismatch(a_, b_);                                                    \
    if (at_ >= 0 && a_.size() == b_.size())                                                        \
      MESSAGE(name << ": first mismatch at " << at_ << ": " << a_[at_] << " vs " << b_[at_]);      \
    CHECK_MESSAGE(at_ < 0, name << " differs (sizes " << a_.size() << ", " << b_.size() << ")");   \
  } while (0)

bool bits_equal(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

// ---- router ---------------------------------------------------------------------------

struct RouterCase {
  int64_t N, E, K;
  bool renorm;
};

void check_router_forward(const RouterCase& rc, bool bf16_logits, bool in_place) {
  const int64_t N = rc.N, E = rc.E, K = rc.K;
  CAPTURE(N);
  CAPTURE(E);
  CAPTURE(K);
  CAPTURE(rc.renorm);
  CAPTURE(bf16_logits);
  // Quarter-grid logits: many exact ties, all exact in bf16.
  const Vec logits = grid_vector(N * E, 1.5f, 0.25f, 8.0f);
  Vec probs(N * E), lse(N), w(N * K);
  IVec idx(N * K);
  spes::cpu::router_forward(probs.data(), lse.data(), idx.data(), w.data(), logits.data(), N, E, K, rc.renorm);

  Dev<float> d_probs(N * E), d_lse(N), d_w(N * K), d_part(spes::cuda::router_partials_count(N, E));
  Dev<int32_t> d_idx(N * K);
  if (bf16_logits) {
    Dev<bf16> d_logits(to_bf16(logits));
    spes::cuda::router_forward(d_probs.get(), d_lse.get(), d_idx.get(), d_w.get(), d_part.get(),
                               d_logits.get(), N, E, K, rc.renorm, stream());
  } else if (in_place) {
    d_probs.upload(logits);
    spes::cuda::router_forward(d_probs.get(), d_lse.get(), d_idx.get(), d_w.get(), d_part.get(),
                               d_probs.get(), N, E, K, rc.renorm, stream());
  } else {
    Dev<float> d_logits(logits);
    spes::cuda::router_forward(d_probs.get(), d_lse.get(), d_idx.get(), d_w.get(), d_part.get(),
                               d_logits.get(), N, E, K, rc.renorm, stream());
  }
  const Vec g_probs = d_probs.download(), g_lse = d_lse.download(), g_w = d_w.download();
  const IVec g_idx = d_idx.download();
  CHECK_REL("router probs", g_probs.data(), probs.data(), N * E, 1e-5);
  CHECK_REL("router lse", g_lse.data(), lse.data(), N, 1e-5);
  CHECK_SAME("router top-k indices", g_idx, idx);
  CHECK_REL("router top-k weights", g_w.data(), w.data(), N * K, 1e-5);

  // LB / RZ statistics, against the formula (README, Architecture: "Loss") in double on the CPU outputs.
  IVec offsets(E + 1), slot_token(N * K), token_slot(N * K);
  spes::cpu::moe_dispatch_indices(offsets.data(), slot_token.data(), token_slot.data(), idx.data(), N, E, K);
  const Vec count_scale = uniform_vector(E, 0.7f, 1.0f);
  Dev<int32_t> d_off(offsets);
  Dev<float> d_scale(count_scale), d_aux(2), d_lbw(E);
  spes::cuda::router_aux_forward(d_aux.get(), d_lbw.get(), d_part.get(), d_off.get(), d_scale.get(), N, E, K,
                                 stream());
  const Vec aux = d_aux.download(), lbw = d_lbw.download();
  double lb = 0.0, rz = 0.0;
  Vec lbw_ref(E);
  for (int64_t e = 0; e < E; ++e) {
    double psum = 0.0;
    for (int64_t t = 0; t < N; ++t) psum += probs[t * E + e];
    const double wgt = double(count_scale[e]) * (offsets[e + 1] - offsets[e]) * double(E) / (double(K) * N * N);
    lbw_ref[e] = static_cast<float>(wgt);
    lb += wgt * psum;
  }
  for (int64_t t = 0; t < N; ++t) rz += double(lse[t]) * lse[t];
  rz /= double(N);
  const float lb_ref = static_cast<float>(lb), rz_ref = static_cast<float>(rz);
  CHECK_REL("LB loss", &aux[0], &lb_ref, 1, 1e-4);
  CHECK_REL("router z-loss", &aux[1], &rz_ref, 1, 1e-4);
  CHECK_REL("LB per-expert weight", lbw.data(), lbw_ref.data(), E, 1e-5);

  // Deterministic: the same partials reduce to the same bits.
  spes::cuda::router_aux_forward(d_aux.get(), d_lbw.get(), d_part.get(), d_off.get(), d_scale.get(), N, E, K,
                                 stream());
  const Vec aux2 = d_aux.download();
  CHECK(bits_equal(aux.data(), aux2.data(), sizeof(float) * 2));
}

}  // namespace

GPU_TEST_CASE("cuda router forward: probs, lse, top-k with ties, renorm, LB and z-loss statistics") {
  const RouterCase cases[] = {{300, 8, 2, false},   {300, 8, 2, true},     {1000, 64, 8, false},
                              {1000, 64, 8, true},  {77, 6, 1, false},     {513, 40, 3, true},
                              {129, 200, 4, false}, {2000, 16, 2, false}, {33, 256, 32, true}};
  for (const auto& rc : cases) {
    check_router_forward(rc, /*bf16_logits=*/false, /*in_place=*/false);
    check_router_forward(rc, /*bf16_logits=*/true, /*in_place=*/false);
    check_router_forward(rc, /*bf16_logits=*/false, /*in_place=*/true);
  }
}

GPU_TEST_CASE("cuda router backward: routing weights, LB and z-loss terms, with and without renorm") {
  const RouterCase cases[] = {{300, 8, 2, false}, {300, 8, 2, true}, {1000, 64, 8, true}, {77, 6, 1, false},
                              {129, 200, 4, true}};
  for (const auto& rc : cases) {
    const int64_t N = rc.N, E = rc.E, K = rc.K;
    CAPTURE(N);
    CAPTURE(E);
    CAPTURE(K);
    CAPTURE(rc.renorm);
    const Vec logits = grid_vector(N * E, 1.5f, 0.25f, 8.0f);
    Vec probs(N * E), lse(N), w(N * K);
    IVec idx(N * K);
    spes::cpu::router_forward(probs.data(), lse.data(), idx.data(), w.data(), logits.data(), N, E, K, rc.renorm);
    const Vec dw = spes::test::random_vector(N * K);
    const Vec lb_dprob = spes::test::random_vector(E, 0.1f);
    const float lb_scale = 0.75f, rz_scale = 0.01f;
    Vec lb_scaled(E);
    for (int64_t e = 0; e < E; ++e) lb_scaled[e] = lb_scale * lb_dprob[e];
    Vec ref(N * E);
    spes::cpu::router_backward(ref.data(), dw.data(), probs.data(), lse.data(), idx.data(), w.data(),
                               lb_scaled.data(), rz_scale, N, E, K, rc.renorm);

    Dev<float> d_dw(dw), d_probs(probs), d_lse(lse), d_w(w), d_lb(lb_dprob), d_out(N * E);
    Dev<int32_t> d_idx(idx);
    Dev<bf16> d_out16(N * E);
    spes::cuda::router_backward(d_out.get(), d_dw.get(), d_probs.get(), d_lse.get(), d_idx.get(), d_w.get(),
                                d_lb.get(), lb_scale, rz_scale, N, E, K, rc.renorm, stream());
    spes::cuda::router_backward(d_out16.get(), d_dw.get(), d_probs.get(), d_lse.get(), d_idx.get(), d_w.get(),
                                d_lb.get(), lb_scale, rz_scale, N, E, K, rc.renorm, stream());
    const Vec g = d_out.download(), g16 = to_float(d_out16.download());
    CHECK_REL("router dlogits (fp32)", g.data(), ref.data(), N * E, 1e-5);
    CHECK_REL("router dlogits (bf16)", g16.data(), ref.data(), N * E, 1e-2);

    // No LB term (null lb_dprob).
    spes::cpu::router_backward(ref.data(), dw.data(), probs.data(), lse.data(), idx.data(), w.data(), nullptr,
                               rz_scale, N, E, K, rc.renorm);
    d_out.poison();
    spes::cuda::router_backward(d_out.get(), d_dw.get(), d_probs.get(), d_lse.get(), d_idx.get(), d_w.get(),
                                nullptr, lb_scale, rz_scale, N, E, K, rc.renorm, stream());
    const Vec g2 = d_out.download();
    CHECK_REL("router dlogits (no LB)", g2.data(), ref.data(), N * E, 1e-5);
  }
}

// ---- dispatch / gather / combine ---------------------------------------------------------

GPU_TEST_CASE("cuda moe dispatch: the CPU's stable expert-major permutation, exactly") {
  const std::vector<spes::test::DispatchCase> cases = spes::test::dispatch_cases();
  for (const auto& c : cases) {
    CAPTURE(c.what);
    std::vector<int32_t> allowed = c.allowed;
    if (allowed.empty()) {
      allowed.resize(c.E);
      std::iota(allowed.begin(), allowed.end(), 0);
    }
    const int64_t NK = c.N * c.K;
    const IVec idx = random_topk(c.N, c.K, allowed);
    IVec offsets(c.E + 1), slot_token(NK), token_slot(NK);
    spes::cpu::moe_dispatch_indices(offsets.data(), slot_token.data(), token_slot.data(), idx.data(), c.N, c.E,
                                    c.K);
    Dev<int32_t> d_idx(idx), d_off(c.E + 1), d_st(NK), d_ts(NK),
        d_scratch(spes::cuda::moe_dispatch_scratch_count(c.N, c.E, c.K));
    spes::cuda::moe_dispatch_indices(d_off.get(), d_st.get(), d_ts.get(), d_scratch.get(), d_idx.get(), c.N, c.E,
                                     c.K, stream());
    CHECK_SAME("offsets", d_off.download(), offsets);
    CHECK_SAME("slot_token", d_st.download(), slot_token);
    CHECK_SAME("token_slot", d_ts.download(), token_slot);
  }
}

GPU_TEST_CASE("cuda moe gather/combine: CPU semantics, backward, and the permutation round trip") {
  struct Case {
    int64_t N, E, K, C;
  };
  const Case cases[] = {{500, 8, 2, 64}, {300, 6, 4, 60}, {1000, 64, 8, 256}, {257, 5, 1, 24}};
  for (const auto& c : cases) {
    const int64_t N = c.N, K = c.K, C = c.C, S = N * K;
    CAPTURE(N);
    CAPTURE(K);
    CAPTURE(C);
    std::vector<int32_t> all(c.E);
    std::iota(all.begin(), all.end(), 0);
    const IVec idx = random_topk(N, K, all);
    IVec offsets(c.E + 1), slot_token(S), token_slot(S);
    spes::cpu::moe_dispatch_indices(offsets.data(), slot_token.data(), token_slot.data(), idx.data(), N, c.E, K);
    Dev<int32_t> d_st(slot_token), d_ts(token_slot);

    const Vec x = round_bf16(spes::test::random_vector(N * C));
    const Vec dxe = round_bf16(spes::test::random_vector(S * C));
    const Vec ye = round_bf16(spes::test::random_vector(S * C));
    const Vec dout = round_bf16(spes::test::random_vector(N * C));
    const Vec w = uniform_vector(S, 0.05f, 1.0f);
    Vec xe(S * C), dx(N * C), out(N * C), dye(S * C), dw(S);
    spes::cpu::moe_gather_forward(xe.data(), x.data(), slot_token.data(), S, C);
    spes::cpu::moe_gather_backward(dx.data(), dxe.data(), token_slot.data(), N, K, C);
    spes::cpu::moe_combine_forward(out.data(), ye.data(), w.data(), token_slot.data(), N, K, C);
    spes::cpu::moe_combine_backward(dye.data(), dw.data(), dout.data(), ye.data(), w.data(), token_slot.data(), N,
                                    K, C);

    Dev<bf16> d_x(to_bf16(x)), d_xe(S * C), d_dxe(to_bf16(dxe)), d_dx(N * C), d_ye(to_bf16(ye)), d_out(N * C),
        d_dout(to_bf16(dout)), d_dye(S * C);
    Dev<float> d_w(w), d_dw(S);
    spes::cuda::moe_gather_forward(d_xe.get(), d_x.get(), d_st.get(), S, C, stream());
    spes::cuda::moe_gather_backward(d_dx.get(), d_dxe.get(), d_ts.get(), N, K, C, stream());
    spes::cuda::moe_combine_forward(d_out.get(), d_ye.get(), d_w.get(), d_ts.get(), N, K, C, stream());
    spes::cuda::moe_combine_backward(d_dye.get(), d_dw.get(), d_dout.get(), d_ye.get(), d_w.get(), d_ts.get(), N,
                                     K, C, stream());
    CHECK_SAME("gather forward (a copy: exact)", to_float(d_xe.download()), xe);
    const Vec g_dx = to_float(d_dx.download()), g_out = to_float(d_out.download());
    const Vec g_dye = to_float(d_dye.download()), g_dw = d_dw.download();
    CHECK_REL("gather backward", g_dx.data(), dx.data(), N * C, 1e-2);
    CHECK_REL("combine forward", g_out.data(), out.data(), N * C, 1e-2);
    CHECK_REL("combine backward dye", g_dye.data(), dye.data(), S * C, 1e-2);
    CHECK_REL("combine backward dtopk_w", g_dw.data(), dw.data(), S, 1e-5);

    // Round trip. Gather then gather-backward sums K copies of x: K·x, exact in bf16
    // for K a power of two. Combine of the gathered rows with weights 1/K gives x back.
    if ((K & (K - 1)) == 0) {
      Dev<bf16> d_back(N * C);
      spes::cuda::moe_gather_backward(d_back.get(), d_xe.get(), d_ts.get(), N, K, C, stream());
      Vec kx(N * C);
      for (int64_t i = 0; i < N * C; ++i) kx[i] = float(K) * x[i];
      CHECK_SAME("gather → gather backward = K·x", to_float(d_back.download()), kx);
      Dev<float> d_inv(Vec(S, 1.0f / float(K)));
      d_back.poison();
      spes::cuda::moe_combine_forward(d_back.get(), d_xe.get(), d_inv.get(), d_ts.get(), N, K, C, stream());
      CHECK_SAME("gather → combine(1/K) = x", to_float(d_back.download()), x);
    }
  }
}

// ---- SwiGLU ---------------------------------------------------------------------------------

GPU_TEST_CASE("cuda swiglu: forward and backward vs CPU, interleaved gate|up rows, h recompute") {
  struct Case {
    int64_t rows, H;
    bool interleaved;
  };
  const Case cases[] = {{37, 48, true}, {37, 48, false}, {101, 20, true}, {64, 1024, true}};
  for (const auto& c : cases) {
    const int64_t rows = c.rows, H = c.H, n = rows * H, ld = c.interleaved ? 2 * H : H;
    CAPTURE(rows);
    CAPTURE(H);
    CAPTURE(c.interleaved);
    const Vec gate = round_bf16(spes::test::random_vector(n, 2.0f));
    const Vec up = round_bf16(spes::test::random_vector(n));
    const Vec dh = round_bf16(spes::test::random_vector(n));
    Vec h(n), dgate(n), dup(n);
    spes::cpu::swiglu_forward(h.data(), gate.data(), up.data(), n);
    spes::cpu::swiglu_backward(dgate.data(), dup.data(), dh.data(), gate.data(), up.data(), n);

    // Device layout: [rows, ld] with gate at column 0 and up at column H (interleaved)
    // or two dense buffers.
    auto pack = [&](const Vec& a, const Vec& b) {
      Vec p(rows * 2 * H);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < H; ++j) {
          p[r * 2 * H + j] = a[r * H + j];
          p[r * 2 * H + H + j] = b[r * H + j];
        }
      return p;
    };
    Dev<bf16> d_gu(to_bf16(c.interleaved ? pack(gate, up) : gate)), d_up(to_bf16(up));
    Dev<bf16> d_dgu(c.interleaved ? 2 * n : n), d_dup(n), d_h(n), d_h2(n), d_dh(to_bf16(dh));
    const bf16* g_ptr = d_gu.get();
    const bf16* u_ptr = c.interleaved ? d_gu.get() + H : d_up.get();
    bf16* dg_ptr = d_dgu.get();
    bf16* du_ptr = c.interleaved ? d_dgu.get() + H : d_dup.get();
    spes::cuda::swiglu_forward(d_h.get(), g_ptr, u_ptr, rows, H, ld, stream());
    spes::cuda::swiglu_backward(dg_ptr, du_ptr, d_h2.get(), d_dh.get(), g_ptr, u_ptr, rows, H, ld, stream());
    const Vec g_h = to_float(d_h.download());
    CHECK_REL("swiglu h", g_h.data(), h.data(), n, 1e-2);
    Vec g_dg(n), g_du(n);
    const Vec dgu = to_float(d_dgu.download());
    const Vec dupv = c.interleaved ? Vec() : to_float(d_dup.download());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < H; ++j) {
        g_dg[r * H + j] = dgu[r * ld + j];
        g_du[r * H + j] = c.interleaved ? dgu[r * ld + H + j] : dupv[r * H + j];
      }
    CHECK_REL("swiglu dgate", g_dg.data(), dgate.data(), n, 1e-2);
    CHECK_REL("swiglu dup", g_du.data(), dup.data(), n, 1e-2);
    // The recomputed h is the forward's h, bit for bit (same fp32 expression).
    CHECK_SAME("swiglu backward h recompute", to_float(d_h2.download()), g_h);
    // h_out aliasing dh (how the GPU model calls it).
    d_dgu.poison();
    spes::cuda::swiglu_backward(dg_ptr, du_ptr, d_dh.get(), d_dh.get(), g_ptr, u_ptr, rows, H, ld, stream());
    CHECK_SAME("swiglu in-place h over dh", to_float(d_dh.download()), g_h);
    CHECK_SAME("swiglu in-place dgate|dup unchanged", to_float(d_dgu.download()), dgu);
  }
}

// ---- the MoE layer ------------------------------------------------------------------------------
// Argument checks throw on the host before any CUDA call: no GPU needed (fake device
// addresses, never dereferenced; one bad argument per call). Misaligned bf16 views are
// fine here (element-wise fallback); missing pointers and bad strides are not.
TEST_CASE("cuda swiglu, gather/combine, dispatch: bad arguments throw before any CUDA call") {
  bf16* a = reinterpret_cast<bf16*>(0x10000);
  float* f = reinterpret_cast<float*>(0x20000);
  int32_t* i = reinterpret_cast<int32_t*>(0x30000);
  CHECK_THROWS_ERROR(spes::cuda::swiglu_forward(a, a, a, 4, 64, 32, nullptr), "swiglu_forward: ld_in must be ≥ H");
  CHECK_THROWS_ERROR(spes::cuda::swiglu_forward(a, nullptr, a, 4, 64, 128, nullptr), "gate must not be null");
  CHECK_THROWS_ERROR(spes::cuda::swiglu_backward(a, a, nullptr, a, a, nullptr, 4, 64, 128, nullptr),
                     "swiglu_backward: up must not be null");
  CHECK_THROWS_ERROR(spes::cuda::moe_gather_forward(a, a, nullptr, 8, 64, nullptr), "slot_token must not be null");
  CHECK_THROWS_ERROR(spes::cuda::moe_gather_backward(a, a, i, 8, 0, 64, nullptr), "K must be ≥ 1");
  CHECK_THROWS_ERROR(spes::cuda::moe_combine_forward(a, a, nullptr, i, 8, 2, 64, nullptr), "topk_w must not be null");
  CHECK_THROWS_ERROR(spes::cuda::moe_combine_backward(a, reinterpret_cast<float*>(0x20002), a, a, f, i, 8, 2, 64,
                                                      nullptr),
                     "dtopk_w must be 4-byte aligned");
  CHECK_THROWS_ERROR(spes::cuda::moe_dispatch_indices(i, i, i, nullptr, i, 8, 4, 2, nullptr),
                     "moe_dispatch_indices: scratch must not be null");
}
