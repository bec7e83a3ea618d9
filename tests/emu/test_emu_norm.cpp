// The real cuda/rmsnorm.cu, cuda/rope.cu and cuda/norm_common.{cuh,cu}, compiled
// unchanged as C++ (CMakeLists.txt) and run on the host emulator (emu.hpp) through
// their launchers, against the CPU model (cpu::rmsnorm_*, cpu::rope_*) on the same
// bf16 values, as test_cuda_norm.cu does on a GPU.
//
// Tolerances are test_cuda_norm.cu's: bf16 outputs 1e-2 relative (bf16 storage alone
// costs ~2e-3), fp32 rstd and dweight 1e-5 (same math; the summation order and the
// rsqrt rounding differ), the rope table 1e-7 (double, rounded once, both sides).
// Measured: bf16 ≤ 2.2e-3, fp32 ≤ 1.5e-6, the table 0 (printed: ErrorReport).
// Exact: the new residual is bf16(res + branch); an in-place call gives the bits of
// the out-of-place one; dweight accumulates, each call adding the same bits.
// Every output and the scratch start as NaN. Every launcher runs twice more on the
// same inputs with other warp schedules and must write the same bits
// (check_rerun_identical).
//
// Inputs are seeded (kSeed) per shape, as in test_emu_attention.cpp: a test that runs
// on every commit must not flake.
//
// Mutations of the kernels it fails on (applied by hand to this version, not kept):
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

// First: the kernels' headers include cuda/common.cuh, whose device functions call
// CUDA built-ins.
#include "tests/emu/builtins.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"
#include "model/cpu/ops.hpp"
#include "tests/emu/emu.hpp"
#include "tests/emu/emu_test.hpp"

namespace {

using namespace spes::test;
using emu::GlobalBuffer;

constexpr uint64_t kSeed = 20240612;
constexpr float kEps = 1e-6f;
constexpr double kTolBf16 = 1e-2;
constexpr double kTolF32 = 1e-5;

std::vector<float> norm_weight(int64_t C) {
  std::vector<float> w = random_vector(C, 0.2f);
  for (float& x : w) x = bf16_round(x + 1.0f);
  return w;
}

// dweight after three backward calls (check_rerun_identical reruns twice), each
// adding the same bits: ((dw + dw) + dw) in fp32.
std::vector<float> added_thrice(const std::vector<float>& dw) {
  std::vector<float> sum = dw;
  for (int rerun = 0; rerun < 2; ++rerun)
    for (size_t c = 0; c < dw.size(); ++c) sum[c] += dw[c];
  return sum;
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

  GlobalBuffer d_res = device_buffer<bf16>(NC), d_branch = device_buffer<bf16>(NC), d_w = device_buffer<bf16>(C),
               d_out = device_buffer<bf16>(NC), d_xnew = device_buffer<bf16>(NC), d_rstd = device_buffer<float>(N),
               d_inplace = device_buffer<bf16>(NC);
  upload_bf16(d_res, res);
  upload_bf16(d_branch, branch);
  upload_bf16(d_w, w);
  auto forward = [&] {
    spes::cuda::rmsnorm_forward(d_out.as<bf16>(), d_rstd.as<float>(), d_xnew.as<bf16>(), d_res.as<bf16>(),
                                d_branch.as<bf16>(), d_w.as<bf16>(), N, C, kEps, nullptr);
  };
  for (const GlobalBuffer* b : {&d_out, &d_xnew, &d_rstd}) b->poison();
  forward();
  const std::vector<float> out = download_bf16(d_out, NC);
  CHECK_MESSAGE(same_bits(download_bf16(d_xnew, NC), x), shape << ": the new residual is not bf16(res + branch)");
  report.check("rmsnorm fwd out", shape, out, out_ref, kTolBf16);
  report.check("rmsnorm fwd rstd", shape, download(d_rstd, N), rstd_ref, kTolF32);
  check_rerun_identical("rmsnorm fwd " + shape, {&d_out, &d_xnew, &d_rstd}, forward);

  // In place (res_out aliases res_in): the same bits; without a branch: a plain norm.
  upload_bf16(d_inplace, res);
  d_out.poison();
  spes::cuda::rmsnorm_forward(d_out.as<bf16>(), d_rstd.as<float>(), d_inplace.as<bf16>(), d_inplace.as<bf16>(),
                              d_branch.as<bf16>(), d_w.as<bf16>(), N, C, kEps, nullptr);
  CHECK_MESSAGE(same_bits(download_bf16(d_inplace, NC), x), shape << ": in place, the new residual differs");
  CHECK_MESSAGE(same_bits(download_bf16(d_out, NC), out), shape << ": in place, out differs");
  for (const GlobalBuffer* b : {&d_out, &d_rstd}) b->poison();
  spes::cuda::rmsnorm_forward(d_out.as<bf16>(), d_rstd.as<float>(), nullptr, d_res.as<bf16>(), nullptr, d_w.as<bf16>(),
                              N, C, kEps, nullptr);
  report.check("rmsnorm fwd out, no branch", shape, download_bf16(d_out, NC), plain_ref, kTolBf16);
  report.check("rmsnorm fwd rstd, no branch", shape, download(d_rstd, N), plain_rstd, kTolF32);

  // Backward of the with-branch forward (d_xnew, and rstd restored).
  forward();
  GlobalBuffer d_dout = device_buffer<bf16>(NC), d_dres = device_buffer<bf16>(NC), d_dres_out = device_buffer<bf16>(NC),
               d_dw = device_buffer<float>(C), scratch(spes::cuda::rmsnorm_backward_scratch_bytes(N, C));
  upload_bf16(d_dout, dout);
  upload_bf16(d_dres, dres);
  auto backward = [&] {
    spes::cuda::rmsnorm_backward(d_dres_out.as<bf16>(), d_dw.as<float>(), scratch.as<void>(), d_dout.as<bf16>(),
                                 d_dres.as<bf16>(), d_xnew.as<bf16>(), d_w.as<bf16>(), d_rstd.as<float>(), N, C,
                                 nullptr);
  };
  d_dres_out.poison();
  scratch.poison();
  d_dw.zero();
  backward();
  const std::vector<float> dres_out = download_bf16(d_dres_out, NC), dw = download(d_dw, C);
  report.check("rmsnorm bwd dresidual", shape, dres_out, dres_ref, kTolBf16);
  report.check("rmsnorm bwd dweight", shape, dw, dw_ref, kTolF32);
  check_rerun_identical("rmsnorm bwd " + shape, {&d_dres_out, &scratch}, backward);
  CHECK_MESSAGE(same_bits(download(d_dw, C), added_thrice(dw)), shape << ": the reruns added other dweight bits");

  // In place on the residual gradient with a frozen weight: the same bits; without an
  // incoming residual gradient: dx alone.
  upload_bf16(d_inplace, dres);
  spes::cuda::rmsnorm_backward(d_inplace.as<bf16>(), nullptr, nullptr, d_dout.as<bf16>(), d_inplace.as<bf16>(),
                               d_xnew.as<bf16>(), d_w.as<bf16>(), d_rstd.as<float>(), N, C, nullptr);
  CHECK_MESSAGE(same_bits(download_bf16(d_inplace, NC), dres_out), shape << ": in place, dresidual differs");
  d_dres_out.poison();
  spes::cuda::rmsnorm_backward(d_dres_out.as<bf16>(), nullptr, nullptr, d_dout.as<bf16>(), nullptr, d_xnew.as<bf16>(),
                               d_w.as<bf16>(), d_rstd.as<float>(), N, C, nullptr);
  report.check("rmsnorm bwd dx, no residual grad", shape, download_bf16(d_dres_out, NC), dx_ref, kTolBf16);
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

void check_qknorm_rope(const RopeShape& s, ErrorReport& report) {
  const auto [B, T, H, D, theta] = s;
  const std::string shape = s.tag();
  INFO(shape);
  rng().seed(kSeed);
  const int64_t N = B * T, C = H * D, NC = N * C;
  const std::vector<float> inp = random_bf16_values(NC, 2.0f), w = norm_weight(C), dout = random_bf16_values(NC);

  std::vector<float> normed(NC), rstd_ref(N), out_ref(NC), dnormed(NC), dinp_ref(NC), dw_ref(C, 0.0f);
  spes::cpu::rmsnorm_forward(normed.data(), rstd_ref.data(), inp.data(), w.data(), N, C, kEps);
  spes::cpu::rope_forward(out_ref.data(), normed.data(), B, T, H, D, theta);
  spes::cpu::rope_backward(dnormed.data(), dout.data(), B, T, H, D, theta);
  spes::cpu::rmsnorm_backward(dinp_ref.data(), dw_ref.data(), dnormed.data(), inp.data(), w.data(), rstd_ref.data(), N,
                              C);

  GlobalBuffer d_table(spes::cuda::rope_table_bytes(T, D));
  d_table.poison();
  spes::cuda::rope_table_init(d_table.as<float2>(), T, D, theta, nullptr);
  report.check("rope table", shape, download(d_table, T * D), rope_table_reference(T, D, theta), 1e-7);

  GlobalBuffer d_inp = device_buffer<bf16>(NC), d_w = device_buffer<bf16>(C), d_out = device_buffer<bf16>(NC),
               d_rstd = device_buffer<float>(N);
  upload_bf16(d_inp, inp);
  upload_bf16(d_w, w);
  auto forward = [&] {
    spes::cuda::qknorm_rope_forward(d_out.as<bf16>(), d_rstd.as<float>(), d_inp.as<bf16>(), d_w.as<bf16>(),
                                    d_table.as<float2>(), B, T, H, D, kEps, nullptr);
  };
  d_out.poison();
  d_rstd.poison();
  forward();
  report.check("qknorm_rope fwd out", shape, download_bf16(d_out, NC), out_ref, kTolBf16);
  report.check("qknorm_rope fwd rstd", shape, download(d_rstd, N), rstd_ref, kTolF32);
  check_rerun_identical("qknorm_rope fwd " + shape, {&d_out, &d_rstd}, forward);

  GlobalBuffer d_dout = device_buffer<bf16>(NC), d_dinp = device_buffer<bf16>(NC), d_dw = device_buffer<float>(C),
               scratch(spes::cuda::qknorm_rope_backward_scratch_bytes(B, T, H, D));
  upload_bf16(d_dout, dout);
  auto backward = [&](float* dweight, void* partials) {
    spes::cuda::qknorm_rope_backward(d_dinp.as<bf16>(), dweight, partials, d_dout.as<bf16>(), d_inp.as<bf16>(),
                                     d_w.as<bf16>(), d_rstd.as<float>(), d_table.as<float2>(), B, T, H, D, nullptr);
  };
  d_dinp.poison();
  scratch.poison();
  d_dw.zero();
  backward(d_dw.as<float>(), scratch.as<void>());
  const std::vector<float> dinp = download_bf16(d_dinp, NC), dw = download(d_dw, C);
  report.check("qknorm_rope bwd dinp", shape, dinp, dinp_ref, kTolBf16);
  report.check("qknorm_rope bwd dweight", shape, dw, dw_ref, kTolF32);
  check_rerun_identical("qknorm_rope bwd " + shape, {&d_dinp, &scratch},
                        [&] { backward(d_dw.as<float>(), scratch.as<void>()); });
  CHECK_MESSAGE(same_bits(download(d_dw, C), added_thrice(dw)), shape << ": the reruns added other dweight bits");

  d_dinp.poison();
  backward(nullptr, nullptr);  // frozen weight: the same input gradient
  CHECK_MESSAGE(same_bits(download_bf16(d_dinp, NC), dinp), shape << ": with a frozen weight, dinp differs");
}

}  // namespace

// Row layouts (norm_common.cuh: 8 channels a vector, tx threads a row, ty rows a
// block): vpt = 1 up to C = 2048, 2 up to 4096, 4 up to 8192; c8 = C/8 off the warp
// grid (24: 3 vectors in a 32-lane row; 2056 and 4104: 129 vectors per thread slot,
// 160 threads, 31 idle); N not a multiple of ty; and N beyond one wave of backward
// blocks, so that each block strides over several row groups (on the emulated H100:
// C = 64 → G = 132·16 blocks × 4 rows = 8448 rows a wave; C = 8192 → 528 × 2 = 1056).
TEST_CASE("emulated rmsnorm + residual matches the CPU model") {
  const std::pair<int64_t, int64_t> shapes[] = {{37, 64},  {130, 768}, {9, 2048}, {11, 2056}, {5, 4104},   {300, 24},
                                                {7, 8192}, {3, 4096},  {1, 8},    {8451, 64}, {1059, 8192}};
  ErrorReport report;
  for (const auto& [N, C] : shapes) check_rmsnorm(N, C, report);
}

// Head dims with D % 8 != 0 (24: vectors straddle the halves; 6: vectors straddle
// heads), long T (large angles), OLMoE-like 16 × 128, C = 6144 (two 24 KB rows once
// overflowed 48 KB with the static scratch; now one row a block), the tiny demo's q/k
// (configs/tiny.toml: 8 × 256 tokens, 4 heads × 32), C = 8192 (vpt 4, one row a
// block), and rows beyond one wave of backward blocks (C = 64: 2112 blocks × 4 rows).
TEST_CASE("emulated qk-norm + rope matches the CPU model") {
  const RopeShape shapes[] = {{2, 5, 3, 16, 1e4},   {2, 33, 12, 64, 1e4},  {1, 7, 4, 24, 1e4},   {3, 4, 4, 6, 1e4},
                              {1, 3, 16, 128, 5e5}, {1, 2049, 2, 16, 1e4}, {2, 5, 48, 128, 1e4}, {8, 256, 4, 32, 1e4},
                              {1, 3, 64, 128, 1e4}, {3, 2900, 2, 32, 1e4}};
  ErrorReport report;
  for (const RopeShape& s : shapes) check_qknorm_rope(s, report);
}
