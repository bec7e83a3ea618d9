// RMSNorm + residual (pre-norm, and OLMo-2's post-norm) and QK-norm + RoPE (over the
// whole projection, and Qwen3's per head) (cuda/rmsnorm.cu, cuda/rope.cu,
// cuda/norm_common.{cuh,cu}) vs cpu::rmsnorm_* / cpu::rope_* on the same bf16 values.
// Tolerances: bf16 outputs 1e-2 relative (bf16 storage alone costs ~2e-3); fp32 rstd
// and dweight 1e-5 (same math; the summation order and the rsqrt rounding differ);
// the rope table 1e-7 (double, rounded once, both sides). Measured on the emulator:
// bf16 ≤ 2.2e-3, fp32 ≤ 2.0e-6, the table 0 (printed: ErrorReport). Exact: the new
// residual is bf16(res + branch), post-norm's residual gradient bf16(dres + dbranch);
// an in-place call gives the bits of the out-of-place one; dweight accumulates, each
// call adding the same bits; the float4 and scalar rotations agree. Every output and the scratch start as NaN; every launcher runs
// under every schedule (for_each_schedule) and must write the same bits.
//
// Inputs are seeded (kSeed) per shape: a test that runs on every commit must not flake.
//
// Mutations of the kernels it fails on (applied by hand, not kept):
//   row_sum: the first __syncthreads removed: wrong values; the trailing one removed:
//     bits differ by warp schedule (C = 8192, the backward's stride loop)
//   rmsnorm backward: inactive rows `return` instead of `continue`: EMU "deadlock"
//   rmsnorm forward: x not rounded to bf16 before the norm: rstd, dweight off (1e-5)
//   rmsnorm backward: the mean_dot term dropped; forward: vectors k > 0 skipped
//   store_block_partial: either barrier removed, or row slice 1 skipped: wrong dweight
//   dweight_reduce: the 4-wide loop bound one group off (G ≥ 128), the grid C/32
//     (EMU "grid (0,1,1)" at C = 24, wrong dweight at C = 2056), the barrier removed
//   rope: either barrier on the smem row removed: NaN (dynamic smem is poisoned);
//     the head wrap `d == D` removed (D = 6); the backward rotating by +angle; the
//     position `row % T` changed
// Survives: rope_layout's smem budget raised to 64 KB (two 24 KB rows + the static
// scratch over 48 KB at C = 6144): the emulator does not know static smem sizes.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"
#include "model/cpu/ops.hpp"
#include "tests/cuda_test.cuh"

using namespace spes::cuda;
using namespace spes::test;

namespace {

constexpr uint64_t kSeed = 20240612;
constexpr float kEps = 1e-6f;
constexpr double kTolBf16 = 1e-2;
constexpr double kTolF32 = 1e-5;

std::vector<float> norm_weight(int64_t C) {
  std::vector<float> w = random_vector(C, 0.2f);
  for (float& x : w) x = bf16_round(x + 1.0f);
  return w;
}

std::vector<float> twice(const std::vector<float>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = v[i] + v[i];
  return r;
}

// ---- RMSNorm + residual -------------------------------------------------------------

void check_rmsnorm(int64_t N, int64_t C, ErrorReport& report) {
  const std::string shape = "N=" + std::to_string(N) + " C=" + std::to_string(C);
  INFO(shape);
  rng().seed(kSeed);
  const int64_t NC = N * C;
  const std::vector<float> res = random_bf16_values(NC), branch = random_bf16_values(NC), w = norm_weight(C);
  const std::vector<float> dout = random_bf16_values(NC), dres = random_bf16_values(NC);

  // The kernel stores the new residual in bf16 and normalises that stored value.
  std::vector<float> x(NC), out_ref(NC), rstd_ref(N), plain_ref(NC), plain_rstd(N), dx_ref(NC), dw_ref(C, 0.0f);
  for (int64_t i = 0; i < NC; ++i) x[i] = bf16_round(res[i] + branch[i]);
  spes::cpu::rmsnorm_forward(out_ref.data(), rstd_ref.data(), x.data(), w.data(), N, C, kEps);
  spes::cpu::rmsnorm_forward(plain_ref.data(), plain_rstd.data(), res.data(), w.data(), N, C, kEps);
  spes::cpu::rmsnorm_backward(dx_ref.data(), dw_ref.data(), dout.data(), x.data(), w.data(), rstd_ref.data(), N, C);
  std::vector<float> dres_ref(NC);
  for (int64_t i = 0; i < NC; ++i) dres_ref[i] = dres[i] + dx_ref[i];

  const DevTensor<bf16> d_res = upload_bf16(res), d_branch = upload_bf16(branch), d_w = upload_bf16(w),
                        d_out(NC), d_xnew(NC), d_inplace(NC);
  const DevTensor<float> d_rstd(N);
  auto forward = [&] { rmsnorm_forward(d_out, d_rstd, d_xnew, d_res, d_branch, d_w, N, C, kEps, stream()); };
  std::vector<float> out;
  for_each_schedule("rmsnorm fwd " + shape, {d_out, d_xnew, d_rstd}, [&] {
    forward();
    out = download(d_out.get(), NC);
    CHECK_MESSAGE(bitwise_equal(download(d_xnew.get(), NC), x), shape << ": the new residual is not bf16(res + branch)");
    report.check("rmsnorm fwd out", shape, out, out_ref, kTolBf16);
    report.check("rmsnorm fwd rstd", shape, download(d_rstd.get(), N), rstd_ref, kTolF32);
  });

  // In place (res_out aliases res_in): the same bits; without a branch: a plain norm.
  d_inplace.upload(to_bf16(res));
  d_out.poison();
  rmsnorm_forward(d_out, d_rstd, d_inplace, d_inplace, d_branch, d_w, N, C, kEps, stream());
  CHECK_MESSAGE(bitwise_equal(download(d_inplace.get(), NC), x), shape << ": in place, the new residual differs");
  CHECK_MESSAGE(bitwise_equal(download(d_out.get(), NC), out), shape << ": in place, out differs");
  d_out.poison();
  d_rstd.poison();
  rmsnorm_forward(d_out, d_rstd, nullptr, d_res, nullptr, d_w, N, C, kEps, stream());
  report.check("rmsnorm fwd out, no branch", shape, download(d_out.get(), NC), plain_ref, kTolBf16);
  report.check("rmsnorm fwd rstd, no branch", shape, download(d_rstd.get(), N), plain_rstd, kTolF32);

  // Backward of the with-branch forward (d_xnew, and rstd restored).
  forward();
  const DevTensor<bf16> d_dout = upload_bf16(dout), d_dres = upload_bf16(dres), d_dres_out(NC);
  const DevTensor<float> d_dw(C);
  const DevTensor<char> scratch(int64_t(rmsnorm_backward_scratch_bytes(N, C)));
  auto backward = [&] {
    rmsnorm_backward(d_dres_out, d_dw, scratch, d_dout, d_dres, d_xnew, d_w, d_rstd, N, C, stream());
  };
  std::vector<float> dres_out, dw;
  for_each_schedule("rmsnorm bwd " + shape, {d_dres_out, d_dw, scratch}, [&] {
    d_dw.zero();
    backward();
    dres_out = download(d_dres_out.get(), NC);
    dw = download(d_dw.get(), C);
    report.check("rmsnorm bwd dresidual", shape, dres_out, dres_ref, kTolBf16);
    report.check("rmsnorm bwd dweight", shape, dw, dw_ref, kTolF32);
  });
  backward();  // dweight accumulates: the second call adds the same bits
  CHECK_MESSAGE(bitwise_equal(download(d_dw.get(), C), twice(dw)), shape << ": a second call added other dweight bits");

  // In place on the residual gradient with a frozen weight: the same bits; without an
  // incoming residual gradient: dx alone.
  d_inplace.upload(to_bf16(dres));
  rmsnorm_backward(d_inplace, nullptr, nullptr, d_dout, d_inplace, d_xnew, d_w, d_rstd, N, C, stream());
  CHECK_MESSAGE(bitwise_equal(download(d_inplace.get(), NC), dres_out), shape << ": in place, dresidual differs");
  d_dres_out.poison();
  rmsnorm_backward(d_dres_out, nullptr, nullptr, d_dout, nullptr, d_xnew, d_w, d_rstd, N, C, stream());
  report.check("rmsnorm bwd dx, no residual grad", shape, download(d_dres_out.get(), NC), dx_ref, kTolBf16);
}

// ---- Post-norm (OLMo-2): the norm on the branch, added to the residual ----------------

// Forward: res_out = bf16(res + rmsnorm(x)·w) against the CPU's fp32 norm then add.
// Backward: dres += dbranch in bf16 (exact: bf16(dres + dbranch)), then dx of the norm
// for that sum, against cpu::rmsnorm_backward; without dbranch, dres untouched.
void check_rmsnorm_post(int64_t N, int64_t C, ErrorReport& report) {
  const std::string shape = "N=" + std::to_string(N) + " C=" + std::to_string(C);
  INFO(shape);
  rng().seed(kSeed + 1);
  const int64_t NC = N * C;
  const std::vector<float> res = random_bf16_values(NC), x = random_bf16_values(NC, 3.0f), w = norm_weight(C);
  const std::vector<float> dres = random_bf16_values(NC), dbranch = random_bf16_values(NC);

  std::vector<float> normed(NC), rstd_ref(N), out_ref(NC), g(NC), dx_ref(NC), dw_ref(C, 0.0f), dx_plain(NC),
      dw_plain(C, 0.0f);
  spes::cpu::rmsnorm_forward(normed.data(), rstd_ref.data(), x.data(), w.data(), N, C, kEps);
  for (int64_t i = 0; i < NC; ++i) out_ref[i] = res[i] + normed[i];
  for (int64_t i = 0; i < NC; ++i) g[i] = bf16_round(dres[i] + dbranch[i]);
  spes::cpu::rmsnorm_backward(dx_ref.data(), dw_ref.data(), g.data(), x.data(), w.data(), rstd_ref.data(), N, C);
  spes::cpu::rmsnorm_backward(dx_plain.data(), dw_plain.data(), dres.data(), x.data(), w.data(), rstd_ref.data(), N,
                              C);

  const DevTensor<bf16> d_res = upload_bf16(res), d_x = upload_bf16(x), d_w = upload_bf16(w), d_out(NC),
                        d_dbranch = upload_bf16(dbranch), d_dres(NC), d_dx(NC);
  const DevTensor<float> d_rstd(N), d_dw(C);
  for_each_schedule("rmsnorm_post fwd " + shape, {d_out, d_rstd}, [&] {
    rmsnorm_post_forward(d_out, d_rstd, d_res, d_x, d_w, N, C, kEps, stream());
    report.check("rmsnorm_post fwd res_out", shape, download(d_out.get(), NC), out_ref, kTolBf16);
    report.check("rmsnorm_post fwd rstd", shape, download(d_rstd.get(), N), rstd_ref, kTolF32);
  });

  const DevTensor<char> scratch(int64_t(rmsnorm_backward_scratch_bytes(N, C)));
  std::vector<float> dx, dw;
  for_each_schedule("rmsnorm_post bwd " + shape, {d_dres, d_dx, d_dw, scratch}, [&] {
    d_dres.upload(to_bf16(dres));  // in place: every run starts from the same dres
    d_dw.zero();
    rmsnorm_post_backward(d_dx, d_dw, scratch, d_dres, d_dbranch, d_x, d_w, d_rstd, N, C, stream());
    CHECK_MESSAGE(bitwise_equal(download(d_dres.get(), NC), g), shape << ": dres is not bf16(dres + dbranch)");
    dx = download(d_dx.get(), NC);
    dw = download(d_dw.get(), C);
    report.check("rmsnorm_post bwd dx", shape, dx, dx_ref, kTolBf16);
    report.check("rmsnorm_post bwd dweight", shape, dw, dw_ref, kTolF32);
  });
  // No branch gradient: dres stays as it is, dx is the norm's backward of dres alone.
  d_dres.upload(to_bf16(dres));
  d_dx.poison();
  d_dw.zero();
  rmsnorm_post_backward(d_dx, d_dw, scratch, d_dres, nullptr, d_x, d_w, d_rstd, N, C, stream());
  CHECK_MESSAGE(bitwise_equal(download(d_dres.get(), NC), dres), shape << ": without dbranch, dres changed");
  report.check("rmsnorm_post bwd dx, no dbranch", shape, download(d_dx.get(), NC), dx_plain, kTolBf16);
  report.check("rmsnorm_post bwd dweight, no dbranch", shape, download(d_dw.get(), C), dw_plain, kTolF32);
}

// ---- QK-norm + RoPE -------------------------------------------------------------------

// The table as the CPU reference computes its angles: double, rounded once.
std::vector<float> rope_table_reference(int64_t T, int64_t D, double theta) {
  const int64_t half = D / 2;
  std::vector<float> table(2 * T * half);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double a = double(t) * std::pow(theta, -2.0 * double(i) / double(D));
      table[2 * (t * half + i)] = float(std::cos(a));
      table[2 * (t * half + i) + 1] = float(std::sin(a));
    }
  return table;
}

struct RopeShape {
  int64_t B, T, H, D;
  double theta;
  std::string tag() const {
    return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " H=" + std::to_string(H) + " D=" + std::to_string(D);
  }
};

// per_head: the norm over each head's D channels (qknorm_head_rope_*, Qwen3; the
// CPU's rmsnorm over B·T·H rows of D, a weight of D), else over the whole projection
// (qknorm_rope_*: B·T rows of H·D, a weight of H·D).
void check_qknorm_rope(const RopeShape& s, bool per_head, ErrorReport& report) {
  const auto [B, T, H, D, theta] = s;
  const std::string op = per_head ? "qknorm_head_rope" : "qknorm_rope";
  const std::string shape = s.tag();
  INFO(op << " " << shape);
  rng().seed(kSeed);
  const int64_t N = B * T, C = H * D, NC = N * C;
  const int64_t rows = per_head ? N * H : N, W = per_head ? D : C;  // norm rows, weight entries
  const std::vector<float> inp = random_bf16_values(NC, 2.0f), w = norm_weight(W), dout = random_bf16_values(NC);

  std::vector<float> normed(NC), rstd_ref(rows), out_ref(NC), dnormed(NC), dinp_ref(NC), dw_ref(W, 0.0f);
  spes::cpu::rmsnorm_forward(normed.data(), rstd_ref.data(), inp.data(), w.data(), rows, W, kEps);
  spes::cpu::rope_forward(out_ref.data(), normed.data(), B, T, H, D, theta);
  spes::cpu::rope_backward(dnormed.data(), dout.data(), B, T, H, D, theta);
  spes::cpu::rmsnorm_backward(dinp_ref.data(), dw_ref.data(), dnormed.data(), inp.data(), w.data(), rstd_ref.data(),
                              rows, W);

  // The table, 16-byte aligned (D % 16 == 0 takes the float4 rotation,
  // rotate8_paired), and the same table one float2 further on (8-byte aligned only:
  // the scalar rotate8).
  const int64_t half = D / 2;
  const DevTensor<float2> d_table(T * half + 1);
  for_each_schedule("rope table " + shape, {d_table}, [&] {
    rope_table_init(d_table, T, D, theta, stream());
    report.check("rope table", shape, download(reinterpret_cast<const float*>(d_table.get()), T * D),
                 rope_table_reference(T, D, theta), 1e-7);
  });
  const DevTensor<float2> shifted(T * half + 1);
  rope_table_init(shifted.get() + 1, T, D, theta, stream());

  const DevTensor<bf16> d_inp = upload_bf16(inp), d_w = upload_bf16(w), d_out(NC), d_dout = upload_bf16(dout),
                        d_dinp(NC);
  const DevTensor<float> d_rstd(rows), d_dw(W);
  const size_t scratch_bytes = per_head ? qknorm_head_rope_backward_scratch_bytes(B, T, H, D)
                                        : qknorm_rope_backward_scratch_bytes(B, T, H, D);
  const DevTensor<char> scratch{int64_t(scratch_bytes)};
  auto forward = [&](const float2* table) {
    (per_head ? qknorm_head_rope_forward : qknorm_rope_forward)(d_out, d_rstd, d_inp, d_w, table, B, T, H, D, kEps,
                                                                 stream());
  };
  auto backward = [&](const float2* table, float* dweight, void* partials) {
    (per_head ? qknorm_head_rope_backward : qknorm_rope_backward)(d_dinp, dweight, partials, d_dout, d_inp, d_w,
                                                                   d_rstd, table, B, T, H, D, stream());
  };
  std::vector<float> out;
  for_each_schedule(op + " fwd " + shape, {d_out, d_rstd}, [&] {
    forward(d_table);
    out = download(d_out.get(), NC);
    report.check(op + " fwd out", shape, out, out_ref, kTolBf16);
    report.check(op + " fwd rstd", shape, download(d_rstd.get(), rows), rstd_ref, kTolF32);
  });
  std::vector<float> dinp, dw;
  for_each_schedule(op + " bwd " + shape, {d_dinp, d_dw, scratch}, [&] {
    d_dw.zero();
    backward(d_table, d_dw, scratch);
    dinp = download(d_dinp.get(), NC);
    dw = download(d_dw.get(), W);
    report.check(op + " bwd dinp", shape, dinp, dinp_ref, kTolBf16);
    report.check(op + " bwd dweight", shape, dw, dw_ref, kTolF32);
  });
  backward(d_table, d_dw, scratch);  // dweight accumulates: the second call adds the same bits
  CHECK_MESSAGE(bitwise_equal(download(d_dw.get(), W), twice(dw)), shape << ": a second call added other dweight bits");

  d_dinp.poison();
  backward(d_table, nullptr, nullptr);  // frozen weight: the same input gradient
  CHECK_MESSAGE(bitwise_equal(download(d_dinp.get(), NC), dinp), shape << ": with a frozen weight, dinp differs");

  if (D % 16 == 0) {  // the scalar rotation: same products in the same order, the same bits
    d_out.poison();
    forward(shifted.get() + 1);
    CHECK_MESSAGE(bitwise_equal(download(d_out.get(), NC), out), shape << ": forward: float4 and scalar rotations differ");
    d_dinp.poison();
    d_dw.zero();
    backward(shifted.get() + 1, d_dw, scratch);
    CHECK_MESSAGE(bitwise_equal(download(d_dinp.get(), NC), dinp),
                  shape << ": backward dinp: float4 and scalar rotations differ");
    CHECK_MESSAGE(bitwise_equal(download(d_dw.get(), W), dw),
                  shape << ": backward dweight: float4 and scalar rotations differ");
  }
}

}  // namespace

// Row layouts (norm_common.cuh: 8 channels a vector, tx threads a row, ty rows a
// block): vpt = 1 up to C = 2048, 2 up to 4096, 4 up to 8192; c8 = C/8 off the warp
// grid (24: 3 vectors in a 32-lane row; 2056 and 4104: 129 vectors per thread slot,
// 160 threads, 31 idle); N not a multiple of ty; and N beyond one wave of backward
// blocks, so that each block strides over several row groups (on an H100: C = 64 →
// G = 132·16 blocks × 4 rows = 8448 rows a wave; C = 8192 → 528 × 2 = 1056).
GPU_TEST_CASE("cuda rmsnorm + residual: forward and backward vs cpu") {
  const std::pair<int64_t, int64_t> shapes[] = {{37, 64},  {130, 768}, {9, 2048}, {11, 2056}, {5, 4104},   {300, 24},
                                                {7, 8192}, {3, 4096},  {1, 8},    {8451, 64}, {1059, 8192}};
  ErrorReport report;
  for (const auto& [N, C] : shapes) check_rmsnorm(N, C, report);
}

// Post-norm (OLMo-2): one vector per thread, 2 and 4 (the backward stride loop is
// the kernel rmsnorm_backward runs, checked above).
GPU_TEST_CASE("cuda post-norm rmsnorm: the normalised branch added to the residual, forward and backward vs cpu") {
  const std::pair<int64_t, int64_t> shapes[] = {{37, 64}, {130, 768}, {5, 4104}, {3, 8192}};
  ErrorReport report;
  for (const auto& [N, C] : shapes) check_rmsnorm_post(N, C, report);
}

// Head dims with D % 8 != 0 (24: vectors straddle the halves; 6: vectors straddle
// heads), long T (large angles), OLMoE-like 16 × 128, C = 6144 (two 24 KB rows once
// overflowed 48 KB with the static scratch; now one row a block), the tiny demo's q/k
// (configs/tiny.toml: 8 × 256 tokens, 4 heads × 32), C = 3072 (the 2-vectors-per-thread
// kernels), C = 8192 (vpt 4, one row a block), and rows beyond one wave of backward
// blocks (C = 64: 2112 blocks × 4 rows).
GPU_TEST_CASE("cuda qk-norm + rope: forward and backward vs cpu rmsnorm then rope") {
  const RopeShape shapes[] = {{2, 5, 3, 16, 1e4},   {2, 33, 12, 64, 1e4},  {1, 7, 4, 24, 1e4},   {3, 4, 4, 6, 1e4},
                              {1, 3, 16, 128, 5e5}, {1, 2049, 2, 16, 1e4}, {2, 5, 48, 128, 1e4}, {8, 256, 4, 32, 1e4},
                              {1, 3, 24, 128, 1e4}, {1, 3, 64, 128, 1e4},  {3, 2900, 2, 32, 1e4}};
  ErrorReport report;
  for (const RopeShape& s : shapes) check_qknorm_rope(s, false, report);
}

// The per-head norm (Qwen3: one RMSNorm per head over D, a weight of D): Qwen3-0.6B's
// q and k heads (16 and 8 of 128, q wider than d_model = 1024), head dims 32 and 64,
// D % 16 != 0 (24: the scalar rotation), T not a multiple of anything, and rows
// (B·T·H) beyond one wave of backward blocks (D = 32: 4 rows a block).
GPU_TEST_CASE("cuda per-head qk-norm + rope: forward and backward vs cpu rmsnorm per head then rope") {
  const RopeShape shapes[] = {{1, 9, 16, 128, 1e6}, {1, 9, 8, 128, 1e6}, {2, 5, 3, 64, 1e4},
                              {1, 7, 4, 24, 1e4},   {2, 33, 12, 32, 1e4}, {4, 300, 8, 32, 1e6}};
  ErrorReport report;
  for (const RopeShape& s : shapes) check_qknorm_rope(s, true, report);
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
