// The emulator's twin of cuda/ptx_sm90.cuh: same names and signatures, the wgmma,
// mbarrier and bulk tensor copy ones forwarding to tests/emu/emu.hpp. The emulated H100 runs sm_90a code, so
// SPES_SM90A_DEVICE_CODE is 1 here and the Hopper kernels (cuda/grouped_gemm_sm90.cu,
// cuda/attention_sm90.cu) run on it, their launchers told so by
// SPES_SM90A_KERNELS (CMakeLists.txt, test_emu).
#pragma once
#include <cstdint>

#include "tests/emu/emu.hpp"

#define SPES_SM90A_DEVICE_CODE 1

namespace spes::cuda {

// The descriptor's bits as on the GPU (PTX ISA, "Matrix Descriptor Format"); the
// emulated wgmma decodes them (emu::wgmma_element_address).
inline uint64_t sw128_descriptor(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return uint64_t((smem_addr >> 4) & 0x3FFF) | (uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo_bytes >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}

// A prefetch moves nothing here (there is no L2), but its address must lie in a
// device buffer, as the copy it prepares must: a prefetch outside one is a predicate
// that lets the copy stray too.
inline void prefetch_l2(const void* p) { emu::require_device_buffer(p, 1, "prefetch.global.L2"); }
// The proxy fence and the wgmma fence are checked (emu.cpp): the bytes a thread wrote
// (cp.async, st_shared_zero16) must be fenced before a wgmma reads them.
inline void fence_proxy_async_shared() { emu::fence_proxy_async_shared(); }
inline void st_shared_zero16(uint32_t addr) { emu::st_shared_zero16(addr); }
inline void wgmma_fence() { emu::wgmma_fence(); }
// The compiler does not reorder across the emulator's calls: nothing to fence here.
template <int N>
void fence_accumulators(float (&)[N]) {}
template <int K>
void fence_registers(uint32_t (&)[K][4]) {}

inline void wgmma_commit() { emu::wgmma_commit(); }
template <int N>
void wgmma_wait() {
  emu::wgmma_wait(N);
}

template <int TRANS_A, int TRANS_B>
void wgmma_m64n256k16_bf16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  emu::wgmma_bf16(d, 256, desc_a, desc_b, accumulate != 0, TRANS_A != 0, TRANS_B != 0);
}

template <int N, int TRANS_A, int TRANS_B>
void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  static_assert(N == 64 || N == 128, "the attention backward's widths");
  emu::wgmma_bf16(d, N, desc_a, desc_b, accumulate != 0, TRANS_A != 0, TRANS_B != 0);
}

template <int N, int TRANS_B>
void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
  static_assert(N == 64 || N == 128, "the attention backward's widths");
  emu::wgmma_bf16_rs(d, N, a, desc_b, accumulate != 0, TRANS_B != 0);
}

// The L2's add: flushes subnormal inputs and results to zero, as on a GPU.
inline void red_add_f32x2(float* dst, float a, float b) { emu::red_add_f32x2(dst, a, b); }

// Registers are the host's: moving them between warpgroups changes nothing here.
template <int kRegisters>
void setmaxnreg_inc() {}
template <int kRegisters>
void setmaxnreg_dec() {}

inline void mbarrier_init(uint32_t bar, uint32_t count) { emu::mbarrier_init(bar, count); }
inline void fence_mbarrier_init() { emu::fence_mbarrier_init(); }
inline void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) { emu::mbarrier_arrive(bar, bytes); }
inline void mbarrier_arrive(uint32_t bar) { emu::mbarrier_arrive(bar, 0); }
inline bool mbarrier_try_wait_parity(uint32_t bar, uint32_t parity) {
  return emu::mbarrier_try_wait_parity(bar, parity);
}
inline void mbarrier_wait_parity(uint32_t bar, uint32_t parity) {
  while (!mbarrier_try_wait_parity(bar, parity)) {
  }
}
// The phase checked before every try (the barrier may run ahead while a thread waits).
inline void mbarrier_wait_phase(uint32_t bar, int64_t phase) {
  for (;;) {
    emu::mbarrier_check_phase(bar, phase);
    if (mbarrier_try_wait_parity(bar, uint32_t(phase) & 1)) return;
  }
}
inline void tma_load_2d(uint32_t dst, const CUtensorMap* map, int32_t c0, int32_t c1, uint32_t bar) {
  const int32_t coords[2] = {c0, c1};
  emu::tma_load(dst, map, coords, 2, bar);
}

}  // namespace spes::cuda
