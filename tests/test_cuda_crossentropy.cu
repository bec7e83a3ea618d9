// Fused cross-entropy + z-loss (cuda/crossentropy.cu) and the means over tokens of
// the losses and lse² (cuda/loss.cu), against a float64 reference of
// cpu::crossentropy_forward / _backward on the same bf16 logits. Not the CPU model
// itself: its sequential fp32 sum over V = 151 665 values puts its lse 1.4e-5
// (relative) below the float64 value, while the kernels' merged partial sums land on
// the float64 value rounded to fp32.
//
// Both implementations run where the device supports them: the row kernel, and the
// sm_90 cluster kernel (an H100, and the emulated one, which runs clusters of 8 CTAs
// at once with cluster.sync and distributed shared memory, tests/emu/emu.hpp).
//
// Tolerances: losses and lse (fp32 math) 1e-6 on the emulator (exact exp; measured
// ≤ 8e-8), 1e-5 on a GPU (exp2f's approximation); the bf16 gradient 1e-2 (one bf16
// rounding, ~2e-3). Rows that are not 16-byte aligned (V odd: scalar head and tail
// around the vectors), padded rows (ld > V, the padding NaN: reading it would poison
// lse; it must also stay unwritten), in place and forward only, targets on both
// sides of the boundary between the cluster kernel's first two slices. Every output
// starts as NaN; every call runs under every schedule (for_each_schedule; on the
// emulator the cluster's CTAs also one at a time, in ascending then descending rank)
// and must write the same bits.
//
// Inputs are seeded (kSeed) per case: this test runs on every commit.
//
// Mutations it fails on (applied by hand, not kept): block_merge without either
// __syncthreads; merge without its empty-partial guard (NaN at V = 4); the vector
// count rounded up (reads past the row); pass2 missing a target in vector lane 7;
// pass1 skipping the first tail value; the z-loss term dropped; add8 without its
// rescale; the target logit read after an in-place gradient pass; one row short;
// loss_sums: the tree from 256, or without its barrier. Cluster kernel: either
// cluster.sync dropped (EMU "has exited"; partials read before they were written);
// the target's rank taken as y / chunk + 1 (EMU "rank 8 outside the cluster"); the
// target logit read from its slice's CTA before the first cluster.sync; the smem pad
// dropped (UBSan "misaligned address"); the last slice not clipped to V.
#include <chrono>
#include <cmath>
#include <string>
#include <tuple>

#include "cuda/crossentropy.cuh"
#include "cuda/loss.cuh"
#include "tests/cuda_test.cuh"

using namespace spes::cuda;
using namespace spes::test;

namespace {

constexpr uint64_t kSeed = 20240614;
constexpr double kTolF32 = kEmulated ? 1e-6 : 1e-5;
constexpr double kTolBf16 = 1e-2;

// Logits stored with row stride ld ≥ V; the padding is NaN.
std::vector<float> strided(const std::vector<float>& dense, int64_t N, int64_t V, int64_t ld) {
  std::vector<float> s(N * ld, NAN);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < V; ++i) s[n * ld + i] = dense[n * V + i];
  return s;
}
// The first V values of each row of a strided matrix.
std::vector<float> dense_of(const std::vector<float>& s, int64_t N, int64_t V, int64_t ld) {
  std::vector<float> d(N * V);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < V; ++i) d[n * V + i] = s[n * ld + i];
  return d;
}

// lse, loss = lse − z_target and dlogits = ce_scale·(softmax − onehot(target)) +
// z_scale·2·lse·softmax of each row, in float64.
struct Reference {
  std::vector<float> loss, lse, dlogits;
};
Reference reference(const std::vector<float>& logits, const std::vector<int32_t>& targets, int64_t N, int64_t V,
                    double ce_scale, double z_scale) {
  Reference r{std::vector<float>(N), std::vector<float>(N), std::vector<float>(N * V)};
  for (int64_t n = 0; n < N; ++n) {
    const float* z = logits.data() + n * V;
    double m = z[0], s = 0.0;
    for (int64_t i = 1; i < V; ++i) m = std::max(m, double(z[i]));
    for (int64_t i = 0; i < V; ++i) s += std::exp(z[i] - m);
    const double lse = m + std::log(s);
    r.lse[n] = float(lse);
    r.loss[n] = float(lse - z[targets[n]]);
    for (int64_t i = 0; i < V; ++i) {
      const double p = std::exp(z[i] - lse);
      r.dlogits[n * V + i] = float(p * (ce_scale + z_scale * 2.0 * lse) - (i == targets[n] ? ce_scale : 0.0));
    }
  }
  return r;
}

// Whether values [from, ld) of every row are still the poison (all bits set).
bool poisoned(const DevTensor<bf16>& b, int64_t N, int64_t from, int64_t ld) {
  const std::vector<bf16> h = copy_to_host(b.get(), N * ld);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = from; i < ld; ++i) {
      uint16_t bits;
      std::memcpy(&bits, &h[n * ld + i], sizeof bits);
      if (bits != 0xFFFF) return false;
    }
  return true;
}

const char* name(CeImpl impl) {
  switch (impl) {
    case CeImpl::row: return "row";
    case CeImpl::cluster: return "cluster";
    case CeImpl::automatic: return "automatic";
  }
  return "?";
}

void check_case(int64_t N, int64_t V, int64_t ld, CeImpl impl, bool in_place, ErrorReport& report) {
  const std::string shape = "N=" + std::to_string(N) + " V=" + std::to_string(V) + " ld=" + std::to_string(ld) + " " +
                            name(impl) + (in_place ? " in place" : "");
  INFO(shape);
  rng().seed(kSeed);
  const std::vector<float> logits = random_bf16_values(N * V, 3.0f);
  std::vector<int32_t> targets = random_tokens(N, V);
  targets[0] = 0;
  if (N > 1) targets[N - 1] = int32_t(V - 1);
  // The first value of the cluster kernel's second slice, and the last of its first.
  const int64_t chunk = (V + 63) / 64 * 8;
  if (N > 2) targets[1] = int32_t(std::min<int64_t>(V - 1, chunk));
  if (N > 3) targets[2] = int32_t(std::min<int64_t>(V - 1, chunk - 1));
  const float ce_scale = 1.0f / float(N), z_scale = 0.3f / float(N);
  const Reference ref = reference(logits, targets, N, V, ce_scale, z_scale);

  const std::vector<bf16> stored = to_bf16(strided(logits, N, V, ld));
  DevTensor<bf16> d_logits(N * ld), d_grad(N * ld);
  DevTensor<float> d_loss(N), d_lse(N);
  const DevTensor<int32_t> d_targets = upload(targets);
  const DevTensor<bf16>& grad = in_place ? d_logits : d_grad;
  auto run = [&](bf16* dlogits) {
    d_logits.upload(stored);  // in place, the gradient overwrote them
    crossentropy_forward_backward(dlogits, d_loss, d_lse, d_logits, d_targets, N, V, ld, ce_scale, z_scale, stream(),
                                  impl);
  };
  d_grad.poison();
  for_each_schedule("crossentropy " + shape, {d_loss, d_lse, grad}, [&] {
    run(grad);
    report.check("loss", shape, download(d_loss.get(), N), ref.loss, kTolF32);
    report.check("lse", shape, download(d_lse.get(), N), ref.lse, kTolF32);
    report.check("dlogits", shape, dense_of(download(grad.get(), N * ld), N, V, ld), ref.dlogits, kTolBf16);
    if (!in_place) CHECK_MESSAGE(poisoned(d_grad, N, V, ld), shape << ": the gradient's row padding was written");
  });

  // Forward only (evaluation): no gradient written.
  d_loss.poison();
  d_grad.poison();
  run(nullptr);
  report.check("loss (forward only)", shape, download(d_loss.get(), N), ref.loss, kTolF32);
  if (!in_place) CHECK_MESSAGE(poisoned(d_grad, N, 0, ld), shape << ": forward only wrote a gradient");
}

}  // namespace

// V from 4 (all scalar, no vector) to 151 665 (Qwen's vocabulary: 148 vectors a
// thread), odd V (every other row starts off a 16-byte boundary), padded rows.
GPU_TEST_CASE("cuda crossentropy (row and cluster kernels): fused loss, lse and logit gradient vs float64") {
  std::vector<CeImpl> impls = {CeImpl::row};
  if (crossentropy_cluster_supported(151665)) impls.push_back(CeImpl::cluster);
  else MESSAGE("cluster kernel not supported on this device/build: only the row kernel is tested");
  const std::tuple<int64_t, int64_t, int64_t> shapes[] = {{7, 1000, 0}, {5, 1001, 0}, {3, 151665, 0}, {4, 151665, 15},
                                                          {2, 13, 3},   {33, 4, 0},   {6, 4104, 9}};  // N, V, padding
  for (CeImpl impl : impls) {
    ErrorReport report;  // the worst errors of each kernel
    for (const auto& [N, V, pad] : shapes)
      for (bool in_place : {false, true}) check_case(N, V, V + pad, impl, in_place, report);
  }
}

// On an sm_90 device the cluster kernel runs for every V here (its slice fits shared
// memory), so the automatic choice must launch it: counted on the emulator, where its
// outputs are those of the row kernel, bit for bit, in these cases.
GPU_TEST_CASE("cuda crossentropy: the automatic choice is the cluster kernel on sm_90") {
  ErrorReport report;
  for (const auto& [N, V] : {std::pair<int64_t, int64_t>{3, 151665}, {5, 1001}, {33, 4}}) {
    const bool supported = crossentropy_cluster_supported(V);
    if (runtime().info().cc_major >= 9)
      WARN_MESSAGE(supported, "V=" << V << ": sm_90 device but no cluster kernel: built without sm_90?");
#ifdef SPES_EMULATOR
    CHECK_MESSAGE(supported, "V=" << V << ": no cluster kernel on the emulated H100");
    const uint64_t launches = emu::cluster_launches();
#endif
    check_case(N, V, V, CeImpl::automatic, false, report);
#ifdef SPES_EMULATOR
    CHECK_MESSAGE(emu::cluster_launches() > launches, "V=" << V << ": the automatic choice ran the row kernel");
#endif
  }
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
    ErrorReport report;
    check_case(3, 151665, 151665, CeImpl::cluster, false, report);
    check_case(7, 1000, 1000, CeImpl::cluster, false, report);
    check_case(2, 151665, 151672, CeImpl::cluster, true, report);
  }
}

// loss_sums: one block of 1024 threads, each summing i ≡ t (mod 1024) in double, then
// a fixed tree; against a float64 sum in order (1e-12: another order of double
// additions). n below, at and past one value a thread, and many per thread.
GPU_TEST_CASE("cuda loss sums match a float64 reference, deterministically") {
  for (int64_t n : {int64_t(1), int64_t(1000), int64_t(1024), int64_t(1025), int64_t(65537)}) {
    const std::string shape = "n=" + std::to_string(n);
    INFO(shape);
    rng().seed(kSeed);
    const std::vector<float> losses = random_vector(n, 2.0f), lse = random_vector(n, 5.0f);
    double loss_ref = 0.0, z_ref = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      loss_ref += losses[i];
      z_ref += double(lse[i]) * lse[i];
    }
    const DevTensor<float> d_losses = upload(losses), d_lse = upload(lse);
    DevTensor<double> d_sums(2);
    for_each_schedule("loss sums " + shape, {d_sums}, [&] {
      loss_sums(d_sums, d_losses, d_lse, n, stream());
      const std::vector<double> sums = copy_to_host(d_sums.get(), 2);
      CHECK_MESSAGE(std::abs(sums[0] - loss_ref) <= 1e-12 * std::abs(loss_ref),
                    shape << ": Σ losses " << sums[0] << " vs " << loss_ref);
      CHECK_MESSAGE(std::abs(sums[1] - z_ref) <= 1e-12 * z_ref, shape << ": Σ lse² " << sums[1] << " vs " << z_ref);
    });
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
