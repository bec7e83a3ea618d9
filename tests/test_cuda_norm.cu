// RMSNorm + residual and QK-norm + RoPE vs cpu::rmsnorm_* / cpu::rope_* on the
// same bf16-rounded inputs. Tolerances: bf16 outputs 1e-2; fp32 rstd and dweight
// 1e-5 (same math, only the summation order and rsqrt rounding differ).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"
#include "model/cpu/ops.hpp"
#include "tests/cuda_test.cuh"

using namespace spes::cuda;
using namespace spes::test;

namespace {

constexpr double kTolBf16 = 1e-2;
constexpr double kTolF32 = 1e-5;

std::vector<float> norm_weight(int64_t C) {
  std::vector<float> w = random_vector(C, 0.2f);
  for (auto& x : w) x += 1.0f;
  return rounded_bf16(w);
}

std::vector<float> add(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] + b[i];
  return r;
}

}  // namespace

GPU_TEST_CASE("cuda rmsnorm + residual: forward and backward vs cpu") {
  const float eps = 1e-6f;
  // C covers 1, 2 and 4 vectors per thread and partial warps.
  for (auto [N, C] : {std::tuple<int64_t, int64_t>{37, 64}, {130, 768}, {9, 2048}, {11, 2056}, {5, 4104}, {300, 24}}) {
    CAPTURE(N);
    CAPTURE(C);
    const int64_t NC = N * C;
    const std::vector<float> res = rounded_bf16(random_vector(NC)), branch = rounded_bf16(random_vector(NC));
    const std::vector<float> w = norm_weight(C);
    // The GPU stores the new residual in bf16 and normalises that stored value.
    std::vector<float> x = add(res, branch);
    const std::vector<float> x_exact = x;
    x = rounded_bf16(x);
    std::vector<float> out_ref(NC), rstd_ref(N);
    spes::cpu::rmsnorm_forward(out_ref.data(), rstd_ref.data(), x.data(), w.data(), N, C, eps);

    auto d_res = upload_bf16(res), d_branch = upload_bf16(branch), d_w = upload_bf16(w);
    DevTensor<bf16> d_out(NC), d_xnew(NC);
    DevTensor<float> d_rstd(N);
    d_out.poison();
    d_xnew.poison();
    d_rstd.poison();
    rmsnorm_forward(d_out, d_rstd, d_xnew, d_res, d_branch, d_w, N, C, eps, stream());
    CHECK_REL("fwd new residual", download(d_xnew.get(), NC).data(), x_exact.data(), NC, kTolBf16);
    CHECK_REL("fwd new residual = bf16(res + branch)", download(d_xnew.get(), NC).data(), x.data(), NC, 0.0);
    CHECK_REL("fwd out", download(d_out.get(), NC).data(), out_ref.data(), NC, kTolBf16);
    CHECK_REL("fwd rstd", download(d_rstd.get(), N).data(), rstd_ref.data(), N, kTolF32);

    // in place (res_out aliases res_in), and without a branch (plain norm)
    auto d_inplace = upload_bf16(res);
    d_out.poison();
    rmsnorm_forward(d_out, d_rstd, d_inplace, d_inplace, d_branch, d_w, N, C, eps, stream());
    CHECK_REL("fwd in place residual", download(d_inplace.get(), NC).data(), x.data(), NC, 0.0);
    CHECK_REL("fwd in place out", download(d_out.get(), NC).data(), out_ref.data(), NC, kTolBf16);
    std::vector<float> plain_ref(NC), plain_rstd(N);
    spes::cpu::rmsnorm_forward(plain_ref.data(), plain_rstd.data(), res.data(), w.data(), N, C, eps);
    d_out.poison();
    rmsnorm_forward(d_out, d_rstd, nullptr, d_res, nullptr, d_w, N, C, eps, stream());
    CHECK_REL("fwd no branch out", download(d_out.get(), NC).data(), plain_ref.data(), NC, kTolBf16);
    CHECK_REL("fwd no branch rstd", download(d_rstd.get(), N).data(), plain_rstd.data(), N, kTolF32);

    // backward of the with-branch forward
    rmsnorm_forward(d_out, d_rstd, d_xnew, d_res, d_branch, d_w, N, C, eps, stream());
    const std::vector<float> dout = rounded_bf16(random_vector(NC)), dres = rounded_bf16(random_vector(NC));
    std::vector<float> dx_ref(NC), dw_ref(C, 0.0f);
    spes::cpu::rmsnorm_backward(dx_ref.data(), dw_ref.data(), dout.data(), x.data(), w.data(), rstd_ref.data(), N, C);
    const std::vector<float> dres_ref = add(dres, dx_ref);

    auto d_dout = upload_bf16(dout), d_dres = upload_bf16(dres);
    DevTensor<bf16> d_dres_out(NC);
    DevTensor<float> d_dw(C);
    DevTensor<char> scratch{static_cast<int64_t>(rmsnorm_backward_scratch_bytes(N, C))};
    d_dres_out.poison();
    d_dw.zero();
    rmsnorm_backward(d_dres_out, d_dw, scratch, d_dout, d_dres, d_xnew, d_w, d_rstd, N, C, stream());
    CHECK_REL("bwd dresidual", download(d_dres_out.get(), NC).data(), dres_ref.data(), NC, kTolBf16);
    const std::vector<float> dw1 = download(d_dw.get(), C);
    CHECK_REL("bwd dweight", dw1.data(), dw_ref.data(), C, kTolF32);

    // dweight accumulates (+=) and is deterministic: a second call adds exactly the same values
    rmsnorm_backward(d_dres_out, d_dw, scratch, d_dout, d_dres, d_xnew, d_w, d_rstd, N, C, stream());
    std::vector<float> dw2 = download(d_dw.get(), C), twice(C);
    for (int64_t c = 0; c < C; ++c) twice[c] = dw1[c] + dw1[c];
    CHECK_MESSAGE(bitwise_equal(dw2, twice), "dweight accumulation is not bit-reproducible");

    // in place on the residual gradient; no incoming residual gradient + frozen weight
    auto d_dres_inplace = upload_bf16(dres);
    rmsnorm_backward(d_dres_inplace, nullptr, nullptr, d_dout, d_dres_inplace, d_xnew, d_w, d_rstd, N, C, stream());
    CHECK_REL("bwd in place dresidual", download(d_dres_inplace.get(), NC).data(), dres_ref.data(), NC, kTolBf16);
    d_dres_out.poison();
    rmsnorm_backward(d_dres_out, nullptr, nullptr, d_dout, nullptr, d_xnew, d_w, d_rstd, N, C, stream());
    CHECK_REL("bwd no residual grad", download(d_dres_out.get(), NC).data(), dx_ref.data(), NC, kTolBf16);
  }
}

GPU_TEST_CASE("cuda qk-norm + rope: forward and backward vs cpu rmsnorm then rope") {
  const float eps = 1e-6f;
  // D % 8 != 0 (24: vectors straddle the halves; 6: vectors straddle heads), long T
  // (large angles), OLMoE-like 16×128, and C = 48·128 = 6144, whose two 24 KB smem rows
  // per block once overflowed the 48 KB default limit with the static scratch; the
  // tiny demo's q/k (configs/tiny.toml: 8 × 256 tokens, 4 heads × 32); C = 3072 takes
  // the 2-vectors-per-thread kernels.
  for (auto [B, T, H, D, theta] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t, double>{2, 5, 3, 16, 10000.0}, {2, 33, 12, 64, 10000.0},
        {1, 7, 4, 24, 10000.0}, {3, 4, 4, 6, 10000.0}, {1, 3, 16, 128, 500000.0}, {1, 2049, 2, 16, 10000.0},
        {2, 5, 48, 128, 10000.0}, {8, 256, 4, 32, 10000.0}, {1, 3, 24, 128, 10000.0}}) {
    CAPTURE(B);
    CAPTURE(T);
    CAPTURE(H);
    CAPTURE(D);
    const int64_t N = B * T, C = H * D, NC = N * C;
    const std::vector<float> inp = rounded_bf16(random_vector(NC, 2.0f));
    const std::vector<float> w = norm_weight(C);
    std::vector<float> normed(NC), rstd_ref(N), out_ref(NC);
    spes::cpu::rmsnorm_forward(normed.data(), rstd_ref.data(), inp.data(), w.data(), N, C, eps);
    spes::cpu::rope_forward(out_ref.data(), normed.data(), B, T, H, D, theta);

    // the table: the CPU reference's cos/sin (double, rounded once)
    const int64_t half = D / 2;
    DevTensor<float2> d_table(T * half);
    d_table.poison();
    rope_table_init(d_table, T, D, theta, stream());
    std::vector<float> table_ref(2 * T * half);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < half; ++i) {
        const double a = double(t) * std::pow(theta, -2.0 * double(i) / double(D));
        table_ref[2 * (t * half + i)] = float(std::cos(a));
        table_ref[2 * (t * half + i) + 1] = float(std::sin(a));
      }
    CHECK_REL("rope table", download(reinterpret_cast<const float*>(d_table.get()), 2 * T * half).data(),
              table_ref.data(), 2 * T * half, 1e-7);

    auto d_inp = upload_bf16(inp), d_w = upload_bf16(w);
    DevTensor<bf16> d_out(NC);
    DevTensor<float> d_rstd(N);
    d_out.poison();
    d_rstd.poison();
    qknorm_rope_forward(d_out, d_rstd, d_inp, d_w, d_table, B, T, H, D, eps, stream());
    CHECK_REL("fwd out", download(d_out.get(), NC).data(), out_ref.data(), NC, kTolBf16);
    CHECK_REL("fwd rstd", download(d_rstd.get(), N).data(), rstd_ref.data(), N, kTolF32);

    const std::vector<float> dout = rounded_bf16(random_vector(NC));
    std::vector<float> dnormed(NC), dinp_ref(NC), dw_ref(C, 0.0f);
    spes::cpu::rope_backward(dnormed.data(), dout.data(), B, T, H, D, theta);
    spes::cpu::rmsnorm_backward(dinp_ref.data(), dw_ref.data(), dnormed.data(), inp.data(), w.data(), rstd_ref.data(),
                                N, C);
    auto d_dout = upload_bf16(dout);
    DevTensor<bf16> d_dinp(NC);
    DevTensor<float> d_dw(C);
    DevTensor<char> scratch{static_cast<int64_t>(qknorm_rope_backward_scratch_bytes(B, T, H, D))};
    d_dinp.poison();
    d_dw.zero();
    qknorm_rope_backward(d_dinp, d_dw, scratch, d_dout, d_inp, d_w, d_rstd, d_table, B, T, H, D, stream());
    CHECK_REL("bwd dinp", download(d_dinp.get(), NC).data(), dinp_ref.data(), NC, kTolBf16);
    CHECK_REL("bwd dweight", download(d_dw.get(), C).data(), dw_ref.data(), C, kTolF32);

    d_dinp.poison();
    qknorm_rope_backward(d_dinp, nullptr, nullptr, d_dout, d_inp, d_w, d_rstd, d_table, B, T, H, D, stream());
    CHECK_REL("bwd dinp, frozen weight", download(d_dinp.get(), NC).data(), dinp_ref.data(), NC, kTolBf16);

    // D % 16 == 0 with a 16-byte aligned table takes the float4 rotation
    // (rotate8_paired); the same table one float2 further on (8-byte aligned only)
    // takes the scalar rotate8. Same products in the same order: bitwise equal.
    if (D % 16 == 0) {
      DevTensor<float2> shifted(T * half + 1);
      rope_table_init(shifted.get() + 1, T, D, theta, stream());
      DevTensor<bf16> out2(NC), dinp2(NC);
      DevTensor<float> rstd2(N), dw2(C);
      out2.poison();
      qknorm_rope_forward(out2, rstd2, d_inp, d_w, shifted.get() + 1, B, T, H, D, eps, stream());
      CHECK_MESSAGE(bitwise_equal(download(out2.get(), NC), download(d_out.get(), NC)),
                    "forward: float4 and scalar rotations differ");
      dinp2.poison();
      dw2.zero();
      qknorm_rope_backward(dinp2, dw2, scratch, d_dout, d_inp, d_w, d_rstd, shifted.get() + 1, B, T, H, D, stream());
      CHECK_MESSAGE(bitwise_equal(download(dinp2.get(), NC), download(d_dinp.get(), NC)),
                    "backward dinp: float4 and scalar rotations differ");
      CHECK_MESSAGE(bitwise_equal(download(dw2.get(), C), download(d_dw.get(), C)),
                    "backward dweight: float4 and scalar rotations differ");
    }
  }
}

// The dweight partial count G (blocks resident at once, capped by the row groups) is
// asked of the device once per (device, kernel, block shape, smem) and then cached
// (norm_common.cuh): a *_scratch_bytes answer never changes between calls, stops
// growing once one wave of blocks covers the GPU, and the launch writes exactly that
// many partial rows — a poisoned guard right after the scratch stays untouched.
GPU_TEST_CASE("cuda norm backwards: scratch size = the launch's partial rows, stable and capped") {
  const int64_t huge = int64_t(1) << 26;  // rows: far more row groups than resident blocks
  for (int64_t C : {int64_t(64), int64_t(768), int64_t(4104)}) {
    CAPTURE(C);
    CHECK(rmsnorm_backward_scratch_bytes(1, C) == size_t(C) * sizeof(float));  // one row: one block
    const size_t cap = rmsnorm_backward_scratch_bytes(huge, C);
    CHECK(cap > size_t(C) * sizeof(float));
    CHECK(cap % (size_t(C) * sizeof(float)) == 0);
    for (int i = 0; i < 3; ++i) CHECK(rmsnorm_backward_scratch_bytes(huge, C) == cap);
    CHECK(rmsnorm_backward_scratch_bytes(2 * huge, C) == cap);
  }
  for (int64_t D : {int64_t(32), int64_t(128)}) {
    CAPTURE(D);
    const int64_t H = 8, C = H * D;
    CHECK(qknorm_rope_backward_scratch_bytes(1, 1, H, D) == size_t(C) * sizeof(float));
    const size_t cap = qknorm_rope_backward_scratch_bytes(huge / 1024, 1024, H, D);
    CHECK(cap > size_t(C) * sizeof(float));
    for (int i = 0; i < 3; ++i) CHECK(qknorm_rope_backward_scratch_bytes(huge / 1024, 1024, H, D) == cap);
    CHECK(qknorm_rope_backward_scratch_bytes(2 * huge / 1024, 1024, H, D) == cap);
  }

  // Enough rows that G is the resident count, not the row-group count. Inputs are
  // zeros (finite): only the scratch footprint is under test here.
  const int64_t B = 16, T = 1024, N = B * T, H = 12, D = 64, C = H * D, kGuard = 1024;
  DevTensor<bf16> zeros(N * C), dx(N * C), w(C);
  DevTensor<float> rstd(N), dw(C);
  zeros.zero();
  w.zero();
  rstd.zero();
  dw.zero();
  DevTensor<float2> table(T * (D / 2));
  rope_table_init(table, T, D, 10000.0, stream());
  auto guard_untouched = [&](const DevTensor<float>& scratch, int64_t used_floats) {
    const std::vector<float> tail = copy_to_host(scratch.get() + used_floats, kGuard);
    uint32_t all = 0xFFFFFFFFu;
    for (float x : tail) {
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      all &= bits;
    }
    return all == 0xFFFFFFFFu;
  };
  {
    const int64_t used = int64_t(rmsnorm_backward_scratch_bytes(N, C) / sizeof(float));
    DevTensor<float> scratch(used + kGuard);
    scratch.poison();
    rmsnorm_backward(dx, dw, scratch, zeros, nullptr, zeros, w, rstd, N, C, stream());
    CHECK_MESSAGE(guard_untouched(scratch, used), "rmsnorm_backward wrote past rmsnorm_backward_scratch_bytes");
  }
  {
    const int64_t used = int64_t(qknorm_rope_backward_scratch_bytes(B, T, H, D) / sizeof(float));
    DevTensor<float> scratch(used + kGuard);
    scratch.poison();
    qknorm_rope_backward(dx, dw, scratch, zeros, zeros, w, rstd, table, B, T, H, D, stream());
    CHECK_MESSAGE(guard_untouched(scratch, used),
                  "qknorm_rope_backward wrote past qknorm_rope_backward_scratch_bytes");
  }
}

// Argument checks throw on the host before any CUDA call: no GPU needed (fake device
// addresses, never dereferenced; one bad argument per call). See test_cuda_attention.cu.
TEST_CASE("cuda rmsnorm, qk-norm + rope: bad shapes and pointers throw before any CUDA call") {
  bf16* a = reinterpret_cast<bf16*>(0x10000);
  bf16* m = reinterpret_cast<bf16*>(0x10008);  // 8-byte aligned: not enough for 16-byte vectors
  float* f = reinterpret_cast<float*>(0x20000);
  const float2* tab = reinterpret_cast<const float2*>(0x40000);
  void* sc = reinterpret_cast<void*>(0x30000);
  CHECK_THROWS_ERROR(rmsnorm_forward(a, f, a, a, a, a, 4, 100, 1e-6f, nullptr), "positive multiple of 8");
  CHECK_THROWS_ERROR(rmsnorm_forward(a, f, a, a, a, m, 4, 64, 1e-6f, nullptr),
                     "rmsnorm_forward: weight must be 16-byte aligned");
  CHECK_THROWS_ERROR(rmsnorm_forward(a, f, m, a, a, a, 4, 64, 1e-6f, nullptr), "res_out must be 16-byte aligned");
  CHECK_THROWS_ERROR(rmsnorm_forward(a, nullptr, a, a, a, a, 4, 64, 1e-6f, nullptr), "rstd must not be null");
  CHECK_THROWS_ERROR(rmsnorm_backward(a, f, sc, m, a, a, a, f, 4, 64, nullptr),
                     "rmsnorm_backward: dout must be 16-byte aligned");
  CHECK_THROWS_ERROR(rmsnorm_backward(a, f, reinterpret_cast<void*>(0x30004), a, a, a, a, f, 4, 64, nullptr),
                     "scratch must be 16-byte aligned");
  CHECK_THROWS_ERROR(rmsnorm_backward(a, f, nullptr, a, a, a, a, f, 4, 64, nullptr), "dweight needs scratch");
  CHECK_THROWS_ERROR(qknorm_rope_forward(a, f, m, a, tab, 1, 4, 2, 64, 1e-6f, nullptr),
                     "qknorm_rope_forward: inp must be 16-byte aligned");
  CHECK_THROWS_ERROR(qknorm_rope_forward(a, f, a, a, nullptr, 1, 4, 2, 64, 1e-6f, nullptr), "table");
  CHECK_THROWS_ERROR(qknorm_rope_forward(a, f, a, a, tab, 1, 4, 2, 63, 1e-6f, nullptr), "even head dim");
  CHECK_THROWS_ERROR(qknorm_rope_backward(m, f, sc, a, a, a, f, tab, 1, 4, 2, 64, nullptr),
                     "qknorm_rope_backward: dinp must be 16-byte aligned");
  // A buffer read through a __restrict__ pointer must not overlap one the kernel
  // writes (4 rows of 64 or 128 values: 512 or 1024 bytes; b, c far from a).
  bf16* b = reinterpret_cast<bf16*>(0x50000);
  const bf16* c = reinterpret_cast<const bf16*>(0x60000);
  CHECK_THROWS_ERROR(rmsnorm_forward(a, f, b, b, a + 64, c, 4, 64, 1e-6f, nullptr), "branch must not overlap out");
  CHECK_THROWS_ERROR(rmsnorm_forward(a, f, b, b, b + 248, c, 4, 64, 1e-6f, nullptr),
                     "branch must not overlap res_out");
  CHECK_THROWS_ERROR(rmsnorm_backward(a, f, sc, a + 8, a, b, c, f, 4, 64, nullptr), "dout must not overlap dres_out");
  CHECK_THROWS_ERROR(rmsnorm_backward(a, f, sc, b, a, a, c, f, 4, 64, nullptr), "x must not overlap dres_out");
  CHECK_THROWS_ERROR(qknorm_rope_backward(a, f, sc, a, b, c, f, tab, 1, 4, 2, 64, nullptr),
                     "dout must not overlap dinp");
  CHECK_THROWS_ERROR(qknorm_rope_backward(a, f, sc, b, a + 504, c, f, tab, 1, 4, 2, 64, nullptr),
                     "inp must not overlap dinp");
}
