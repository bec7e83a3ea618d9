// The SwiGLU element math on the device, h = silu(g)·u with silu(g) = g·σ(g), in one
// place for the swiglu kernels (cuda/swiglu.cu) and the grouped GEMM stores that
// compute SwiGLU on the way out, the gate|up forward's and the down backward-input's
// (cuda/grouped_gemm.cu, cuda/grouped_gemm_sm90.cu): those fused products must give
// the bits of the GEMM followed by the swiglu kernel. Inlined into different kernels,
// an expression could be contracted into an FMA in one and not in the other; so the
// product in the backward that feeds an add is rounded as written (__fmul_rn). The
// sigmoid's 1 + expf(−g) may still take expf's last product into an FMA; it is the
// same expression, in the same order, wherever it is inlined, as the tests' bitwise
// comparisons of fused and unfused products check.
#pragma once
#include <cuda_runtime.h>

#include "cuda/device_common.cuh"

namespace spes::cuda {

__device__ __forceinline__ float swiglu_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

__device__ __forceinline__ float swiglu_value(float g, float u) { return g * swiglu_sigmoid(g) * u; }

// The backward of h = silu(g)·u for dLoss/dh = dh: dLoss/dg, dLoss/du, and h itself
// (recomputed, so that the forward need not keep it until the backward).
struct SwigluGrad {
  float dgate, dup, h;
};
__device__ __forceinline__ SwigluGrad swiglu_grad(float dh, float g, float u) {
  const float sig = swiglu_sigmoid(g);
  const float silu = g * sig;
  return {dh * u * sig * (1.0f + __fmul_rn(g, 1.0f - sig)), dh * silu, silu * u};
}

// swiglu_value on 8 consecutive columns, 16 bytes of bf16 each.
__device__ __forceinline__ int4 swiglu_value8(int4 gate, int4 up) {
  const Bf16x8 g = *reinterpret_cast<const Bf16x8*>(&gate), u = *reinterpret_cast<const Bf16x8*>(&up);
  Bf16x8 h;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    h.h[i] = __floats2bfloat162_rn(swiglu_value(__low2float(g.h[i]), __low2float(u.h[i])),
                                   swiglu_value(__high2float(g.h[i]), __high2float(u.h[i])));
  return *reinterpret_cast<const int4*>(&h);
}

// swiglu_grad on 8 consecutive columns, 16 bytes of bf16 each way (dh as stored).
struct SwigluGrad8 {
  int4 dgate, dup, h;
};
__device__ __forceinline__ SwigluGrad8 swiglu_grad8(int4 dh, int4 gate, int4 up) {
  const Bf16x8 d = *reinterpret_cast<const Bf16x8*>(&dh), g = *reinterpret_cast<const Bf16x8*>(&gate),
               u = *reinterpret_cast<const Bf16x8*>(&up);
  Bf16x8 dg, du, h;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const SwigluGrad lo = swiglu_grad(__low2float(d.h[i]), __low2float(g.h[i]), __low2float(u.h[i]));
    const SwigluGrad hi = swiglu_grad(__high2float(d.h[i]), __high2float(g.h[i]), __high2float(u.h[i]));
    dg.h[i] = __floats2bfloat162_rn(lo.dgate, hi.dgate);
    du.h[i] = __floats2bfloat162_rn(lo.dup, hi.dup);
    h.h[i] = __floats2bfloat162_rn(lo.h, hi.h);
  }
  return {*reinterpret_cast<const int4*>(&dg), *reinterpret_cast<const int4*>(&du), *reinterpret_cast<const int4*>(&h)};
}

}  // namespace spes::cuda
