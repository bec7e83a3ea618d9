// The MoE dispatch / gather / combine kernels (cuda/moe.cu) vs the CPU model
// (cpu::moe_dispatch_indices, moe_gather_*, moe_combine_*); the router is
// test_cuda_router's, SwiGLU test_cuda_swiglu's, the experts' GEMMs
// test_cuda_grouped_gemm's, the whole MoE block in the model test_gpu_step's.
//
// Exact: the dispatch permutation (offsets, slot_token, token_slot: the CPU's stable
// expert-major order, whatever order the chunks' shared-memory atomics and the warps'
// match_any ranks run in), the gather (a copy), and the round trips (gather then
// gather-backward gives K·x, gather then combine with weights 1/K gives x: exact in
// bf16 for K a power of two). Tolerances: bf16 sums 1e-2 (one bf16 rounding; measured
// on the emulator ≤ 1.9e-3), dtopk_w (fp32) 1e-5 (measured 9e-8). Outputs start as
// NaN; every launcher runs under every schedule (for_each_schedule) and must write
// the same bits.
//
// Inputs are seeded (kSeed) per case: this test runs on every commit.
//
// Mutations it fails on (applied by hand, not kept): scatter without either barrier
// of a round; ranks among the higher lanes; the scan inclusive, or its warp scan
// adding below lane `off`, or offsets[E] from lane 0; gather backward skipping the
// first choice; combine backward's dot not reduced over the warp.
// Survives: the count's shared-memory atomicAdd made a plain increment (the emulator
// runs a warp's lanes one after another between collectives: no update is lost).
#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/moe.cuh"
#include "model/cpu/ops.hpp"
#include "tests/cuda_test.cuh"

using namespace spes::test;

namespace {

constexpr uint64_t kSeed = 20240617;
constexpr double kTolBf16 = 1e-2;
constexpr double kTolF32 = 1e-5;

// K distinct experts per token, drawn from `allowed` (all E when empty).
std::vector<int32_t> random_topk(int64_t N, int64_t E, int64_t K, std::vector<int32_t> allowed) {
  if (allowed.empty()) {
    allowed.resize(E);
    std::iota(allowed.begin(), allowed.end(), 0);
  }
  std::vector<int32_t> idx(N * K);
  for (int64_t t = 0; t < N; ++t) {
    std::shuffle(allowed.begin(), allowed.end(), rng());
    std::copy_n(allowed.begin(), K, idx.begin() + t * K);
  }
  return idx;
}

// The CPU model's dispatch of a routing.
struct Dispatch {
  std::vector<int32_t> offsets, slot_token, token_slot;
};
Dispatch cpu_dispatch(const std::vector<int32_t>& idx, int64_t N, int64_t E, int64_t K) {
  Dispatch d{std::vector<int32_t>(E + 1), std::vector<int32_t>(N * K), std::vector<int32_t>(N * K)};
  spes::cpu::moe_dispatch_indices(d.offsets.data(), d.slot_token.data(), d.token_slot.data(), idx.data(), N, E, K);
  return d;
}

// MoE dispatch: N tokens, E experts, top-K, routed among `allowed` experts.
struct DispatchCase {
  int64_t N, E, K;
  std::vector<int32_t> allowed;  // empty: all experts
  const char* what;
};

}  // namespace

// Chunks of 1024 (token, k) entries a block: several chunks with a partial last one,
// an exact multiple, one token, none; empty experts, every token on one expert, every
// expert on every token; E from 3 to 256.
GPU_TEST_CASE("cuda moe dispatch: the CPU's stable expert-major permutation, exactly") {
  const DispatchCase cases[] = {
      {3000, 16, 2, {}, "several chunks, last one partial"},
      {5, 4, 4, {}, "every expert on every token"},
      {700, 8, 2, {0, 2, 5}, "empty experts"},
      {2500, 4, 1, {3}, "all tokens on one expert"},
      {2049, 64, 8, {}, "fine-grained"},
      {1, 3, 2, {}, "one token"},
      {4096, 256, 2, {}, "E = 256, exact chunk multiple"},
      {0, 8, 2, {}, "no tokens: offsets all 0"},
  };
  for (const auto& [N, E, K, allowed, description] : cases) {
    const std::string what = description;
    INFO(what);
    rng().seed(kSeed);
    const std::vector<int32_t> idx = random_topk(N, E, K, allowed);
    const Dispatch ref = cpu_dispatch(idx, N, E, K);
    const DevTensor<int32_t> d_idx = upload(idx), d_off(E + 1), d_st(N * K), d_ts(N * K),
                             d_scratch(spes::cuda::moe_dispatch_scratch_count(N, E, K));
    for_each_schedule("dispatch, " + what, {d_off, d_st, d_ts, d_scratch}, [&] {
      spes::cuda::moe_dispatch_indices(d_off, d_st, d_ts, d_scratch, d_idx, N, E, K, stream());
      CHECK_MESSAGE(bitwise_equal(copy_to_host(d_off.get(), E + 1), ref.offsets), what << ": offsets differ");
      CHECK_MESSAGE(bitwise_equal(copy_to_host(d_st.get(), N * K), ref.slot_token), what << ": slot_token differs");
      CHECK_MESSAGE(bitwise_equal(copy_to_host(d_ts.get(), N * K), ref.token_slot), what << ": token_slot differs");
    });
  }
}

// C a multiple of 8 (16-byte rows, 8 values a lane) or not (60: one value a lane);
// K from 1 to 8; more rows than one block's 8 warps.
GPU_TEST_CASE("cuda moe gather/combine: CPU semantics, backward, and the permutation round trip") {
  ErrorReport report;
  struct Case {
    int64_t N, E, K, C;
  };
  for (const auto [N, E, K, C] : {Case{500, 8, 2, 64}, {300, 6, 4, 60}, {1000, 64, 8, 256}, {257, 5, 1, 24}}) {
    const std::string shape = "N=" + std::to_string(N) + " K=" + std::to_string(K) + " C=" + std::to_string(C);
    INFO(shape);
    rng().seed(kSeed);
    const int64_t S = N * K;
    const Dispatch d = cpu_dispatch(random_topk(N, E, K, {}), N, E, K);
    const std::vector<float> x = random_bf16_values(N * C), dxe = random_bf16_values(S * C),
                             ye = random_bf16_values(S * C), dout = random_bf16_values(N * C);
    std::uniform_real_distribution<float> uniform(0.05f, 1.0f);
    std::vector<float> w(S);
    for (float& v : w) v = uniform(rng());
    std::vector<float> xe(S * C), dx(N * C), out(N * C), dye(S * C), dw(S);
    spes::cpu::moe_gather_forward(xe.data(), x.data(), d.slot_token.data(), S, C);
    spes::cpu::moe_gather_backward(dx.data(), dxe.data(), d.token_slot.data(), N, K, C);
    spes::cpu::moe_combine_forward(out.data(), ye.data(), w.data(), d.token_slot.data(), N, K, C);
    spes::cpu::moe_combine_backward(dye.data(), dw.data(), dout.data(), ye.data(), w.data(), d.token_slot.data(), N, K,
                                    C);

    const DevTensor<int32_t> slot_token = upload(d.slot_token), token_slot = upload(d.token_slot);
    const DevTensor<bf16> d_x = upload_bf16(x), d_dxe = upload_bf16(dxe), d_ye = upload_bf16(ye),
                          d_dout = upload_bf16(dout), d_xe(S * C), d_dx(N * C), d_out(N * C), d_dye(S * C);
    const DevTensor<float> d_w = upload(w), d_dw(S);
    for_each_schedule("gather " + shape, {d_xe}, [&] {
      spes::cuda::moe_gather_forward(d_xe, d_x, slot_token, S, C, stream());
      CHECK_MESSAGE(bitwise_equal(download(d_xe.get(), S * C), xe), shape << ": the gather is not an exact copy");
    });
    for_each_schedule("gather backward " + shape, {d_dx}, [&] {
      spes::cuda::moe_gather_backward(d_dx, d_dxe, token_slot, N, K, C, stream());
      report.check("gather backward", shape, download(d_dx.get(), N * C), dx, kTolBf16);
    });
    for_each_schedule("combine " + shape, {d_out}, [&] {
      spes::cuda::moe_combine_forward(d_out, d_ye, d_w, token_slot, N, K, C, stream());
      report.check("combine forward", shape, download(d_out.get(), N * C), out, kTolBf16);
    });
    for_each_schedule("combine backward " + shape, {d_dye, d_dw}, [&] {
      spes::cuda::moe_combine_backward(d_dye, d_dw, d_dout, d_ye, d_w, token_slot, N, K, C, stream());
      report.check("combine backward dye", shape, download(d_dye.get(), S * C), dye, kTolBf16);
      report.check("combine backward dtopk_w", shape, download(d_dw.get(), S), dw, kTolF32);
    });

    if ((K & (K - 1)) == 0) {
      const DevTensor<bf16> d_back(N * C);
      d_back.poison();
      spes::cuda::moe_gather_backward(d_back, d_xe, token_slot, N, K, C, stream());
      std::vector<float> kx(N * C);
      for (int64_t i = 0; i < N * C; ++i) kx[i] = float(K) * x[i];
      CHECK_MESSAGE(bitwise_equal(download(d_back.get(), N * C), kx), shape << ": gather → gather backward ≠ K·x");
      const DevTensor<float> d_inv = upload(std::vector<float>(S, 1.0f / float(K)));
      d_back.poison();
      spes::cuda::moe_combine_forward(d_back, d_xe, d_inv, token_slot, N, K, C, stream());
      CHECK_MESSAGE(bitwise_equal(download(d_back.get(), N * C), x), shape << ": gather → combine(1/K) ≠ x");
    }
  }
}

// Argument checks throw on the host before any CUDA call: no GPU needed (fake device
// addresses, never dereferenced; one bad argument per call). Misaligned bf16 views are
// fine (element-wise fallback); missing pointers and bad strides are not.
TEST_CASE("cuda gather/combine, dispatch: bad arguments throw before any CUDA call") {
  bf16* a = reinterpret_cast<bf16*>(0x10000);
  float* f = reinterpret_cast<float*>(0x20000);
  int32_t* i = reinterpret_cast<int32_t*>(0x30000);
  CHECK_THROWS_ERROR(spes::cuda::moe_gather_forward(a, a, nullptr, 8, 64, nullptr), "slot_token must not be null");
  CHECK_THROWS_ERROR(spes::cuda::moe_gather_backward(a, a, i, 8, 0, 64, nullptr), "K must be ≥ 1");
  CHECK_THROWS_ERROR(spes::cuda::moe_combine_forward(a, a, nullptr, i, 8, 2, 64, nullptr), "topk_w must not be null");
  CHECK_THROWS_ERROR(spes::cuda::moe_combine_backward(a, reinterpret_cast<float*>(0x20002), a, a, f, i, 8, 2, 64,
                                                      nullptr),
                     "dtopk_w must be 4-byte aligned");
  CHECK_THROWS_ERROR(spes::cuda::moe_dispatch_indices(i, i, i, nullptr, i, 8, 4, 2, nullptr),
                     "moe_dispatch_indices: scratch must not be null");
}
