// The real cuda/adamw.cu and cuda/global_norm.cu, compiled unchanged as C++
// (CMakeLists.txt) and run on the host emulator (emu.hpp) through their launchers,
// against the CPU model (cpu::adamw_update, cpu::sum_squares), as
// test_cuda_adamw.cu does on a GPU.
//
// Tolerances are test_cuda_adamw.cu's: fp32 master weights and moments 1e-5 relative
// (same formula; FMA contraction may differ); the bf16 weights must equal the rounded
// fp32 master exactly; the squared norm 1e-12 (double accumulation in another order).
// Measured: the master and moments bit-identical to the CPU model's, the norm² 8e-14.
// Outputs start as NaN; the last step and the norm run twice more with the other warp
// schedules and must write the same bits (check_rerun_identical).
//
// Inputs are seeded (kSeed): this test runs on every commit.
//
// Mutations it fails on (applied by hand to this version, not kept): adamw's vector
// path for a partial tail (EMU "wrote past the end"), weight decay dropped, the bf16
// pairs swapped; global norm: the last tail value dropped, the block barrier removed,
// the finishing warp striding by 64.

// First: the kernels' headers include cuda/common.cuh, whose device functions call
// CUDA built-ins.
#include "tests/emu/builtins.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cuda/adamw.cuh"
#include "cuda/global_norm.cuh"
#include "model/cpu/ops.hpp"
#include "tests/emu/emu.hpp"
#include "tests/emu/emu_test.hpp"

namespace {

using namespace spes::test;
using emu::GlobalBuffer;

constexpr uint64_t kSeed = 20240615;

}  // namespace

// n odd (a scalar tail after the float4s), offset 1 (misaligned: the scalar path), a
// range of many blocks; step 2 reads a clip scale from device memory, step 3 has no
// weight decay.
TEST_CASE("emulated adamw: three steps match the CPU model") {
  const float lr = 3e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, clip = 0.37f;
  ErrorReport report;
  for (auto [n, offset] : {std::pair<int64_t, int64_t>{1000003, 0}, {4099, 1}, {3, 0}, {8, 2}}) {
    const std::string shape = "n=" + std::to_string(n) + " offset=" + std::to_string(offset);
    INFO(shape);
    rng().seed(kSeed);
    const int64_t total = n + offset;
    std::vector<float> p = random_vector(total), m(total, 0.0f), v(total, 0.0f);
    GlobalBuffer d_p = device_buffer<float>(total), d_m = device_buffer<float>(total),
                 d_v = device_buffer<float>(total), d_g = device_buffer<float>(total), d_w = device_buffer<bf16>(total),
                 d_scale = device_buffer<float>(1);
    upload(d_p, p);
    upload(d_m, m);
    upload(d_v, v);
    upload(d_scale, std::vector<float>{clip});
    d_w.poison();
    for (int64_t t = 1; t <= 3; ++t) {
      std::vector<float> g = random_vector(total, 0.01f);
      upload(d_g, g);
      const float decay = t == 3 ? 0.0f : wd;
      const float* scale = t == 2 ? d_scale.as<float>() : nullptr;
      const std::vector<float> before[] = {download(d_p, total), download(d_m, total), download(d_v, total)};
      auto step = [&] {
        spes::cuda::adamw_update(d_p.as<float>() + offset, d_w.as<bf16>() + offset, d_g.as<float>() + offset,
                                 d_m.as<float>() + offset, d_v.as<float>() + offset, n, lr, b1, b2, eps, decay, t,
                                 scale, nullptr);
      };
      step();
      if (t == 3)  // the same step again from the same state
        check_rerun_identical("adamw " + shape, {&d_p, &d_m, &d_v, &d_w}, [&] {
          upload(d_p, before[0]);
          upload(d_m, before[1]);
          upload(d_v, before[2]);
          d_w.poison();
          step();
        });
      if (scale != nullptr) spes::cpu::scale_inplace(g.data() + offset, n, clip);
      spes::cpu::adamw_update(p.data() + offset, g.data() + offset, m.data() + offset, v.data() + offset, n, lr, b1, b2,
                              eps, decay, t);
    }
    auto owned = [&](const std::vector<float>& all) { return std::vector<float>(all.begin() + offset, all.end()); };
    const std::vector<float> master = owned(download(d_p, total));
    report.check("master", shape, master, owned(p), 1e-5);
    report.check("m", shape, owned(download(d_m, total)), owned(m), 1e-5);
    report.check("v", shape, owned(download(d_v, total)), owned(v), 1e-5);
    std::vector<float> rounded = master;
    for (float& x : rounded) x = bf16_round(x);
    CHECK_MESSAGE(same_bits(owned(download_bf16(d_w, total)), rounded), shape << ": bf16 weights ≠ round(master)");
  }
}

// Spans of several sizes: one misaligned (the scalar path), one above the cap of 1024
// blocks a span (65 536 values a block), so that each block strides over the span.
TEST_CASE("emulated global norm + clip scale match the CPU model, deterministically") {
  rng().seed(kSeed);
  const std::vector<int64_t> sizes = {1, 1000, 70001, 3, 1024 * 65536 + 5};
  std::vector<GlobalBuffer> grads;
  std::vector<spes::cuda::GradSpan> spans;
  double ref = 0.0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t off = i == 2 ? 1 : 0;
    const std::vector<float> g = random_vector(sizes[i] + off, 0.5f);
    grads.emplace_back(g.size() * sizeof(float));
    upload(grads.back(), g);
    spans.push_back({grads.back().as<float>() + off, sizes[i]});
    ref += spes::cpu::sum_squares(g.data() + off, sizes[i]);
  }
  const size_t scratch_bytes = spes::cuda::global_norm_scratch_bytes(spans.data(), int(spans.size()));
  GlobalBuffer scratch(scratch_bytes), d_norm_sq = device_buffer<double>(1), d_scale = device_buffer<float>(1);
  auto run = [&](double max_norm) {
    d_norm_sq.poison();
    d_scale.poison();
    spes::cuda::global_norm_clip(d_norm_sq.as<double>(), d_scale.as<float>(), spans.data(), int(spans.size()), max_norm,
                                 scratch.as<void>(), scratch_bytes, nullptr);
    return std::pair<double, float>{*d_norm_sq.as<double>(), *d_scale.as<float>()};
  };
  const auto [nsq, s] = run(1.0);
  MESSAGE("norm² emulated " << nsq << " cpu " << ref << " rel " << std::abs(nsq - ref) / ref << " (tol 1e-12)");
  CHECK(std::abs(nsq - ref) / ref <= 1e-12);
  CHECK(std::sqrt(ref) > 1.0);
  CHECK(s == float(1.0 / (std::sqrt(nsq) + 1e-6)));  // the trainer's rule, from the kernel's own norm
  check_rerun_identical("global norm", {&d_norm_sq, &d_scale, &scratch}, [&] { run(1.0); });
  CHECK(run(0.0).second == 1.0f);                   // clipping off
  CHECK(run(2.0 * std::sqrt(nsq)).second == 1.0f);  // under the threshold
}
