// The real cuda/swiglu.cu, compiled unchanged as C++ (CMakeLists.txt) and run on the
// host emulator (emu.hpp) through its launchers, against the CPU model
// (cpu::swiglu_forward / _backward) on the same bf16 values, as the SwiGLU case of
// test_cuda_moe.cu does on a GPU.
//
// Tolerances are test_cuda_moe.cu's: h, dgate and dup 1e-2 relative (one bf16
// rounding; measured ≤ 2.7e-3). Exact: the backward's recomputed h is the forward's h,
// bit for bit (same fp32 expression), also when it overwrites dh in place, and then
// dgate and dup are those of the separate call. Outputs start as NaN; every call runs
// twice more with the other warp schedules and must write the same bits
// (check_rerun_identical).
//
// Inputs are seeded (kSeed) per case: this test runs on every commit.
//
// Mutations it fails on (applied by hand to this version, not kept): h stored with
// gate's row stride; the (1 − σ) term dropped; the grid-stride bound `i <= n` (EMU
// "wrote past the end"); the 16-byte path without the gate/up alignment check (UBSan
// "misaligned address").

// First: the kernels' headers include cuda/common.cuh, whose device functions call
// CUDA built-ins.
#include "tests/emu/builtins.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/swiglu.cuh"
#include "model/cpu/ops.hpp"
#include "tests/emu/emu.hpp"
#include "tests/emu/emu_test.hpp"

namespace {

using namespace spes::test;
using emu::GlobalBuffer;

constexpr uint64_t kSeed = 20240616;
constexpr double kTolBf16 = 1e-2;

struct Case {
  int64_t rows, H;
  bool interleaved;  // gate and up side by side in one [rows, 2H] buffer, as the expert GEMM writes them
  int64_t offset;    // gate|up and dgate|dup start this many elements past a 16-byte boundary (1: the
                     // scalar path, though h and dh are aligned)
  std::string tag() const {
    return "rows=" + std::to_string(rows) + " H=" + std::to_string(H) + (interleaved ? " interleaved" : " dense") +
           (offset ? " offset=" + std::to_string(offset) : "");
  }
};

// Row r of [rows, ld] holds a's row at column 0 and, interleaved, b's at column H.
std::vector<float> pack(const std::vector<float>& a, const std::vector<float>& b, int64_t rows, int64_t H, int64_t ld) {
  std::vector<float> p(rows * ld);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < H; ++j) {
      p[r * ld + j] = a[r * H + j];
      if (ld == 2 * H) p[r * ld + H + j] = b[r * H + j];
    }
  return p;
}
// Columns [col, col + H) of each row of [rows, ld].
std::vector<float> unpack(const std::vector<float>& p, int64_t rows, int64_t H, int64_t ld, int64_t col) {
  std::vector<float> a(rows * H);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < H; ++j) a[r * H + j] = p[r * ld + col + j];
  return a;
}

void check_swiglu(const Case& c, ErrorReport& report) {
  const auto [rows, H, interleaved, off] = c;
  const std::string shape = c.tag();
  INFO(shape);
  rng().seed(kSeed);
  const int64_t n = rows * H, ld = interleaved ? 2 * H : H;
  const std::vector<float> gate = random_bf16_values(n, 2.0f), up = random_bf16_values(n), dh = random_bf16_values(n);
  std::vector<float> h_ref(n), dgate_ref(n), dup_ref(n);
  spes::cpu::swiglu_forward(h_ref.data(), gate.data(), up.data(), n);
  spes::cpu::swiglu_backward(dgate_ref.data(), dup_ref.data(), dh.data(), gate.data(), up.data(), n);

  // Dense: gate in d_gu, up in d_up; interleaved: both in d_gu. Likewise the gradients.
  GlobalBuffer d_gu = device_buffer<bf16>(off + rows * ld), d_up = device_buffer<bf16>(off + n),
               d_dgu = device_buffer<bf16>(off + rows * ld), d_dup = device_buffer<bf16>(off + n),
               d_h = device_buffer<bf16>(n), d_h2 = device_buffer<bf16>(n), d_dh = device_buffer<bf16>(n);
  const std::vector<float> gu = pack(gate, up, rows, H, ld);
  for (int64_t i = 0; i < rows * ld; ++i) d_gu.as<bf16>()[off + i] = __float2bfloat16_rn(gu[i]);
  for (int64_t i = 0; i < n; ++i) d_up.as<bf16>()[off + i] = __float2bfloat16_rn(up[i]);
  upload_bf16(d_dh, dh);
  const bf16* g_ptr = d_gu.as<bf16>() + off;
  const bf16* u_ptr = interleaved ? g_ptr + H : d_up.as<bf16>() + off;
  bf16* dg_ptr = d_dgu.as<bf16>() + off;
  bf16* du_ptr = interleaved ? dg_ptr + H : d_dup.as<bf16>() + off;
  auto dense = [&](const GlobalBuffer& b, int64_t at) { return unpack(download_bf16(b, at + n), rows, H, H, at); };
  auto gradients = [&] {
    const std::vector<float> dgu = download_bf16(d_dgu, off + rows * ld);
    return std::pair{unpack(dgu, rows, H, ld, off),
                     interleaved ? unpack(dgu, rows, H, ld, off + H) : dense(d_dup, off)};
  };

  for (const GlobalBuffer* b : {&d_h, &d_h2, &d_dgu, &d_dup}) b->poison();
  auto forward = [&] { spes::cuda::swiglu_forward(d_h.as<bf16>(), g_ptr, u_ptr, rows, H, ld, nullptr); };
  auto backward = [&] {
    spes::cuda::swiglu_backward(dg_ptr, du_ptr, d_h2.as<bf16>(), d_dh.as<bf16>(), g_ptr, u_ptr, rows, H, ld, nullptr);
  };
  forward();
  backward();
  const std::vector<float> h = dense(d_h, 0);
  const auto [dgate, dup] = gradients();
  report.check("swiglu h", shape, h, h_ref, kTolBf16);
  report.check("swiglu dgate", shape, dgate, dgate_ref, kTolBf16);
  report.check("swiglu dup", shape, dup, dup_ref, kTolBf16);
  CHECK_MESSAGE(same_bits(dense(d_h2, 0), h), shape << ": the backward's recomputed h differs from the forward's");
  check_rerun_identical("swiglu fwd " + shape, {&d_h}, forward);
  check_rerun_identical("swiglu bwd " + shape, {&d_h2, &d_dgu, &d_dup}, backward);

  // h_out aliasing dh (how the GPU model calls it): h lands over dh, the gradients as before.
  d_dgu.poison();
  d_dup.poison();
  spes::cuda::swiglu_backward(dg_ptr, du_ptr, d_dh.as<bf16>(), d_dh.as<bf16>(), g_ptr, u_ptr, rows, H, ld, nullptr);
  CHECK_MESSAGE(same_bits(dense(d_dh, 0), h), shape << ": in place over dh, h differs");
  const auto [dgate2, dup2] = gradients();
  CHECK_MESSAGE((same_bits(dgate2, dgate) && same_bits(dup2, dup)), shape << ": in place over dh, dgate|dup differ");
}

}  // namespace

// The 16-byte path (H and ld multiples of 8, every pointer aligned: 8 values a
// thread) and the scalar one (H = 20; or gate|up one element off alignment). A
// 16-byte access off its alignment aborts the run (-fsanitize=alignment, as the GPU's
// misaligned-address fault).
TEST_CASE("emulated swiglu matches the CPU model") {
  const Case cases[] = {{37, 48, true, 0},  {37, 48, false, 0}, {101, 20, true, 0}, {64, 1024, true, 0},
                        {33, 64, false, 1}, {16, 64, true, 1},  {1, 8, true, 0},    {300, 2048, true, 0}};
  ErrorReport report;
  for (const Case& c : cases) check_swiglu(c, report);
}
