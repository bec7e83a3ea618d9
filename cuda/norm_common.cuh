// Shared by the row-normalisation kernels (rmsnorm.cu, rope.cu): how a block covers
// rows of C channels, and the deterministic weight-gradient reduction.
//
// Layout: a block is tx × ty threads; the ty rows of threads (threadIdx.y) each own
// one row of the tensor, and the tx threads of a row each own VPT 16-byte vectors
// (8 channels each) at v = threadIdx.x + k·tx. tx is a multiple of 32, so warps never
// straddle rows and a row reduction is warp shuffles plus one smem exchange.
// A row is read once into registers and written once: one pass over memory.
//
// dweight: the backward kernels run a fixed grid of G blocks that stride over rows;
// each thread keeps its channels' Σ_rows partial in registers, the ty row-slices of
// a block are added in fixed order, and the block's partial goes to scratch[G][C].
// A second kernel adds the G partials per channel in fixed order into dweight.
// No float atomics: bit-identical results for the same device and shape.
#pragma once
#include <algorithm>
#include <string>

#include "cuda/check.cuh"
#include "cuda/device_common.cuh"
#include "cuda/launch.cuh"
#include "cuda/rmsnorm.cuh"

namespace spes::cuda::norm {

constexpr int kMaxVpt = 4;  // ≤ 4 vectors per thread of ≤ 256 a row: kNormMaxChannels
static_assert(8 * 256 * kMaxVpt == kNormMaxChannels);
constexpr int kMaxRowsPerBlock = 4;
// ≤ 512 threads per block leaves up to 128 registers per thread: the backward
// kernels hold three VPT×8 float arrays (gradient, x̂, dweight partial).
constexpr int kMaxThreads = 512;

struct RowLayout {
  int vpt = 1;  // vectors per thread: 1, 2 or 4
  int tx = 32;  // threads per row (multiple of 32)
  int ty = 1;   // rows per block
};

inline RowLayout row_layout(int64_t C, const char* op) {
  require(C > 0 && C % 8 == 0, op, "channels C = " + std::to_string(C) + " must be a positive multiple of 8");
  const int64_t c8 = C / 8;
  RowLayout l;
  l.vpt = c8 <= 256 ? 1 : c8 <= 512 ? 2 : 4;
  require(C <= kNormMaxChannels, op,
          "channels C = " + std::to_string(C) + " > " + std::to_string(kNormMaxChannels) + " is not supported");
  l.tx = static_cast<int>(round_up(ceil_div(c8, l.vpt), kWarp));
  l.ty = std::max(1, std::min(kMaxRowsPerBlock, kMaxThreads / l.tx));
  return l;
}

// Blocks of `kernel` (tx × ty threads, `smem` bytes of dynamic shared memory) that
// can be resident at once on the calling thread's current device: SMs × occupancy.
// The backward launchers and their *_scratch_bytes run every step, so the SM count
// and the occupancy are asked once per (device, kernel, block shape, smem) and then
// served from a cache (thread-safe; norm_common.cu). Steady-state calls make no
// attribute or occupancy queries, and a scratch size and the launch it is for read
// the same cached number.
int resident_blocks(const void* kernel, int tx, int ty, size_t smem);

// Blocks for a backward kernel that strides over rows: as many as can be resident
// at once (so one wave covers the GPU), never more than there are row groups.
template <class Kernel>
int partial_blocks(Kernel kernel, const RowLayout& l, size_t smem, int64_t N) {
  const int resident = resident_blocks(reinterpret_cast<const void*>(kernel), l.tx, l.ty, smem);
  const int64_t groups = ceil_div(N, l.ty);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(groups, resident)));
}

// Adds the ty row-slices' dw partials of this block in order y = 0, 1, …, ty−1 and
// writes the block's partial row to out[C]. smem holds C floats.
template <int VPT>
__device__ void store_block_partial(float (&dw)[VPT][8], float* out, float* smem, int C) {
  const int c8 = C / 8;
  for (int y = 1; y < static_cast<int>(blockDim.y); ++y) {
    if (threadIdx.y == y) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int v = threadIdx.x + k * blockDim.x;
        if (v < c8) store8(smem + v * 8, dw[k]);
      }
    }
    __syncthreads();
    if (threadIdx.y == 0) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int v = threadIdx.x + k * blockDim.x;
        if (v < c8) {
          float t[8];
          load8(t, smem + v * 8);
#pragma unroll
          for (int i = 0; i < 8; ++i) dw[k][i] += t[i];
        }
      }
    }
    __syncthreads();
  }
  if (threadIdx.y == 0) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int v = threadIdx.x + k * blockDim.x;
      if (v < c8) store8(out + v * 8, dw[k]);
    }
  }
}

// dweight[c] += Σ_{b<G} partial[b][c], in a fixed order independent of the device:
// thread (x, y) of a 32×32 block sums b ≡ y (mod 32) with 4 interleaved
// accumulators (b = y + 32·(4j + u) goes to accumulator u; loads stay in flight),
// then the 32 per-y sums are added in y order. Launch: grid ⌈C/32⌉, block (32, 32).
constexpr int kReduceY = 32;
static __global__ void __launch_bounds__(kWarp * kReduceY)
    dweight_reduce_kernel(float* __restrict__ dweight, const float* __restrict__ partial, int G, int C) {
  __shared__ float s[kReduceY][kWarp + 1];
  const int c = blockIdx.x * kWarp + threadIdx.x;
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (c < C) {
    int b = threadIdx.y;
    for (; b + 3 * kReduceY < G; b += 4 * kReduceY) {
#pragma unroll
      for (int u = 0; u < 4; ++u) a[u] += partial[static_cast<int64_t>(b + u * kReduceY) * C + c];
    }
#pragma unroll
    for (int u = 0; u < 3; ++u)  // at most 3 left: b + 3·kReduceY ≥ G
      if (b + u * kReduceY < G) a[u] += partial[static_cast<int64_t>(b + u * kReduceY) * C + c];
  }
  s[threadIdx.y][threadIdx.x] = (a[0] + a[1]) + (a[2] + a[3]);
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float t = 0.0f;
#pragma unroll
    for (int y = 0; y < kReduceY; ++y) t += s[y][threadIdx.x];
    dweight[c] += t;
  }
}

// A backward launcher's dweight arguments: dweight (may be null: no weight gradient)
// fp32, and then the [G][C] scratch for the partials (stored as float4 pairs), whose
// size `scratch_bytes` names the function that gives.
inline void check_dweight_args(const char* op, const float* dweight, const void* scratch, const char* scratch_bytes) {
  require_aligned(dweight, 4, op, "dweight");
  require_aligned(scratch, 16, op, "scratch");
  require(dweight == nullptr || scratch != nullptr, op, std::string("dweight needs scratch (") + scratch_bytes + ")");
}

inline void launch_dweight_reduce(float* dweight, const float* partial, int G, int64_t C, cudaStream_t stream) {
  launch(dweight_reduce_kernel, static_cast<unsigned>(ceil_div(C, kWarp)), dim3(kWarp, kReduceY), 0, stream, dweight,
         partial, G, static_cast<int>(C));
  cuda_check_launch();
}

}  // namespace spes::cuda::norm
