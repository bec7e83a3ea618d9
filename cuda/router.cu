// Router kernels. One warp per token: lane l holds logits l, l+32, … in registers
// (E ≤ 256 → ≤ 8 per lane), so softmax, top-k and the backward's Σ_e p·dp are warp
// shuffles with no shared memory. Router work is O(N·E) — tiny next to the expert
// GEMMs — so the kernels aim at "one pass over memory", not at peak bandwidth.
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "cuda/check.cuh"
#include "cuda/device_common.cuh"
#include "cuda/launch.cuh"
#include "cuda/router.cuh"

namespace spes::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * 32;
// Tokens one warp handles in router_forward; fixes the shape of the LB partial sums
// (and so their summation order) as a function of N alone, not of the device.
constexpr int64_t kTokensPerWarp = 8;

__host__ __device__ inline int64_t n_partial_warps(int64_t N) { return (N + kTokensPerWarp - 1) / kTokensPerWarp; }

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_out(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

// partials layout: [E+1][W] (column e = Σ p_{t,e} per warp, column E = Σ lse²), then
// colsum[E+1] (the reduced columns).
template <int EPL, typename T>
__global__ void router_forward_kernel(float* probs, float* __restrict__ lse, int32_t* __restrict__ topk_idx,
                                      float* __restrict__ topk_w, float* __restrict__ partials,
                                      const T* logits, int64_t N, int E, int K, bool renorm) {
  const int lane = threadIdx.x & 31;
  const int64_t W = n_partial_warps(N);
  const int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;  // uniform per warp
  if (w >= W) return;

  float acc[EPL];
#pragma unroll
  for (int j = 0; j < EPL; ++j) acc[j] = 0.0f;
  float lse2 = 0.0f;

  const int64_t t_end = (w + 1) * kTokensPerWarp < N ? (w + 1) * kTokensPerWarp : N;
  for (int64_t t = w * kTokensPerWarp; t < t_end; ++t) {
    // Whole row into registers first: probs may alias logits.
    float p[EPL];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      const int e = lane + 32 * j;
      p[j] = e < E ? to_float(logits[t * E + e]) : -INFINITY;
      m = fmaxf(m, p[j]);
    }
    m = warp_max(m);
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      const int e = lane + 32 * j;
      p[j] = e < E ? expf(p[j] - m) : 0.0f;
      s += p[j];
    }
    s = warp_sum(s);
    const float inv = 1.0f / s;  // as the CPU: p = exp(z − max) · (1/Σ)
    const float lse_t = m + logf(s);
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      const int e = lane + 32 * j;
      p[j] *= inv;
      if (e < E) {
        probs[t * E + e] = p[j];
        acc[j] += p[j];
      }
    }
    lse2 += lse_t * lse_t;
    if (lane == 0) lse[t] = lse_t;

    // Top-k by K rounds of warp argmax under the total order (p desc, index asc), so
    // every lane ends each round with the same winner and ties go to the lower index
    // (the CPU's strict '>' scan). A NaN p competes as −1: it can still be chosen
    // (and propagates as NaN weight) but never leaves the winner undefined.
    uint32_t taken = 0;  // bit j: expert lane + 32j already chosen
    float wsum = 0.0f;
    int32_t my_idx = 0;
    float my_p = 0.0f;
    for (int k = 0; k < K; ++k) {
      float bv = -INFINITY;
      int bi = INT_MAX;
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        const int e = lane + 32 * j;
        const float v = p[j] == p[j] ? p[j] : -1.0f;
        if (e < E && !((taken >> j) & 1u) && v > bv) {  // j ascending: first among equals wins
          bv = v;
          bi = e;
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (ov > bv || (ov == bv && oi < bi)) {
          bv = ov;
          bi = oi;
        }
      }
      // K ≤ E, so an unchosen valid expert (v ≥ −1 > −inf) always exists: bi < E.
      if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
      const float pv = bv < 0.0f ? __int_as_float(0x7fc00000) : bv;  // the NaN it stood for
      if (lane == k) {
        my_idx = bi;
        my_p = pv;
      }
      wsum += pv;  // in k order, as the CPU
    }
    if (lane < K) {
      topk_idx[t * K + lane] = my_idx;
      topk_w[t * K + lane] = renorm ? my_p / wsum : my_p;
    }
  }

#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int e = lane + 32 * j;
    if (e < E) partials[e * W + w] = acc[j];
  }
  if (lane == 0) partials[int64_t(E) * W + w] = lse2;
}

// Stage 2 of the deterministic column sums: block c reduces column c of the
// partials with a fixed per-thread stride and a fixed tree.
__global__ void router_colsum_kernel(float* partials, int64_t W, int E) {
  __shared__ float warp_part[kWarpsPerBlock];
  const int c = blockIdx.x;  // 0..E
  const float* col = partials + int64_t(c) * W;
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < W; i += blockDim.x) s += col[i];
  s = warp_sum(s);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_part[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int i = 0; i < kWarpsPerBlock; ++i) total += warp_part[i];
    partials[int64_t(E + 1) * W + c] = total;
  }
}

__global__ void router_aux_kernel(float* __restrict__ aux, float* __restrict__ lb_weight,
                                  const float* __restrict__ colsum, const int32_t* __restrict__ offsets,
                                  const float* __restrict__ count_scale, int64_t N, int E, float coef) {
  const int lane = threadIdx.x;  // one warp
  float lb = 0.0f;
  for (int e = lane; e < E; e += 32) {
    const float count = float(offsets[e + 1] - offsets[e]);
    const float s = count_scale != nullptr ? count_scale[e] : 1.0f;
    const float wgt = s * count * coef;
    lb_weight[e] = wgt;
    lb += wgt * colsum[e];
  }
  lb = warp_sum(lb);
  if (lane == 0) {
    aux[0] = lb;
    aux[1] = colsum[E] / float(N);
  }
}

template <int EPL, typename TOut>
__global__ void router_backward_kernel(TOut* __restrict__ dlogits, const float* __restrict__ dtopk_w,
                                       const float* __restrict__ probs, const float* __restrict__ lse,
                                       const int32_t* __restrict__ topk_idx,
                                       const float* __restrict__ topk_w,
                                       const float* __restrict__ lb_dprob, float lb_scale,
                                       float rz_scale, int64_t N, int E, int K, bool renorm) {
  const int lane = threadIdx.x & 31;
  const int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  if (t >= N) return;

  float p[EPL], dp[EPL];
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int e = lane + 32 * j;
    p[j] = e < E ? probs[t * E + e] : 0.0f;
    dp[j] = (e < E && lb_dprob != nullptr) ? lb_scale * lb_dprob[e] : 0.0f;
  }
  const int32_t* idx = topk_idx + t * K;
  const float* dw = dtopk_w + t * K;
  const float* w = topk_w + t * K;
  // Every lane walks the K choices (broadcast loads) and adds the ones it holds.
  float s = 1.0f, dw_dot_w = 0.0f;
  if (renorm) {
    s = 0.0f;
    for (int k = 0; k < K; ++k) {
      s += probs[t * E + idx[k]];
      dw_dot_w += dw[k] * w[k];
    }
  }
  for (int k = 0; k < K; ++k) {
    const int e = idx[k];
    const float c = renorm ? (dw[k] - dw_dot_w) / s : dw[k];
#pragma unroll
    for (int j = 0; j < EPL; ++j)
      if (e == lane + 32 * j) dp[j] += c;
  }
  float p_dot_dp = 0.0f;
#pragma unroll
  for (int j = 0; j < EPL; ++j) p_dot_dp += p[j] * dp[j];  // p = 0 beyond E
  p_dot_dp = warp_sum(p_dot_dp);
  const float z_term = rz_scale * 2.0f * lse[t];
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int e = lane + 32 * j;
    if (e < E) store_out(&dlogits[t * E + e], p[j] * (dp[j] - p_dot_dp) + z_term * p[j]);
  }
}

void check_shape(int64_t N, int64_t E, int64_t K, const char* who) {
  if (N < 0 || E < 1 || E > kRouterMaxExperts || K < 1 || K > E || K > kRouterMaxTopK)
    throw Error(std::string(who) + ": unsupported shape N=" + std::to_string(N) + " E=" +
                std::to_string(E) + " K=" + std::to_string(K) + " (need 1 ≤ K ≤ min(E, " +
                std::to_string(kRouterMaxTopK) + "), E ≤ " + std::to_string(kRouterMaxExperts) + ")");
}

template <typename T>
void launch_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_w, float* partials,
                           const T* logits, int64_t N, int64_t E, int64_t K, bool renorm,
                           cudaStream_t stream) {
  check_shape(N, E, K, "router_forward");
  if (N == 0) return;
  const int64_t W = n_partial_warps(N);
  const int blocks = static_cast<int>((W + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const int e = static_cast<int>(E), k = static_cast<int>(K);
  if (E <= 32)
    launch(router_forward_kernel<1, T>, blocks, kThreads, 0, stream, probs, lse, topk_idx, topk_w, partials, logits, N, e, k, renorm);
  else if (E <= 64)
    launch(router_forward_kernel<2, T>, blocks, kThreads, 0, stream, probs, lse, topk_idx, topk_w, partials, logits, N, e, k, renorm);
  else if (E <= 128)
    launch(router_forward_kernel<4, T>, blocks, kThreads, 0, stream, probs, lse, topk_idx, topk_w, partials, logits, N, e, k, renorm);
  else
    launch(router_forward_kernel<8, T>, blocks, kThreads, 0, stream, probs, lse, topk_idx, topk_w, partials, logits, N, e, k, renorm);
  cuda_check_launch();
}

template <typename TOut>
void launch_router_backward(TOut* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                            const int32_t* topk_idx, const float* topk_w, const float* lb_dprob,
                            float lb_scale, float rz_scale, int64_t N, int64_t E, int64_t K,
                            bool renorm, cudaStream_t stream) {
  check_shape(N, E, K, "router_backward");
  if (N == 0) return;
  const int blocks = static_cast<int>((N + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const int e = static_cast<int>(E), k = static_cast<int>(K);
#define SPES_ROUTER_BWD(EPL)                                                                              \
  launch(router_backward_kernel<EPL, TOut>, blocks, kThreads, 0, stream, dlogits, dtopk_w, probs, lse, topk_idx, \
         topk_w, lb_dprob, lb_scale, rz_scale, N, e, k, renorm)
  if (E <= 32) SPES_ROUTER_BWD(1);
  else if (E <= 64) SPES_ROUTER_BWD(2);
  else if (E <= 128) SPES_ROUTER_BWD(4);
  else SPES_ROUTER_BWD(8);
#undef SPES_ROUTER_BWD
  cuda_check_launch();
}

}  // namespace

int64_t router_partials_count(int64_t N, int64_t E) { return (E + 1) * n_partial_warps(N) + (E + 1); }

void router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_w, float* partials,
                    const float* logits, int64_t N, int64_t E, int64_t K, bool renorm,
                    cudaStream_t stream) {
  launch_router_forward(probs, lse, topk_idx, topk_w, partials, logits, N, E, K, renorm, stream);
}
void router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_w, float* partials,
                    const bf16* logits, int64_t N, int64_t E, int64_t K, bool renorm,
                    cudaStream_t stream) {
  launch_router_forward(probs, lse, topk_idx, topk_w, partials, logits, N, E, K, renorm, stream);
}

void router_aux_forward(float* aux, float* lb_weight, float* partials, const int32_t* offsets,
                        const float* count_scale, int64_t N, int64_t E, int64_t K,
                        cudaStream_t stream) {
  check_shape(N, E, K, "router_aux_forward");
  if (N == 0) return;
  const int64_t W = n_partial_warps(N);
  launch(router_colsum_kernel, static_cast<int>(E + 1), kThreads, 0, stream, partials, W, static_cast<int>(E));
  cuda_check_launch();
  const double coef = double(E) / (double(K) * double(N) * double(N));
  launch(router_aux_kernel, 1, 32, 0, stream, aux, lb_weight, partials + (E + 1) * W, offsets, count_scale, N,
         static_cast<int>(E), static_cast<float>(coef));
  cuda_check_launch();
}

void router_backward(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                     const int32_t* topk_idx, const float* topk_w, const float* lb_dprob,
                     float lb_scale, float rz_scale, int64_t N, int64_t E, int64_t K, bool renorm,
                     cudaStream_t stream) {
  launch_router_backward(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, lb_dprob, lb_scale, rz_scale,
                         N, E, K, renorm, stream);
}
void router_backward(bf16* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                     const int32_t* topk_idx, const float* topk_w, const float* lb_dprob,
                     float lb_scale, float rz_scale, int64_t N, int64_t E, int64_t K, bool renorm,
                     cudaStream_t stream) {
  launch_router_backward(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, lb_dprob, lb_scale, rz_scale,
                         N, E, K, renorm, stream);
}

}  // namespace spes::cuda
