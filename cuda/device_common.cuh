// Device-side building blocks shared by the hand-written kernels: 16-byte vector
// loads/stores (8 bf16 or 4 fp32 per access), and warp and row reductions in a fixed
// order (so results are deterministic). Kernel files only: it uses warp intrinsics,
// which a host compiler lacks.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/common.cuh"

namespace spes::cuda {

// ---- 16-byte vectors ------------------------------------------------------------
// 8 bf16 values moved as one 16-byte access (ld.global.v4.u32 / st.global.v4.u32).
struct alignas(16) Bf16x8 {
  __nv_bfloat162 h[4];
};

// Raw 16-byte vectors: kept packed in 4 registers until needed (half the register
// cost of 8 floats), unpacked with unpack8.
__device__ __forceinline__ int4 load16(const bf16* p) { return *reinterpret_cast<const int4*>(p); }
__device__ __forceinline__ int4 load16_stream(const bf16* p) { return __ldcs(reinterpret_cast<const int4*>(p)); }
__device__ __forceinline__ void unpack8(float (&f)[8], int4 raw) {
  const Bf16x8 v = *reinterpret_cast<const Bf16x8*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(v.h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ int4 pack8(const float (&f)[8]) {
  Bf16x8 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) v.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return *reinterpret_cast<const int4*>(&v);
}

__device__ __forceinline__ void load8(float (&f)[8], const bf16* p) {
  Bf16x8 v = *reinterpret_cast<const Bf16x8*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __bfloat1622float2(v.h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
// Streaming variant for data read exactly once (evict-first in L1/L2).
__device__ __forceinline__ void load8_stream(float (&f)[8], const bf16* p) {
  int4 raw = __ldcs(reinterpret_cast<const int4*>(p));
  Bf16x8 v = *reinterpret_cast<Bf16x8*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __bfloat1622float2(v.h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ void store8(bf16* p, const float (&f)[8]) {
  Bf16x8 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) v.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<Bf16x8*>(p) = v;
}
__device__ __forceinline__ void load8(float (&f)[8], const float* p) {
  float4 a = reinterpret_cast<const float4*>(p)[0];
  float4 b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ void store8(float* p, const float (&f)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}

// VEC consecutive bf16 <-> fp32: VEC = 8 is one 16-byte access (caller guarantees
// alignment); VEC = 1 is the fallback for odd sizes or unaligned views.
template <int VEC>
__device__ __forceinline__ void load_vec(float (&f)[VEC], const bf16* p) {
  if constexpr (VEC == 8) {
    load8(f, p);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) f[i] = __bfloat162float(p[i]);
  }
}

template <int VEC>
__device__ __forceinline__ void store_vec(bf16* p, const float (&f)[VEC]) {
  if constexpr (VEC == 8) {
    store8(p, f);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[i] = __float2bfloat16_rn(f[i]);
  }
}

// ---- reductions (fixed order: deterministic) --------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum of `v` over the `nwarps` warps of one row slice (threadIdx.x of a block whose
// blockDim.x is a multiple of 32; threadIdx.y selects the row). `scratch` holds
// blockDim.y × 32 floats. Every thread of the slice gets the same total, summed in
// warp order. Contains __syncthreads(): call from all threads of the block.
__device__ __forceinline__ float row_sum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, nwarps = blockDim.x / kWarp;
  v = warp_sum(v);
  float* s = scratch + threadIdx.y * kWarp;
  if (lane == 0) s[warp] = v;
  __syncthreads();
  float t = 0.0f;
  for (int w = 0; w < nwarps; ++w) t += s[w];
  __syncthreads();  // scratch may be reused right after
  return t;
}

}  // namespace spes::cuda
