// AdamW and the global gradient norm vs cpu::adamw_update / cpu::sum_squares.
// Tolerances: fp32 master/moments 1e-5 (same formula; FMA contraction may differ),
// bf16 weights must equal the rounded fp32 master exactly; the norm 1e-12
// (double accumulation, different order) and bit-reproducible run to run.
#include <cmath>

#include "cuda/adamw.cuh"
#include "cuda/global_norm.cuh"
#include "model/cpu/ops.hpp"
#include "tests/cuda_test.cuh"

using namespace spes::cuda;
using namespace spes::test;

GPU_TEST_CASE("cuda adamw: three steps vs cpu, vector and scalar paths, clip scale") {
  const float lr = 3e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  // n odd (scalar tail), offset 1 (misaligned: scalar path), a large range.
  for (auto [n, offset] : {std::pair<int64_t, int64_t>{1000003, 0}, {4099, 1}, {3, 0}, {8, 2}}) {
    CAPTURE(n);
    CAPTURE(offset);
    const int64_t total = n + offset;
    std::vector<float> p = random_vector(total), m(total, 0.0f), v(total, 0.0f);
    auto d_p = upload(p), d_m = upload(m), d_v = upload(v);
    DevTensor<bf16> d_w(total);
    d_w.poison();
    const float clip = 0.37f;
    auto d_scale = upload(std::vector<float>{clip});
    for (int64_t t = 1; t <= 3; ++t) {
      std::vector<float> g = random_vector(total, 0.01f);
      auto d_g = upload(g);
      const bool scaled = t == 2;
      adamw_update(d_p.get() + offset, d_w.get() + offset, d_g.get() + offset, d_m.get() + offset,
                   d_v.get() + offset, n, lr, b1, b2, eps, t == 3 ? 0.0f : wd, t, scaled ? d_scale.get() : nullptr,
                   stream());
      if (scaled) spes::cpu::scale_inplace(g.data() + offset, n, clip);
      spes::cpu::adamw_update(p.data() + offset, g.data() + offset, m.data() + offset, v.data() + offset, n, lr, b1,
                              b2, eps, t == 3 ? 0.0f : wd, t);
    }
    const std::vector<float> gp = download(d_p.get(), total), gm = download(d_m.get(), total),
                             gv = download(d_v.get(), total), gw = download(d_w.get(), total);
    CHECK_REL("master", gp.data() + offset, p.data() + offset, n, 1e-5);
    CHECK_REL("m", gm.data() + offset, m.data() + offset, n, 1e-5);
    CHECK_REL("v", gv.data() + offset, v.data() + offset, n, 1e-5);
    const std::vector<float> w_expect = rounded_bf16(std::vector<float>(gp.begin() + offset, gp.end()));
    CHECK_REL("bf16 weights = round(master)", gw.data() + offset, w_expect.data(), n, 0.0);
  }
}

GPU_TEST_CASE("cuda global norm + clip scale vs cpu, deterministic") {
  // spans of several sizes, one misaligned (scalar path), one above the 1024-block cap
  const std::vector<int64_t> sizes = {1, 1000, 70001, 3, 70'000'000};
  std::vector<std::vector<float>> host;
  std::vector<DevTensor<float>> dev;
  std::vector<GradSpan> spans;
  double ref = 0.0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t off = i == 2 ? 1 : 0;
    host.push_back(random_vector(sizes[i] + off, 0.5f));
    dev.push_back(upload(host.back()));
    spans.push_back({dev.back().get() + off, sizes[i]});
    ref += spes::cpu::sum_squares(host.back().data() + off, sizes[i]);
  }
  const size_t scratch_bytes = global_norm_scratch_bytes(spans.data(), int(spans.size()));
  DevTensor<char> scratch{static_cast<int64_t>(scratch_bytes)};
  DevTensor<double> d_norm_sq(1);
  DevTensor<float> d_scale(1);
  auto run = [&](double max_norm) {
    d_norm_sq.poison();
    d_scale.poison();
    global_norm_clip(d_norm_sq, d_scale, spans.data(), int(spans.size()), max_norm, scratch, scratch_bytes, stream());
    const double nsq = copy_to_host(d_norm_sq.get(), 1)[0];
    const float s = copy_to_host(d_scale.get(), 1)[0];
    return std::pair<double, float>{nsq, s};
  };
  const double norm = std::sqrt(ref);
  auto [nsq, s] = run(1.0);
  MESSAGE("norm² gpu " << nsq << " cpu " << ref << " rel " << std::abs(nsq - ref) / ref << " (tol 1e-12)");
  CHECK(std::abs(nsq - ref) / ref <= 1e-12);
  CHECK(norm > 1.0);
  CHECK(s == float(1.0 / (std::sqrt(nsq) + 1e-6)));  // the trainer's rule, from the GPU's own norm
  auto [nsq2, s2] = run(1.0);
  CHECK_MESSAGE(nsq2 == nsq, "global norm is not bit-reproducible");
  CHECK(run(0.0).second == 1.0f);         // clipping off
  CHECK(run(norm * 2).second == 1.0f);    // under the threshold
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
