// Fused cross-entropy + z-loss vs cpu::crossentropy_forward / _backward on the
// same bf16 logits. Tolerances: losses and lse (fp32 math) 1e-5; the bf16
// gradient 1e-2. Both implementations (sm_90 cluster, row) are checked where the
// device supports them (an H100, the emulated one of test_emu included); rows that
// are not 16-byte aligned (ld = V odd) and padded rows (ld > V, padding poisoned with
// NaN: reading it would poison lse) both run.
#include <chrono>
#include <tuple>

#include "cuda/crossentropy.cuh"
#include "model/cpu/ops.hpp"
#include "tests/cuda_test.cuh"
#include "tests/kernel_cases.hpp"

using namespace spes::cuda;
using namespace spes::test;

namespace {

constexpr double kTolF32 = 1e-5;
constexpr double kTolBf16 = 1e-2;


void check_case(int64_t N, int64_t V, int64_t ld, CeImpl impl, bool in_place) {
  CAPTURE(N);
  CAPTURE(V);
  CAPTURE(ld);
  CAPTURE(int(impl));
  CAPTURE(in_place);
  const std::vector<float> logits = rounded_bf16(random_vector(N * V, 3.0f));
  std::vector<int32_t> targets = random_tokens(N, V);
  targets[0] = 0;
  if (N > 1) targets[N - 1] = int32_t(V - 1);
  if (N > 2) targets[1] = int32_t(std::min<int64_t>(V - 1, round_up(ceil_div(V, 8), 8)));  // a slice boundary
  const float ce_scale = 1.0f / float(N), z_scale = 0.3f / float(N);

  std::vector<float> loss_ref(N), lse_ref(N), dlogits_ref(N * V);
  spes::cpu::crossentropy_forward(loss_ref.data(), lse_ref.data(), logits.data(), targets.data(), N, V);
  spes::cpu::crossentropy_backward(dlogits_ref.data(), logits.data(), lse_ref.data(), targets.data(), N, V, ce_scale,
                                   z_scale);

  auto d_logits = upload_bf16(strided(logits, N, V, ld));
  auto d_targets = upload(targets);
  DevTensor<float> d_loss(N), d_lse(N);
  DevTensor<bf16> d_grad(N * ld);
  d_loss.poison();
  d_lse.poison();
  d_grad.poison();
  bf16* grad = in_place ? d_logits.get() : d_grad.get();
  crossentropy_forward_backward(grad, d_loss, d_lse, d_logits, d_targets, N, V, ld, ce_scale, z_scale, stream(), impl);
  CHECK_REL("loss", download(d_loss.get(), N).data(), loss_ref.data(), N, kTolF32);
  CHECK_REL("lse", download(d_lse.get(), N).data(), lse_ref.data(), N, kTolF32);
  const std::vector<float> g = dense_of(download(grad, N * ld), N, V, ld);
  CHECK_REL("dlogits", g.data(), dlogits_ref.data(), N * V, kTolBf16);

  // forward only (evaluation): no gradient written
  d_loss.poison();
  auto d_logits2 = upload_bf16(strided(logits, N, V, ld));
  crossentropy_forward_backward(nullptr, d_loss, d_lse, d_logits2, d_targets, N, V, ld, ce_scale, z_scale, stream(),
                                impl);
  CHECK_REL("loss (forward only)", download(d_loss.get(), N).data(), loss_ref.data(), N, kTolF32);
}

}  // namespace

GPU_TEST_CASE("cuda crossentropy: fused loss, lse and logit gradient vs cpu") {
  std::vector<CeImpl> impls = {CeImpl::row};
  if (crossentropy_cluster_supported(151665)) impls.push_back(CeImpl::cluster);
  else MESSAGE("cluster kernel not supported on this device/build: only the row kernel is tested");
  for (CeImpl impl : impls) {
    for (auto [N, V, pad] : {std::tuple<int64_t, int64_t, int64_t>{7, 1000, 0}, {5, 1001, 0}, {3, 151665, 0},
                             {4, 151665, 15}, {2, 13, 3}, {33, 4, 0}}) {
      const int64_t ld = V + pad;
      check_case(N, V, ld, impl, false);
      check_case(N, V, ld, impl, true);
    }
  }
}

GPU_TEST_CASE("cuda crossentropy: automatic choice uses the cluster kernel on sm_90") {
  const bool supported = crossentropy_cluster_supported(151665);
  // std::string: doctest prints a const char* as an address.
  MESSAGE("cluster kernel " << std::string(supported ? "supported" : "not supported") << " on "
                            << runtime().info().name);
  if (runtime().info().cc_major >= 9) WARN_MESSAGE(supported, "sm_90 device but no cluster kernel: built without sm_90?");
}

GPU_TEST_CASE("cuda crossentropy: cluster support is queried once per device, then answered from a cache") {
  const bool large = crossentropy_cluster_supported(151665), small = crossentropy_cluster_supported(1000);
  // The same answer every time, a small V after a large one included (the opt-in is only raised).
  for (int i = 0; i < 3; ++i) {
    CHECK(crossentropy_cluster_supported(151665) == large);
    CHECK(crossentropy_cluster_supported(1000) == small);
  }
  // Cached: a call is a lookup, not six CUDA queries (attributes, opt-in, cluster occupancy).
  const int calls = 10000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) (void)crossentropy_cluster_supported(151665);
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / calls;
  MESSAGE("crossentropy_cluster_supported: " << us << " µs per call");
  CHECK(us < 20.0);
  // Alternating slice sizes on the cluster kernel: each still right (large, small, large).
  if (large && small) {
    check_case(3, 151665, 151665, CeImpl::cluster, false);
    check_case(7, 1000, 1000, CeImpl::cluster, false);
    check_case(2, 151665, 151672, CeImpl::cluster, true);
  }
}

// Argument checks throw on the host before any CUDA call (including the device
// queries of the automatic choice): no GPU needed, fake device addresses.
TEST_CASE("cuda crossentropy: bad shapes and pointers throw before any CUDA call") {
  bf16* logits = reinterpret_cast<bf16*>(0x10000);
  float* f = reinterpret_cast<float*>(0x20000);
  const int32_t* t = reinterpret_cast<const int32_t*>(0x30000);
  CHECK_THROWS_ERROR(crossentropy_forward_backward(logits, f, f, logits, t, 4, 100, 99, 1.0f, 0.0f, nullptr),
                     "crossentropy_forward_backward: need 0 < V < 2^30 and ld ≥ V");
  CHECK_THROWS_ERROR(crossentropy_forward_backward(reinterpret_cast<bf16*>(0x50002), f, f, logits, t, 4, 100, 100,
                                                   1.0f, 0.0f, nullptr),
                     "same 16-byte alignment offset");
  CHECK_THROWS_ERROR(crossentropy_forward_backward(nullptr, nullptr, f, logits, t, 4, 100, 100, 1.0f, 0.0f, nullptr),
                     "losses must not be null");
  // In place is fine; a partial overlap (here 8 values, one 16-byte vector, in) is not.
  CHECK_THROWS_ERROR(crossentropy_forward_backward(logits + 8, f, f, logits, t, 4, 100, 100, 1.0f, 0.0f, nullptr),
                     "dlogits must be the logits themselves (in place) or not overlap them");
  CHECK_THROWS_ERROR(crossentropy_forward_backward(nullptr, f, f, logits, nullptr, 4, 100, 100, 1.0f, 0.0f, nullptr),
                     "targets must not be null");
  CHECK_THROWS_ERROR(crossentropy_forward_backward(nullptr, f, reinterpret_cast<float*>(0x20002), logits, t, 4, 100,
                                                   100, 1.0f, 0.0f, nullptr),
                     "lse must be 4-byte aligned");
}
