// The emulator's twin of cuda/ptx.cuh: same names and signatures, each forwarding to
// tests/emu/emu.hpp. The emulated kernels' build puts tests/emu/ first on the include
// path, so cuda/attention.cu, compiled unchanged, includes this file instead (and
// through it tests/emu/cuda/launch.cuh).
#pragma once
#include <cmath>
#include <cstdint>

#include "cuda/launch.cuh"
#include "tests/emu/emu.hpp"

namespace spes::cuda {

inline uint32_t smem_addr(const void* p) { return emu::shared_address(p); }

// src-size 0 when !pred: the destination is zero-filled (PTX cp.async: bytes past
// src-size up to cp-size are written as zeros).
inline void cp_async_16(uint32_t dst, const void* src, bool pred) { emu::cp_async(dst, src, 16, pred ? 16 : 0); }
inline void cp_async_8(uint32_t dst, const void* src, bool pred) { emu::cp_async(dst, src, 8, pred ? 8 : 0); }
inline void cp_async_4(uint32_t dst, const void* src, bool pred) { emu::cp_async(dst, src, 4, pred ? 4 : 0); }
inline void cp_async_commit() { emu::cp_async_commit(); }
template <int N>
void cp_async_wait() {
  emu::cp_async_wait(N);
}

inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { emu::ldmatrix_x4(r, addr, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) { emu::ldmatrix_x4(r, addr, true); }

inline void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emu::mma_m16n8k16_bf16(c, a, b0, b1);
}

// ex2.approx.ftz approximates 2^x to a few ulp and flushes subnormals (PTX ISA);
// std::exp2 rounds correctly. Both give 0 for -inf, which the masked softmax needs.
inline float ex2(float x) { return std::exp2(x); }

}  // namespace spes::cuda
