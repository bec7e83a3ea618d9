// The emulator's wgmma (emu.hpp, the shadow cuda/ptx_sm90.cuh) refuses what a GPU
// would run wrong, where the emulator alone would compute the right answer:
// - one wgmma is one instruction for the whole warpgroup, so every thread of it must
//   give the same matrix descriptors, N, transposes, scale-d and source of A (PTX ISA,
//   wgmma.mma_async: .aligned, and "the contents of a matrix descriptor must be same
//   across all the warps in the warpgroup"); the emulator computes each thread's
//   fragment from that thread's own operands, so a descriptor that depended on the
//   warp would pass here and read garbage on a GPU;
// - wgmma.fence before a warpgroup's first wgmma and between register accesses and
//   the wgmma that use those registers (PTX ISA, wgmma.fence); the emulator asks for
//   one after every wait_group, a little stricter than the rule;
// - the tensor cores may read A's registers until the wgmma's group is waited for, so
//   a thread may not change them before (PTX ISA, wgmma.mma_async);
// - wgmma reads shared memory through the async proxy, cp.async writes it through
//   the generic one: the writing thread must run fence.proxy.async.shared::cta after
//   its copies land and before the barrier that hands them to the warpgroup (PTX
//   ISA, Memory Consistency Model, proxies), or the tensor cores may read stale bytes.
// Each case runs one CTA of two warpgroups in a child process; the operands' values
// do not matter (shared memory holds the emulator's poison, or zeros copied in).
#include "tests/emu/builtins.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

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
  no_fence,            // no wgmma.fence before the first wgmma
  no_fence_after_wait, // a second wgmma after the wait with no wgmma.fence between
  rs_uniform,          // A from registers, every thread alike: runs
  rs_a_changed,        // A from registers, rewritten before the wait for it
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
  if (variant != no_fence) wgmma_fence();
  uint32_t frag[4] = {0, 0, 0, 0};
  if (variant == warp_rs_descriptor || variant == lane_transpose || variant == rs_uniform ||
      variant == rs_a_changed) {
    if (variant == lane_transpose && threadIdx.x == 5)
      wgmma_rs<64, 1>(d, frag, b, 0);
    else
      wgmma_rs<64, 0>(d, frag, b, 0);
    if (variant == rs_a_changed) frag[2] = 0x3f803f80u;  // the next k-step's A, too early
  } else {
    wgmma_ss<64, 0, 0>(d, a, b, variant == warp_scale_d && warp == 1 ? 1 : 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  if (variant == no_fence_after_wait) {
    wgmma_ss<64, 0, 0>(d, a, b, 1);  // accumulates into d, which the wait handed back
    wgmma_commit();
    wgmma_wait<0>();
  }
}

// Every thread copies its share of A and B (16 KB) into shared memory by cp.async,
// waits for it, fences it to the async proxy if `fence`, and after a barrier each
// warpgroup multiplies them.
void copy_then_wgmma_kernel(const uint16_t* src, int fence) {
  using namespace spes::cuda;
  unsigned char* smem = dynamic_smem<unsigned char>;
  const uint32_t base = (smem_addr(smem) + 1023) & ~1023u;
  for (unsigned i = threadIdx.x; i < 1024; i += blockDim.x) cp_async_16(base + 16 * i, src + 8 * i, true);
  cp_async_commit();
  cp_async_wait<0>();
  if (fence) fence_proxy_async_shared();
  __syncthreads();
  float d[32] = {};
  wgmma_fence();
  wgmma_ss<64, 0, 0>(d, sw128_descriptor(base, 16, 1024), sw128_descriptor(base + 8192, 16, 1024), 0);
  wgmma_commit();
  wgmma_wait<0>();
}

std::string run(Variant v) {
  return run_in_child([v] { spes::cuda::launch(wgmma_kernel, dim3(1), dim3(kThreads), kSmem, nullptr, int(v)); });
}

}  // namespace

TEST_CASE("emulated wgmma: a wgmma.fence comes before the first wgmma and after each wait_group") {
  for (Variant v : {no_fence, no_fence_after_wait}) {
    INFO("variant " << int(v));
    const std::string msg = run(v);
    CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "with no wgmma.fence since its last wgmma.wait_group")), msg);
  }
}

TEST_CASE("emulated wgmma: A's registers stay unchanged until the wait_group for it") {
  const std::string msg = run(rs_a_changed);
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "changed register 2 of a wgmma's A fragment before the wait_group")),
                msg);
}

TEST_CASE("emulated wgmma: the threads of a warpgroup must issue the same wgmma") {
  const std::string refused = "issued its wgmma with other operands";
  std::string msg = run(uniform);
  CHECK_MESSAGE(msg == "[returned]", msg);
  msg = run(rs_uniform);
  CHECK_MESSAGE(msg == "[returned]", msg);
  msg = run(per_warpgroup);
  CHECK_MESSAGE(msg == "[returned]", msg);
  for (Variant v : {warp_b_descriptor, warp_scale_d, warp_rs_descriptor, lane_transpose}) {
    INFO("variant " << int(v));
    msg = run(v);
    CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, refused)), msg);
  }
}

TEST_CASE("emulated wgmma: cp.async bytes reach it only behind their writer's fence.proxy.async") {
  const emu::GlobalBuffer src = spes::test::device_buffer<uint16_t>(8 * 1024);
  spes::test::upload(src, std::vector<uint16_t>(8 * 1024, 0));
  for (emu::Landing landing : {emu::Landing::at_wait, emu::Landing::at_issue})
    for (int fence : {1, 0}) {
      INFO((landing == emu::Landing::at_wait ? "landing at wait_group" : "landing at issue") << ", fence " << fence);
      const std::string msg = run_in_child([&] {
        emu::set_landing(landing);
        spes::cuda::launch(copy_then_wgmma_kernel, dim3(1), dim3(kThreads), kSmem, nullptr, src.as<uint16_t>(),
                           fence);
      });
      if (fence)
        CHECK_MESSAGE(msg == "[returned]", msg);
      else
        CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "through the generic proxy (cp.async, st.shared) and has not fenced")),
                      msg);
    }
}
