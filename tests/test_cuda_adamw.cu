// AdamW and the global gradient norm vs cpu::adamw_update / cpu::sum_squares.
// Tolerances: fp32 master/moments 1e-5 (same formula; FMA contraction may differ),
// bf16 weights must equal the rounded fp32 master exactly; the norm 1e-12 (double
// accumulation, different order). Measured on the emulator: the master and moments
// bit-identical to the CPU model's, the norm² 8e-14. The last step and the norm run
// under every schedule (for_each_schedule) and must write the same bits.
//
// Inputs are seeded (kSeed): this test runs on every commit.
//
// Mutations it fails on (applied by hand, not kept): adamw's vector path for a
// partial tail (EMU "wrote past the end"), weight decay dropped, the bf16 pairs
// swapped; global norm: the last tail value dropped, the block barrier removed, the
// finishing warp striding by 64.
#include <cmath>
#include <string>
#include <utility>

#include "cuda/adamw.cuh"
#include "cuda/global_norm.cuh"
#include "model/cpu/ops.hpp"
#include "tests/cuda_test.cuh"

using namespace spes::cuda;
using namespace spes::test;

namespace {
constexpr uint64_t kSeed = 20240615;
}  // namespace

// n odd (a scalar tail after the float4s), offset 1 (misaligned: the scalar path), a
// range of many blocks; step 2 reads a clip scale from device memory, step 3 has no
// weight decay.
GPU_TEST_CASE("cuda adamw: three steps vs cpu, vector and scalar paths, clip scale") {
  const float lr = 3e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, clip = 0.37f;
  ErrorReport report;
  for (auto [n, offset] : {std::pair<int64_t, int64_t>{1000003, 0}, {4099, 1}, {3, 0}, {8, 2}}) {
    const std::string shape = "n=" + std::to_string(n) + " offset=" + std::to_string(offset);
    INFO(shape);
    rng().seed(kSeed);
    const int64_t total = n + offset;
    std::vector<float> p = random_vector(total), m(total, 0.0f), v(total, 0.0f);
    auto d_p = upload(p), d_m = upload(m), d_v = upload(v), d_scale = upload(std::vector<float>{clip});
    DevTensor<bf16> d_w(total);
    d_w.poison();
    for (int64_t t = 1; t <= 3; ++t) {
      std::vector<float> g = random_vector(total, 0.01f);
      auto d_g = upload(g);
      const float decay = t == 3 ? 0.0f : wd;
      const float* scale = t == 2 ? d_scale.get() : nullptr;
      auto step = [&] {
        adamw_update(d_p.get() + offset, d_w.get() + offset, d_g.get() + offset, d_m.get() + offset,
                     d_v.get() + offset, n, lr, b1, b2, eps, decay, t, scale, stream());
      };
      if (t < 3) {
        step();
      } else {  // the same step from the same state under every schedule
        const std::vector<float> before_p = download(d_p.get(), total), before_m = download(d_m.get(), total),
                                 before_v = download(d_v.get(), total);
        for_each_schedule("adamw " + shape, {d_p, d_m, d_v, d_w}, [&] {
          d_p.upload(before_p);
          d_m.upload(before_m);
          d_v.upload(before_v);
          step();
        });
      }
      if (scale != nullptr) spes::cpu::scale_inplace(g.data() + offset, n, clip);
      spes::cpu::adamw_update(p.data() + offset, g.data() + offset, m.data() + offset, v.data() + offset, n, lr, b1,
                              b2, eps, decay, t);
    }
    auto owned = [&](const std::vector<float>& all) { return std::vector<float>(all.begin() + offset, all.end()); };
    const std::vector<float> master = owned(download(d_p.get(), total));
    report.check("master", shape, master, owned(p), 1e-5);
    report.check("m", shape, owned(download(d_m.get(), total)), owned(m), 1e-5);
    report.check("v", shape, owned(download(d_v.get(), total)), owned(v), 1e-5);
    CHECK_MESSAGE(bitwise_equal(owned(download(d_w.get(), total)), rounded_bf16(master)),
                  shape << ": bf16 weights ≠ round(master)");
  }
}

// Spans of several sizes: one misaligned (the scalar path), one just above the cap of
// 1024 blocks a span (65 536 values a block), so that each block strides over it.
GPU_TEST_CASE("cuda global norm + clip scale vs cpu, deterministic") {
  rng().seed(kSeed);
  const std::vector<int64_t> sizes = {1, 1000, 70001, 3, 1024 * 65536 + 5};
  std::vector<DevTensor<float>> dev;
  std::vector<GradSpan> spans;
  double ref = 0.0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t off = i == 2 ? 1 : 0;
    const std::vector<float> g = random_vector(sizes[i] + off, 0.5f);
    dev.push_back(upload(g));
    spans.push_back({dev.back().get() + off, sizes[i]});
    ref += spes::cpu::sum_squares(g.data() + off, sizes[i]);
  }
  const size_t scratch_bytes = global_norm_scratch_bytes(spans.data(), int(spans.size()));
  DevTensor<char> scratch{static_cast<int64_t>(scratch_bytes)};
  DevTensor<double> d_norm_sq(1);
  DevTensor<float> d_scale(1);
  auto run = [&](double max_norm) {
    global_norm_clip(d_norm_sq, d_scale, spans.data(), int(spans.size()), max_norm, scratch, scratch_bytes, stream());
    return std::pair<double, float>{copy_to_host(d_norm_sq.get(), 1)[0], copy_to_host(d_scale.get(), 1)[0]};
  };
  for_each_schedule("global norm", {d_norm_sq, d_scale, scratch}, [&] {
    const auto [nsq, s] = run(1.0);
    MESSAGE("norm² device " << nsq << " cpu " << ref << " rel " << std::abs(nsq - ref) / ref << " (tol 1e-12)");
    CHECK(std::abs(nsq - ref) / ref <= 1e-12);
    CHECK(std::sqrt(ref) > 1.0);
    CHECK(s == float(1.0 / (std::sqrt(nsq) + 1e-6)));  // the trainer's rule, from the kernel's own norm
  });
  CHECK(run(0.0).second == 1.0f);                  // clipping off
  CHECK(run(2.0 * std::sqrt(ref)).second == 1.0f);  // under the threshold
}

// Argument checks throw on the host before any CUDA call: no GPU needed.
TEST_CASE("cuda adamw: bad arguments throw before any CUDA call") {
  float* f = reinterpret_cast<float*>(0x20000);
  bf16* w = reinterpret_cast<bf16*>(0x10000);
  CHECK_THROWS_ERROR(adamw_update(f, w, f, f, f, 10, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0, nullptr, nullptr),
                     "step t must be ≥ 1");
  CHECK_THROWS_ERROR(adamw_update(f, w, nullptr, f, f, 10, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, nullptr, nullptr),
                     "adamw_update: grad must not be null");
  CHECK_THROWS_ERROR(adamw_update(reinterpret_cast<float*>(0x20002), w, f, f, f, 10, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f,
                                  1, nullptr, nullptr),
                     "master must be 4-byte aligned");
}
