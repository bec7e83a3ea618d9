// AdamW update kernel. One thread per 4 parameters (float4 loads/stores), 30 B of
// HBM traffic per parameter (read master, m, v, gradient; write master, m, v and the
// bf16 copy): bandwidth-bound. Host computes the bias corrections exactly as
// cpu::adamw_update.
#include <cmath>

#include "cuda/adamw.cuh"
#include "cuda/check.cuh"
#include "cuda/launch.cuh"

namespace spes::cuda {

namespace {

struct AdamWConsts {
  float beta1, beta2, eps, step_size, bc2_sqrt, decay;
};

__device__ __forceinline__ float adamw_one(float& p, float& mi, float& vi, float g, const AdamWConsts& c) {
  mi = c.beta1 * mi + (1.0f - c.beta1) * g;
  vi = c.beta2 * vi + (1.0f - c.beta2) * g * g;
  const float denom = sqrtf(vi) / c.bc2_sqrt + c.eps;
  p = p * c.decay - c.step_size * mi / denom;
  return p;
}

__global__ void adamw_kernel(float* __restrict__ master, bf16* __restrict__ weights, const float* __restrict__ grad,
                             float* __restrict__ m, float* __restrict__ v, int64_t n, AdamWConsts c,
                             const float* __restrict__ grad_scale, bool vec) {
  const int64_t base = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (base >= n) return;
  const float s = grad_scale ? *grad_scale : 1.0f;
  if (vec && base + 4 <= n) {
    float4 p = *reinterpret_cast<const float4*>(master + base);
    float4 g = __ldcs(reinterpret_cast<const float4*>(grad + base));
    float4 mi = *reinterpret_cast<const float4*>(m + base);
    float4 vi = *reinterpret_cast<const float4*>(v + base);
    adamw_one(p.x, mi.x, vi.x, g.x * s, c);
    adamw_one(p.y, mi.y, vi.y, g.y * s, c);
    adamw_one(p.z, mi.z, vi.z, g.z * s, c);
    adamw_one(p.w, mi.w, vi.w, g.w * s, c);
    *reinterpret_cast<float4*>(master + base) = p;
    *reinterpret_cast<float4*>(m + base) = mi;
    *reinterpret_cast<float4*>(v + base) = vi;
    if (weights) {
      __nv_bfloat162 w[2] = {__floats2bfloat162_rn(p.x, p.y), __floats2bfloat162_rn(p.z, p.w)};
      *reinterpret_cast<uint2*>(weights + base) = *reinterpret_cast<const uint2*>(w);
    }
    return;
  }
  const int64_t end = base + 4 < n ? base + 4 : n;
  for (int64_t i = base; i < end; ++i) {
    float p = master[i], mi = m[i], vi = v[i];
    adamw_one(p, mi, vi, grad[i] * s, c);
    master[i] = p;
    m[i] = mi;
    v[i] = vi;
    if (weights) weights[i] = __float2bfloat16_rn(p);
  }
}

}  // namespace

void adamw_update(float* master, bf16* weights, const float* grad, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t t, const float* grad_scale,
                  cudaStream_t stream) {
  const char* op = "adamw_update";
  require(t >= 1, op, "step t must be ≥ 1");
  require(n >= 0, op, "n must be ≥ 0");
  if (n == 0) return;
  // float4 path when all four fp32 arrays are 16-byte aligned, scalar otherwise.
  require_ptr(master, 4, op, "master");
  require_aligned(weights, 2, op, "weights");
  require_ptr(grad, 4, op, "grad");
  require_ptr(m, 4, op, "m");
  require_ptr(v, 4, op, "v");
  require_aligned(grad_scale, 4, op, "grad_scale");
  // Exactly the host arithmetic of cpu::adamw_update.
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t));
  AdamWConsts c;
  c.beta1 = beta1;
  c.beta2 = beta2;
  c.eps = eps;
  c.step_size = static_cast<float>(static_cast<double>(lr) / bc1);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.decay = 1.0f - lr * weight_decay;
  const bool vec = aligned(master, 16) && aligned(grad, 16) && aligned(m, 16) && aligned(v, 16) &&
                   (weights == nullptr || aligned(weights, 8));
  const int threads = 256;
  const int64_t blocks = ceil_div(ceil_div(n, 4), threads);
  launch(adamw_kernel, static_cast<unsigned>(blocks), threads, 0, stream, master, weights, grad, m, v, n, c,
         grad_scale, vec);
  cuda_check_launch();
}

}  // namespace spes::cuda
