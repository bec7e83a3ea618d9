// The emulator's wgmma (emu.hpp, the shadow cuda/ptx_sm90.cuh) refuses what no GPU
// runs: one wgmma is one instruction for the whole warpgroup, so every thread of it
// must give the same matrix descriptors, N, transposes, scale-d and source of A (PTX
// ISA, wgmma.mma_async: .aligned, and "the contents of a matrix descriptor must be
// same across all the warps in the warpgroup"). The emulator computes each thread's
// fragment from that thread's own operands, so without this check a kernel whose
// descriptor depended on the warp would pass here and read garbage on a GPU. Each
// case runs one CTA of two warpgroups in a child process; the operands' values do
// not matter (shared memory holds the emulator's poison).
#include "tests/emu/builtins.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/ptx_sm90.cuh"
#include "tests/emu/emu.hpp"
#include "tests/emu/emu_test.hpp"

namespace {

using spes::test::has;
using spes::test::run_in_child;

enum Variant : int {
  uniform,             // every thread alike: runs
  per_warpgroup,       // the second warpgroup's B elsewhere: legal, each is its own wgmma
  warp_b_descriptor,   // warp 1's B descriptor 1 KB further on
  warp_scale_d,        // warp 1 accumulates, the others overwrite
  warp_rs_descriptor,  // A from registers, warp 3's B descriptor elsewhere
  lane_transpose,      // lane 5 of warp 0 alone reads B N-major: an rs wgmma, so trans-b differs
};

constexpr unsigned kThreads = 256;
constexpr size_t kSmem = 20 * 1024;  // A (64 × 64 bf16, 8 KB) and B (8 KB) after a 1024-aligned base

void wgmma_kernel(int variant) {
  using namespace spes::cuda;
  unsigned char* smem = dynamic_smem<unsigned char>;
  const uint32_t base = (smem_addr(smem) + 1023) & ~1023u;
  const unsigned warp = threadIdx.x / 32, warpgroup = threadIdx.x / 128;
  uint32_t b_offset = 8192;
  if (variant == per_warpgroup && warpgroup == 1) b_offset += 1024;
  if (variant == warp_b_descriptor && warp == 1) b_offset += 1024;
  if (variant == warp_rs_descriptor && warp == 3) b_offset += 1024;
  const uint64_t a = sw128_descriptor(base, 16, 1024), b = sw128_descriptor(base + b_offset, 16, 1024);
  float d[32] = {};
  wgmma_fence();
  if (variant == warp_rs_descriptor || variant == lane_transpose) {
    const uint32_t frag[4] = {0, 0, 0, 0};
    if (variant == lane_transpose && threadIdx.x == 5)
      wgmma_rs<64, 1>(d, frag, b, 0);
    else
      wgmma_rs<64, 0>(d, frag, b, 0);
  } else {
    wgmma_ss<64, 0, 0>(d, a, b, variant == warp_scale_d && warp == 1 ? 1 : 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
}

std::string run(Variant v) {
  return run_in_child([v] { spes::cuda::launch(wgmma_kernel, dim3(1), dim3(kThreads), kSmem, nullptr, int(v)); });
}

}  // namespace

TEST_CASE("emulated wgmma: the threads of a warpgroup must issue the same wgmma") {
  const std::string refused = "issued its wgmma with other operands";
  std::string msg = run(uniform);
  CHECK_MESSAGE(msg == "[returned]", msg);
  msg = run(per_warpgroup);
  CHECK_MESSAGE(msg == "[returned]", msg);
  for (Variant v : {warp_b_descriptor, warp_scale_d, warp_rs_descriptor, lane_transpose}) {
    INFO("variant " << int(v));
    msg = run(v);
    CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, refused)), msg);
  }
}
