// Dispatch, gather and combine kernels (contract: moe.cuh).
#include "cuda/moe.cuh"

#include <algorithm>
#include <string>

#include "cuda/check.cuh"
#include "cuda/device_common.cuh"
#include "cuda/launch.cuh"

namespace spes::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * 32;
// Dispatch: a block ranks kDispatchChunk consecutive (token, k) entries in
// kDispatchChunk / kThreads rounds of one entry per thread.
constexpr int64_t kDispatchChunk = 1024;
constexpr int kDispatchRounds = static_cast<int>(kDispatchChunk / kThreads);
constexpr int64_t kDispatchMaxExperts = 1024;

int64_t n_chunks(int64_t NK) { return (NK + kDispatchChunk - 1) / kDispatchChunk; }

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

int blocks_for_warps(int64_t warps) {
  return static_cast<int>(std::max<int64_t>(1, (warps + kWarpsPerBlock - 1) / kWarpsPerBlock));
}

// ---- dispatch ----------------------------------------------------------------------
// Stage 1: counts[e][chunk] (expert-major so stage 2 scans contiguous rows). Integer
// shared-memory atomics: the count is exact whatever their order.
__global__ void dispatch_count_kernel(int32_t* __restrict__ counts, const int32_t* __restrict__ topk_idx,
                                      int64_t NK, int E, int64_t nc) {
  int32_t* cnt = dynamic_smem<int32_t>;
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  const int64_t base = blockIdx.x * kDispatchChunk;
  for (int r = 0; r < kDispatchRounds; ++r) {
    const int64_t i = base + r * kThreads + threadIdx.x;
    if (i < NK) {
      const int e = topk_idx[i];
      if (static_cast<unsigned>(e) < static_cast<unsigned>(E)) atomicAdd(&cnt[e], 1);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e * nc + blockIdx.x] = cnt[e];
}

// Stage 2 (one block): per expert, exclusive scan over chunks in place (counts become
// the chunk's first rank within the expert), then the exclusive scan over experts
// gives offsets[E+1].
__global__ void dispatch_scan_kernel(int32_t* __restrict__ offsets, int32_t* __restrict__ counts, int E,
                                     int64_t nc) {
  int32_t* total = dynamic_smem<int32_t>;  // [E]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  for (int e = warp; e < E; e += n_warps) {
    int32_t* row = counts + e * nc;
    int32_t run = 0;
    for (int64_t b0 = 0; b0 < nc; b0 += 32) {
      const int64_t b = b0 + lane;
      const int32_t v = b < nc ? row[b] : 0;
      int32_t x = v;  // inclusive warp scan
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int32_t y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
      }
      if (b < nc) row[b] = run + x - v;
      run += __shfl_sync(0xffffffffu, x, 31);
    }
    if (lane == 0) total[e] = run;
  }
  __syncthreads();
  if (warp == 0) {
    // Lane l scans experts [lo, hi); a warp scan of the segment sums links them.
    const int per = (E + 31) / 32;
    const int lo = min(E, lane * per), hi = min(E, lo + per);
    int32_t seg = 0;
    for (int e = lo; e < hi; ++e) seg += total[e];
    int32_t x = seg;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int32_t y = __shfl_up_sync(0xffffffffu, x, off);
      if (lane >= off) x += y;
    }
    int32_t run = x - seg;
    for (int e = lo; e < hi; ++e) {
      offsets[e] = run;
      run += total[e];
    }
    if (lane == 31) offsets[E] = x;  // Σ of all segments = N·K
  }
}

// Stage 3: rank every entry within its expert in (token, k) order. Per round, each
// warp ranks its 32 consecutive entries with __match_any_sync, per-warp counts go to
// shared memory, and an entry's slot is
//   offsets[e] + (earlier chunks) + (earlier rounds) + (earlier warps) + (earlier lanes).
__global__ void dispatch_scatter_kernel(int32_t* __restrict__ slot_token, int32_t* __restrict__ token_slot,
                                        const int32_t* __restrict__ topk_idx,
                                        const int32_t* __restrict__ offsets,
                                        const int32_t* __restrict__ chunk_rank, int64_t NK, int E,
                                        int K, int64_t nc) {
  int32_t* sh = dynamic_smem<int32_t>;
  int32_t* running = sh;          // [E]
  int32_t* warp_cnt = sh + E;     // [kWarpsPerBlock][E]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    running[e] = offsets[e] + chunk_rank[e * nc + blockIdx.x];
    for (int w = 0; w < kWarpsPerBlock; ++w) warp_cnt[w * E + e] = 0;
  }
  __syncthreads();
  const unsigned lanes_below = (1u << lane) - 1u;
  const int64_t base = blockIdx.x * kDispatchChunk;
  for (int r = 0; r < kDispatchRounds; ++r) {
    const int64_t i = base + r * kThreads + threadIdx.x;
    int e = i < NK ? topk_idx[i] : -1;
    if (static_cast<unsigned>(e) >= static_cast<unsigned>(E)) e = -1;
    const unsigned same = __match_any_sync(0xffffffffu, e);  // every lane takes part
    const int rank = __popc(same & lanes_below);
    if (e >= 0 && rank == 0) warp_cnt[warp * E + e] = __popc(same);
    __syncthreads();
    if (e >= 0) {
      int32_t pos = running[e] + rank;
      for (int w = 0; w < warp; ++w) pos += warp_cnt[w * E + e];
      slot_token[pos] = static_cast<int32_t>(i / K);
      token_slot[i] = pos;
    }
    __syncthreads();
    for (int x = threadIdx.x; x < E; x += blockDim.x) {
      int32_t sum = 0;
      for (int w = 0; w < kWarpsPerBlock; ++w) {
        sum += warp_cnt[w * E + x];
        warp_cnt[w * E + x] = 0;
      }
      running[x] += sum;
    }
    __syncthreads();
  }
}

// ---- gather / combine: one warp per row, lanes stride the row VEC elements at a time --
template <int VEC>
__global__ void gather_forward_kernel(bf16* __restrict__ xe, const bf16* __restrict__ x,
                                      const int32_t* __restrict__ slot_token, int64_t S, int64_t C) {
  const int lane = threadIdx.x & 31;
  const int64_t s = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  if (s >= S) return;
  const bf16* src = x + int64_t(slot_token[s]) * C;
  bf16* dst = xe + s * C;
  for (int64_t c = lane * VEC; c < C; c += 32 * VEC) {
    if constexpr (VEC == 8) {
      *reinterpret_cast<uint4*>(dst + c) = *reinterpret_cast<const uint4*>(src + c);
    } else {
      dst[c] = src[c];
    }
  }
}

template <int VEC>
__global__ void gather_backward_kernel(bf16* __restrict__ dx, const bf16* __restrict__ dxe,
                                       const int32_t* __restrict__ token_slot, int64_t N, int K,
                                       int64_t C) {
  const int lane = threadIdx.x & 31;
  const int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  if (t >= N) return;
  for (int64_t c = lane * VEC; c < C; c += 32 * VEC) {
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
    for (int k = 0; k < K; ++k) {
      float v[VEC];
      load_vec<VEC>(v, dxe + int64_t(token_slot[t * K + k]) * C + c);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += v[j];
    }
    store_vec<VEC>(dx + t * C + c, acc);
  }
}

template <int VEC>
__global__ void combine_forward_kernel(bf16* __restrict__ out, const bf16* __restrict__ ye,
                                       const float* __restrict__ topk_w,
                                       const int32_t* __restrict__ token_slot, int64_t N, int K,
                                       int64_t C) {
  const int lane = threadIdx.x & 31;
  const int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  if (t >= N) return;
  for (int64_t c = lane * VEC; c < C; c += 32 * VEC) {
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
    for (int k = 0; k < K; ++k) {
      const float w = topk_w[t * K + k];
      float v[VEC];
      load_vec<VEC>(v, ye + int64_t(token_slot[t * K + k]) * C + c);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += w * v[j];
    }
    store_vec<VEC>(out + t * C + c, acc);
  }
}

template <int VEC>
__global__ void combine_backward_kernel(bf16* __restrict__ dye, float* __restrict__ dtopk_w,
                                        const bf16* __restrict__ dout, const bf16* __restrict__ ye,
                                        const float* __restrict__ topk_w,
                                        const int32_t* __restrict__ token_slot, int64_t N, int K,
                                        int64_t C) {
  const int lane = threadIdx.x & 31;
  const int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  if (t >= N) return;
  const bf16* g = dout + t * C;
  for (int k = 0; k < K; ++k) {
    const int64_t s = token_slot[t * K + k];
    const float w = topk_w[t * K + k];
    float dot = 0.0f;
    for (int64_t c = lane * VEC; c < C; c += 32 * VEC) {
      float gv[VEC], yv[VEC], dv[VEC];
      load_vec<VEC>(gv, g + c);
      load_vec<VEC>(yv, ye + s * C + c);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        dot += gv[j] * yv[j];
        dv[j] = w * gv[j];
      }
      store_vec<VEC>(dye + s * C + c, dv);
    }
    dot = warp_sum(dot);  // outside the c loop: every lane of the warp is here
    if (lane == 0) dtopk_w[t * K + k] = dot;
  }
}

void check_dispatch_shape(int64_t N, int64_t E, int64_t K) {
  if (N < 0 || E < 1 || E > kDispatchMaxExperts || K < 1 || K > E || N * K > INT32_MAX)
    throw Error("moe_dispatch_indices: unsupported shape N=" + std::to_string(N) + " E=" +
                std::to_string(E) + " K=" + std::to_string(K));
}

}  // namespace

// ---- dispatch / combine launchers ------------------------------------------------------

int64_t moe_dispatch_scratch_count(int64_t N, int64_t E, int64_t K) { return E * n_chunks(N * K); }

void moe_dispatch_indices(int32_t* offsets, int32_t* slot_token, int32_t* token_slot, int32_t* scratch,
                          const int32_t* topk_idx, int64_t N, int64_t E, int64_t K,
                          cudaStream_t stream) {
  const char* op = "moe_dispatch_indices";
  check_dispatch_shape(N, E, K);
  require_ptr(offsets, 4, op, "offsets");
  if (N > 0) {
    require_ptr(slot_token, 4, op, "slot_token");
    require_ptr(token_slot, 4, op, "token_slot");
    require_ptr(scratch, 4, op, "scratch");
    require_ptr(topk_idx, 4, op, "topk_idx");
  }
  const int64_t NK = N * K, nc = n_chunks(NK);
  const int e = static_cast<int>(E);
  if (nc == 0) {  // no tokens: every offset is 0
    cuda_check(cudaMemsetAsync(offsets, 0, sizeof(int32_t) * (E + 1), stream));
    return;
  }
  launch(dispatch_count_kernel, static_cast<int>(nc), kThreads, sizeof(int32_t) * E, stream, scratch, topk_idx, NK,
         e, nc);
  cuda_check_launch();
  launch(dispatch_scan_kernel, 1, 1024, sizeof(int32_t) * E, stream, offsets, scratch, e, nc);
  cuda_check_launch();
  launch(dispatch_scatter_kernel, static_cast<int>(nc), kThreads, sizeof(int32_t) * E * (1 + kWarpsPerBlock), stream,
         slot_token, token_slot, topk_idx, offsets, scratch, NK, e, static_cast<int>(K), nc);
  cuda_check_launch();
}

void moe_gather_forward(bf16* xe, const bf16* x, const int32_t* slot_token, int64_t S, int64_t C,
                        cudaStream_t stream) {
  const char* op = "moe_gather_forward";
  if (S <= 0 || C <= 0) return;
  // Rows move as 16-byte vectors when C and both pointers allow, else element-wise.
  require_ptr(xe, 2, op, "xe");
  require_ptr(x, 2, op, "x");
  require_ptr(slot_token, 4, op, "slot_token");
  if (C % 8 == 0 && aligned16(xe) && aligned16(x))
    launch(gather_forward_kernel<8>, blocks_for_warps(S), kThreads, 0, stream, xe, x, slot_token, S, C);
  else
    launch(gather_forward_kernel<1>, blocks_for_warps(S), kThreads, 0, stream, xe, x, slot_token, S, C);
  cuda_check_launch();
}

void moe_gather_backward(bf16* dx, const bf16* dxe, const int32_t* token_slot, int64_t N, int64_t K,
                         int64_t C, cudaStream_t stream) {
  const char* op = "moe_gather_backward";
  if (N <= 0 || C <= 0) return;
  require(K >= 1 && K <= INT32_MAX, op, "K must be ≥ 1");
  require_ptr(dx, 2, op, "dx");
  require_ptr(dxe, 2, op, "dxe");
  require_ptr(token_slot, 4, op, "token_slot");
  const int k = static_cast<int>(K);
  if (C % 8 == 0 && aligned16(dx) && aligned16(dxe))
    launch(gather_backward_kernel<8>, blocks_for_warps(N), kThreads, 0, stream, dx, dxe, token_slot, N, k, C);
  else
    launch(gather_backward_kernel<1>, blocks_for_warps(N), kThreads, 0, stream, dx, dxe, token_slot, N, k, C);
  cuda_check_launch();
}

void moe_combine_forward(bf16* out, const bf16* ye, const float* topk_w, const int32_t* token_slot,
                         int64_t N, int64_t K, int64_t C, cudaStream_t stream) {
  const char* op = "moe_combine_forward";
  if (N <= 0 || C <= 0) return;
  require(K >= 1 && K <= INT32_MAX, op, "K must be ≥ 1");
  require_ptr(out, 2, op, "out");
  require_ptr(ye, 2, op, "ye");
  require_ptr(topk_w, 4, op, "topk_w");
  require_ptr(token_slot, 4, op, "token_slot");
  const int k = static_cast<int>(K);
  if (C % 8 == 0 && aligned16(out) && aligned16(ye))
    launch(combine_forward_kernel<8>, blocks_for_warps(N), kThreads, 0, stream, out, ye, topk_w, token_slot, N, k, C);
  else
    launch(combine_forward_kernel<1>, blocks_for_warps(N), kThreads, 0, stream, out, ye, topk_w, token_slot, N, k, C);
  cuda_check_launch();
}

void moe_combine_backward(bf16* dye, float* dtopk_w, const bf16* dout, const bf16* ye,
                          const float* topk_w, const int32_t* token_slot, int64_t N, int64_t K,
                          int64_t C, cudaStream_t stream) {
  const char* op = "moe_combine_backward";
  if (N <= 0 || C <= 0) return;
  require(K >= 1 && K <= INT32_MAX, op, "K must be ≥ 1");
  require_ptr(dye, 2, op, "dye");
  require_ptr(dtopk_w, 4, op, "dtopk_w");
  require_ptr(dout, 2, op, "dout");
  require_ptr(ye, 2, op, "ye");
  require_ptr(topk_w, 4, op, "topk_w");
  require_ptr(token_slot, 4, op, "token_slot");
  const int k = static_cast<int>(K);
  if (C % 8 == 0 && aligned16(dye) && aligned16(dout) && aligned16(ye))
    launch(combine_backward_kernel<8>, blocks_for_warps(N), kThreads, 0, stream, dye, dtopk_w, dout, ye, topk_w,
           token_slot, N, k, C);
  else
    launch(combine_backward_kernel<1>, blocks_for_warps(N), kThreads, 0, stream, dye, dtopk_w, dout, ye, topk_w,
           token_slot, N, k, C);
  cuda_check_launch();
}

}  // namespace spes::cuda
