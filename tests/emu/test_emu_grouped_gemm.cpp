// The real cuda/grouped_gemm.cu, cuda/grouped_gemm_sm90.cu and
// cuda/grouped_gemm_tma_sm90.cu (both kernel families, GroupedGemmPath, and the sm90a
// weight gradient's two kernels) on the host emulator, for what the GPU test
// (tests/test_cuda_grouped_gemm.cu, which also runs here as emu_test_cuda_grouped_gemm)
// cannot show: races. Each product runs with cp.async landing at wait_group (a read of
// a stage before its wait / barrier) and at issue (a prefetch into a stage other warps
// still read); the emulated wgmma of the sm90a family reads its operands at the other
// end of its window each time (at issue, then at its wait_group: a stage refilled
// before the wgmma reading it was retired shows). Then each warp runs ahead of the
// others in both orders (check_rerun_identical): a race-free kernel writes the same
// bits every time. A
// float64 reference bounds the results as the GPU test does (bf16 outputs 1e-2, the
// fp32 weight gradient 1e-4), so a kernel that is consistently wrong fails too.
//
// Mutations of grouped_gemm.cu that fail (applied by hand to this version, not kept;
// "GPU test" is test_cuda_grouped_gemm.cu on the emulator, "here" this file):
//   mainloop: cp_async_wait<kStages - 2> → <kStages - 1>: NaN (both)
//   mainloop: the __syncthreads after the wait removed: NaN (both)
//   load_tile: chunks stored unswizzled (ldmatrix still swizzled): wrong values (both)
//   load_a, MN-major: the lane bits picking k and m matrices swapped: wrong dW (both)
//   load_tile: the column (K-tail) predicate dropped: EMU "cp.async: source outside
//     every device buffer" (both)
//   find_row_tile: the second __syncthreads removed: EMU "deadlock" (both)
//   find_row_tile: the earlier warps' totals left out of the prefix: NaN (GPU test,
//     E = 256; with E ≤ 32 only warp 0 has experts)
//   rows epilogue: the expert-end row mask widened to r < S: wrong dinp and forward
//     not deterministic (GPU test; here the neighbouring expert happened to win)
//   wgrad: e = i instead of trained[i]: frozen dW written / null dW (GPU test)
//   wgrad: the zero-row early return removed: −0 in a zero-row trained expert's dW
//     becomes +0 (GPU test)
#include "tests/emu/builtins.hpp"

#include <doctest/doctest.h>

#include <cuda_bf16.h>

#include <cmath>
#include <string>
#include <vector>

#include "cuda/grouped_gemm.cuh"
#include "cuda/grouped_gemm_sm90.cuh"
#include "cuda/swiglu.cuh"
#include "tests/emu/emu.hpp"
#include "tests/emu/emu_test.hpp"

namespace {

using namespace spes::test;

constexpr uint64_t kSeed = 20260301;

struct Problem {
  std::vector<int32_t> counts;
  int64_t C, OC;
  int64_t E() const { return int64_t(counts.size()); }
  int64_t S() const {
    int64_t s = 0;
    for (int32_t c : counts) s += c;
    return s;
  }
};

using spes::cuda::grouped_sm90::ScopedWgradKernel;
using spes::cuda::grouped_sm90::WgradKernel;

// The three products of p (or, with rows_products false, the weight gradient alone).
// With bits_of set, the weight gradient must also give the bits the sm90a path gives
// on that kernel (both sm90a kernels sum the same k-steps in the same order).
void check_problem(const Problem& p, spes::cuda::GroupedGemmPath path, bool rows_products = true,
                   const WgradKernel* bits_of = nullptr) {
  const int64_t E = p.E(), S = p.S(), C = p.C, OC = p.OC;
  const std::string tag = std::string(path == spes::cuda::GroupedGemmPath::sm90a ? "sm90a" : "portable") +
                          ": S=" + std::to_string(S) + " E=" + std::to_string(E) + " C=" + std::to_string(C) +
                          " OC=" + std::to_string(OC);
  INFO(tag);
  rng().seed(kSeed);
  const std::vector<float> inp = random_bf16_values(S * C), dout = random_bf16_values(S * OC);
  const std::vector<float> w = random_bf16_values(E * OC * C, 0.1f), prior = random_vector(E * OC * C);
  std::vector<int32_t> offsets(E + 1, 0), trained;
  for (int64_t e = 0; e < E; ++e) {
    offsets[e + 1] = offsets[e] + p.counts[e];
    trained.push_back(int32_t(E - 1 - e));  // any order
  }

  // float64 reference
  std::vector<double> out_r(S * OC, 0), dinp_r(S * C, 0), dw_r(prior.begin(), prior.end());
  for (int64_t e = 0; e < E; ++e)
    for (int64_t s = offsets[e]; s < offsets[e + 1]; ++s) {
      const float* W = w.data() + e * OC * C;
      for (int64_t o = 0; o < OC; ++o)
        for (int64_t c = 0; c < C; ++c) {
          out_r[s * OC + o] += double(inp[s * C + c]) * W[o * C + c];
          dinp_r[s * C + c] += double(dout[s * OC + o]) * W[o * C + c];
          dw_r[(e * OC + o) * C + c] += double(dout[s * OC + o]) * inp[s * C + c];
        }
    }

  emu::GlobalBuffer d_inp = device_buffer<bf16>(S * C), d_dout = device_buffer<bf16>(S * OC),
                    d_w = device_buffer<bf16>(E * OC * C), d_off = device_buffer<int32_t>(E + 1),
                    d_tr = device_buffer<int32_t>(E), d_wt = device_buffer<const bf16*>(E),
                    d_dwt = device_buffer<float*>(E), d_out = device_buffer<bf16>(S * OC),
                    d_dinp = device_buffer<bf16>(S * C), d_dw = device_buffer<float>(E * OC * C);
  upload_bf16(d_inp, inp);
  upload_bf16(d_dout, dout);
  upload_bf16(d_w, w);
  upload(d_off, offsets);
  upload(d_tr, trained);
  for (int64_t e = 0; e < E; ++e) {
    d_wt.as<const bf16*>()[e] = d_w.as<bf16>() + e * OC * C;
    d_dwt.as<float*>()[e] = d_dw.as<float>() + e * OC * C;
  }
  auto forward = [&] {
    spes::cuda::grouped_matmul_forward(d_out.as<bf16>(), d_inp.as<bf16>(), d_wt.as<const bf16*>(),
                                       d_off.as<int32_t>(), S, E, C, OC, nullptr, path);
  };
  auto backward_input = [&] {
    spes::cuda::grouped_matmul_backward_input(d_dinp.as<bf16>(), d_dout.as<bf16>(), d_wt.as<const bf16*>(),
                                              d_off.as<int32_t>(), S, E, C, OC, nullptr, path);
  };
  auto backward_weight = [&] {
    upload(d_dw, prior);
    spes::cuda::grouped_matmul_backward_weight(d_dwt.as<float*>(), d_dout.as<bf16>(), d_inp.as<bf16>(),
                                               d_off.as<int32_t>(), d_tr.as<int32_t>(), E, S, E, C, OC, nullptr,
                                               path);
  };

  struct Result {
    std::vector<float> out, dinp, dw;
  };
  auto run_all = [&](emu::Landing landing) {
    emu::set_landing(landing);
    d_out.poison();
    d_dinp.poison();
    if (rows_products) {
      forward();
      backward_input();
    }
    backward_weight();
    emu::set_landing(emu::Landing::at_wait);
    return Result{download_bf16(d_out, S * OC), download_bf16(d_dinp, S * C), download(d_dw, E * OC * C)};
  };
  const Result at_wait = run_all(emu::Landing::at_wait), at_issue = run_all(emu::Landing::at_issue);
  ErrorReport report;
  if (rows_products) {
    report.check("out", tag, at_wait.out, {out_r.begin(), out_r.end()}, 1e-2);
    report.check("dinp", tag, at_wait.dinp, {dinp_r.begin(), dinp_r.end()}, 1e-2);
    CHECK_MESSAGE(same_bits(at_wait.out, at_issue.out), "forward: landing at issue changed the result (a race)");
    CHECK_MESSAGE(same_bits(at_wait.dinp, at_issue.dinp), "backward-input: landing at issue changed the result");
    check_rerun_identical("forward", {&d_out}, forward);
    check_rerun_identical("backward-input", {&d_dinp}, backward_input);
  }
  report.check("dw", tag, at_wait.dw, {dw_r.begin(), dw_r.end()}, 1e-4);
  CHECK_MESSAGE(same_bits(at_wait.dw, at_issue.dw), "weight gradient: landing at issue changed the result");
  check_rerun_identical("weight gradient", {&d_dw}, backward_weight);
  if (bits_of != nullptr) {
    const ScopedWgradKernel other(*bits_of);
    backward_weight();
    CHECK_MESSAGE(same_bits(download(d_dw, E * OC * C), at_wait.dw), "the two sm90a weight-gradient kernels differ");
  }
}

}  // namespace

// Portable: tiles 128 × 128 × 32 with 4 stages. C = 192 (6 k-steps forward: the ring
// of 4 stages wraps; a 64-column tail backward-input) and OC = 264 (8 k-steps + 8
// backward-input; a column tail of 8 forward); expert row counts 129 (a tile + 1), 0
// and 40; the weight gradient reduces over 129 rows (5 k-steps, the last of 1 row).
TEST_CASE("emulated grouped matmul: race-free under every cp.async landing and warp order") {
  check_problem({{129, 0, 40}, 192, 264}, spes::cuda::GroupedGemmPath::portable);
}

// sm90a: tiles 128 × 256 × 64 with 4 stages, a persistent grid of 132 CTAs. C = 320 (5
// k-steps forward: the ring wraps; a 64-column tail backward-input) and OC = 264 (5
// k-steps, the last of 8, backward-input; a 8-column tail forward); row counts 129, 0,
// 40 and 300 (the weight gradient over 300 rows: 5 k-steps, the last of 44). That is
// fewer tiles than CTAs, so two more problems of 140 experts of 1 to 3 rows give 140
// row tiles and 280 weight-gradient tiles (ranked by rows, many tied, those past the
// first 132 drawn from the tile counter): some CTAs walk two or more. A CTA's k-steps
// are one stream through the stages, tile after tile, the next tile's first ones
// loaded by the current tile's last steps (where it has two or more: backward-input
// of the first of these, 3 k-steps, forward of the second, 3, and backward-input, 2),
// or after its main loop (the forward of the first and the weight gradients, 1
// k-step), in flight while the last tile is stored.
TEST_CASE("emulated grouped matmul, sm90a: race-free under every cp.async landing, wgmma timing and warp order") {
  REQUIRE(spes::cuda::grouped_gemm_sm90a_available());
  check_problem({{129, 0, 40, 300}, 320, 264}, spes::cuda::GroupedGemmPath::sm90a);
  std::vector<int32_t> counts(140);
  for (size_t e = 0; e < counts.size(); ++e) counts[e] = int32_t(1 + e % 3);
  check_problem({counts, 64, 136}, spes::cuda::GroupedGemmPath::sm90a);
  check_problem({counts, 136, 72}, spes::cuda::GroupedGemmPath::sm90a);
}

// The sm90a weight gradient over experts whose tiles take different numbers of
// k-steps: 30 tiles each (OC = 30 · 128, C = 8), more than the 132 CTAs in all, the
// first 132 ranked tiles one per CTA and the rest drawn. Where the CTAs that draw
// (the first ones: the emulator starts the CTAs in order) have the most rows, the
// last steps of their main loop load the drawn tile's first k-steps: the most rows
// take 8 k-steps (the draw, the handover and the loads of the next tile each at its
// own step), 4 (the draw at the first step), 3 (draw and handover at the first);
// below 3 the next tile is loaded after the main loop.
TEST_CASE("emulated grouped matmul, sm90a: the weight gradient's tiles of 1 to 8 k-steps, one after another") {
  REQUIRE(spes::cuda::grouped_gemm_sm90a_available());
  for (const std::vector<int32_t>& counts : {std::vector<int32_t>{100, 500, 1, 150, 200},
                                             std::vector<int32_t>{129, 1, 250, 100, 190},
                                             std::vector<int32_t>{150, 64, 1, 100, 140}})
    check_problem({counts, 8, 30 * 128}, spes::cuda::GroupedGemmPath::sm90a, false);
}

// The sm90a weight gradient fed by the copy engine (grouped_gemm_tma_sm90.cu: 128 × 128
// tiles, a producer thread and two consumer warpgroups taking tiles in turn through a
// ring of 6 stages) on the problems above, and the bits of the threads' kernel each
// time (and that it ran: its copies counted). C = 320, OC = 264: column tiles whose second box lies wholly past C (not
// copied), row tiles whose second box lies past OC; experts of 129, 40 and 300 rows end
// inside a k-step (the tail zeroed, the next expert's rows behind it). The 140 small
// experts give 280 tiles: the second consumer and the drawn tiles at work, every
// tile one k-step; the experts of 1 to 500 rows (30 tiles each) tiles of 1 to 8 k-steps
// one after another in a CTA, so that a consumer waits for the stages of its turn
// behind the other's, and the stage ring wraps within and across tiles. Last, 140
// tiles of exactly 6 k-steps (the ring's length): the second consumer's first tile
// starts on the stage the first consumer's first copy may still be filling, whose
// barrier it has never waited on (it must wait for its turn, not skip that phase).
// Every wait names its phase (mbarrier_wait_phase), which the emulator checks.
TEST_CASE("emulated grouped matmul, sm90a: the TMA weight gradient, race-free, and the threads' kernel's bits") {
  REQUIRE(spes::cuda::grouped_gemm_sm90a_available());
  REQUIRE(spes::cuda::grouped_sm90::wgrad_tma_unavailable_reason().empty());
  const ScopedWgradKernel tma(WgradKernel::tma);
  const WgradKernel threads = WgradKernel::threads;
  const uint64_t copies_before = emu::tma_copies();
  check_problem({{129, 0, 40, 300}, 320, 264}, spes::cuda::GroupedGemmPath::sm90a, false, &threads);
  REQUIRE_MESSAGE(emu::tma_copies() > copies_before, "the weight gradient did not take the TMA kernel");
  std::vector<int32_t> counts(140);
  for (size_t e = 0; e < counts.size(); ++e) counts[e] = int32_t(1 + e % 3);
  check_problem({counts, 64, 136}, spes::cuda::GroupedGemmPath::sm90a, false, &threads);
  check_problem({counts, 136, 72}, spes::cuda::GroupedGemmPath::sm90a, false, &threads);
  check_problem({{100, 500, 1, 150, 200}, 8, 30 * 128}, spes::cuda::GroupedGemmPath::sm90a, false, &threads);
  check_problem({{350}, 8, 140 * 128}, spes::cuda::GroupedGemmPath::sm90a, false, &threads);
  // A consumer's last warp as far behind the rest as the barriers let it: with 1-k-step
  // tiles the other consumer's turn comes round again quickly.
  const ScopedSchedule starved({emu::Schedule::last_warp_starved, emu::Landing::at_wait, "the last warp starved"});
  check_problem({counts, 64, 136}, spes::cuda::GroupedGemmPath::sm90a, false, &threads);
}

// The sm90a weight gradients deal their tiles out from a counter
// (cuda/grouped_gemm_wgrad_schedule.cuh): each launch takes one of kTileTicketSlots
// slots in turn, and its last CTA puts the slot back to zero; both kernels (each its
// own slots). 140 tiles (one expert of 3 rows, OC = 140 · 128; a
// second, empty expert ranked after it) are more than the 132 CTAs, so some CTAs draw
// theirs; twice round the slots and once more, each launch must give the bits of the
// first (a slot left non-zero skips tiles), and the first the float64 sums.
TEST_CASE("emulated grouped matmul, sm90a: the weight gradient's tile counter starts from zero at every launch") {
  REQUIRE(spes::cuda::grouped_gemm_sm90a_available());
  constexpr int64_t S = 3, E = 2, C = 8, OC = 140 * 128;
  rng().seed(kSeed);
  const std::vector<float> inp = random_bf16_values(S * C), dout = random_bf16_values(S * OC),
                           prior = random_vector(E * OC * C);
  const std::vector<int32_t> offsets{0, int32_t(S), int32_t(S)}, trained{1, 0};
  std::vector<double> dw_r(prior.begin(), prior.end());
  for (int64_t s = 0; s < S; ++s)
    for (int64_t o = 0; o < OC; ++o)
      for (int64_t c = 0; c < C; ++c) dw_r[o * C + c] += double(dout[s * OC + o]) * inp[s * C + c];

  emu::GlobalBuffer d_inp = device_buffer<bf16>(S * C), d_dout = device_buffer<bf16>(S * OC),
                    d_off = device_buffer<int32_t>(E + 1), d_tr = device_buffer<int32_t>(E),
                    d_dwt = device_buffer<float*>(E), d_dw = device_buffer<float>(E * OC * C);
  upload_bf16(d_inp, inp);
  upload_bf16(d_dout, dout);
  upload(d_off, offsets);
  upload(d_tr, trained);
  for (int64_t e = 0; e < E; ++e) d_dwt.as<float*>()[e] = d_dw.as<float>() + e * OC * C;
  for (const WgradKernel kernel : {WgradKernel::threads, WgradKernel::tma}) {
    INFO((kernel == WgradKernel::tma ? "the TMA kernel" : "the threads' kernel"));
    const ScopedWgradKernel scope(kernel);
    std::vector<float> first;
    for (int launch = 0; launch <= 2 * spes::cuda::grouped_sm90::kTileTicketSlots; ++launch) {
      upload(d_dw, prior);
      spes::cuda::grouped_matmul_backward_weight(d_dwt.as<float*>(), d_dout.as<bf16>(), d_inp.as<bf16>(),
                                                 d_off.as<int32_t>(), d_tr.as<int32_t>(), E, S, E, C, OC, nullptr,
                                                 spes::cuda::GroupedGemmPath::sm90a);
      const std::vector<float> dw = download(d_dw, E * OC * C);
      if (launch == 0) {
        first = dw;
        ErrorReport report;
        report.check("dw", "one expert of 3 rows, OC = 17920", dw, {dw_r.begin(), dw_r.end()}, 1e-4);
      } else {
        CHECK_MESSAGE(same_bits(dw, first), "launch " << launch << " wrote different bits than the first");
      }
    }
  }
}

// The products with SwiGLU in their store (grouped_matmul_forward_swiglu, whose tile
// pairs gate columns with the same columns of up; grouped_matmul_backward_input_swiglu,
// whose store reads gate and up), on both families: under both cp.async landings the
// bits of the two launches each replaces (the GEMM, then swiglu_forward or
// swiglu_backward), and the same bits under every warp order. 140 experts of 1 to 3
// rows give 140 row tiles, × 3 column tiles forward and × 2 backward at H = 264 on
// sm90a: more than its 132 CTAs, so that stores finish inside the next tile's main
// loop (the backward's gate and up asked of L2 a main loop ahead), and K of 3 (C = 136)
// and 4 (OC = 200) k-steps lets the main loop load the next tile's first ones. On the
// portable path C = 136 is 5 k-steps: the last in stage 0, which the forward's
// exchange of up through shared memory overwrites once every warp is past it.
void check_swiglu_products(spes::cuda::GroupedGemmPath path) {
  std::vector<int32_t> counts(140);
  for (size_t e = 0; e < counts.size(); ++e) counts[e] = int32_t(1 + e % 3);
  const int64_t E = int64_t(counts.size()), C = 136, H = 264, OC = 200;
  std::vector<int32_t> offsets(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];
  const int64_t S = offsets[E];
  INFO((path == spes::cuda::GroupedGemmPath::sm90a ? "sm90a" : "portable") << ": S=" << S << " E=" << E
                                                                           << " C=" << C << " H=" << H << " OC=" << OC);
  rng().seed(kSeed);
  const std::vector<float> inp = random_bf16_values(S * C), dout = random_bf16_values(S * OC);
  const std::vector<float> w_gate_up = random_bf16_values(E * 2 * H * C, 0.2f);
  const std::vector<float> w_down = random_bf16_values(E * OC * H, 0.2f);
  emu::GlobalBuffer d_inp = device_buffer<bf16>(S * C), d_dout = device_buffer<bf16>(S * OC),
                    d_wgu = device_buffer<bf16>(E * 2 * H * C), d_wd = device_buffer<bf16>(E * OC * H),
                    d_off = device_buffer<int32_t>(E + 1), d_wgu_t = device_buffer<const bf16*>(E),
                    d_wd_t = device_buffer<const bf16*>(E), d_gu = device_buffer<bf16>(S * 2 * H),
                    d_h = device_buffer<bf16>(S * H), d_gu_ref = device_buffer<bf16>(S * 2 * H),
                    d_h_ref = device_buffer<bf16>(S * H), d_dh = device_buffer<bf16>(S * H),
                    d_dgu = device_buffer<bf16>(S * 2 * H), d_h2 = device_buffer<bf16>(S * H);
  upload_bf16(d_inp, inp);
  upload_bf16(d_dout, dout);
  upload_bf16(d_wgu, w_gate_up);
  upload_bf16(d_wd, w_down);
  upload(d_off, offsets);
  for (int64_t e = 0; e < E; ++e) {
    d_wgu_t.as<const bf16*>()[e] = d_wgu.as<bf16>() + e * 2 * H * C;
    d_wd_t.as<const bf16*>()[e] = d_wd.as<bf16>() + e * OC * H;
  }
  const int32_t* off = d_off.as<int32_t>();
  auto forward = [&] {
    spes::cuda::grouped_matmul_forward_swiglu(d_gu.as<bf16>(), d_h.as<bf16>(), d_inp.as<bf16>(),
                                              d_wgu_t.as<const bf16*>(), off, S, E, C, H, nullptr, path);
  };
  auto backward = [&] {  // gate and up: the forward's reference output
    spes::cuda::grouped_matmul_backward_input_swiglu(d_dgu.as<bf16>(), d_h2.as<bf16>(), d_dout.as<bf16>(),
                                                     d_wd_t.as<const bf16*>(), d_gu_ref.as<bf16>(), off, S, E, H,
                                                     OC, nullptr, path);
  };
  // The two launches each replaces, landing at wait_group.
  spes::cuda::grouped_matmul_forward(d_gu_ref.as<bf16>(), d_inp.as<bf16>(), d_wgu_t.as<const bf16*>(), off, S, E, C,
                                     2 * H, nullptr, path);
  spes::cuda::swiglu_forward(d_h_ref.as<bf16>(), d_gu_ref.as<bf16>(), d_gu_ref.as<bf16>() + H, S, H, 2 * H, nullptr);
  const std::vector<float> gu_ref = download_bf16(d_gu_ref, S * 2 * H), h_ref = download_bf16(d_h_ref, S * H);
  spes::cuda::grouped_matmul_backward_input(d_dh.as<bf16>(), d_dout.as<bf16>(), d_wd_t.as<const bf16*>(), off, S, E,
                                            H, OC, nullptr, path);
  spes::cuda::swiglu_backward(d_dgu.as<bf16>(), d_dgu.as<bf16>() + H, d_h2.as<bf16>(), d_dh.as<bf16>(),
                              d_gu_ref.as<bf16>(), d_gu_ref.as<bf16>() + H, S, H, 2 * H, nullptr);
  const std::vector<float> dgu_ref = download_bf16(d_dgu, S * 2 * H), h2_ref = download_bf16(d_h2, S * H);

  for (const emu::Landing landing : {emu::Landing::at_wait, emu::Landing::at_issue}) {
    const char* when = landing == emu::Landing::at_wait ? "landing at wait_group" : "landing at issue";
    emu::set_landing(landing);
    for (const emu::GlobalBuffer* b : {&d_gu, &d_h, &d_dgu, &d_h2}) b->poison();
    forward();
    backward();
    emu::set_landing(emu::Landing::at_wait);
    CHECK_MESSAGE(same_bits(download_bf16(d_gu, S * 2 * H), gu_ref), "forward gate|up differs, " << when);
    CHECK_MESSAGE(same_bits(download_bf16(d_h, S * H), h_ref), "forward h differs, " << when);
    CHECK_MESSAGE(same_bits(download_bf16(d_dgu, S * 2 * H), dgu_ref), "backward dgate|dup differ, " << when);
    CHECK_MESSAGE(same_bits(download_bf16(d_h2, S * H), h2_ref), "backward h differs, " << when);
  }
  check_rerun_identical("forward with SwiGLU", {&d_gu, &d_h}, forward);
  check_rerun_identical("backward-input with SwiGLU's backward", {&d_dgu, &d_h2}, backward);
}

TEST_CASE("emulated grouped matmul: the SwiGLU products, race-free and the two launches' bits, both families") {
  check_swiglu_products(spes::cuda::GroupedGemmPath::portable);
  REQUIRE(spes::cuda::grouped_gemm_sm90a_available());
  check_swiglu_products(spes::cuda::GroupedGemmPath::sm90a);
}
