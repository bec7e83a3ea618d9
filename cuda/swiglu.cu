// SwiGLU forward/backward: elementwise and memory-bound, so the only design points
// are 16-byte vector accesses (8 bf16 per load) and a grid-stride loop. The backward
// also re-emits h, so that h need not live from the forward down GEMM until the
// down-weight gradient. The MoE layer has both done inside its grouped GEMMs' stores
// (cuda/grouped_gemm.cuh), which these kernels are checked against bit for bit and
// timed against; the element math is theirs too (cuda/swiglu_math.cuh).
#include <cstdint>

#include "cuda/check.cuh"
#include "cuda/launch.cuh"
#include "cuda/swiglu.cuh"
#include "cuda/swiglu_math.cuh"

namespace spes::cuda {
namespace {

constexpr int kThreads = 256;

template <int VEC>
__global__ void swiglu_forward_kernel(bf16* __restrict__ h, const bf16* __restrict__ gate,
                                      const bf16* __restrict__ up, int64_t rows, int64_t H,
                                      int64_t ld_in) {
  const int64_t vec_per_row = H / VEC;
  const int64_t n = rows * vec_per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / vec_per_row;
    const int64_t c = (i - r * vec_per_row) * VEC;
    float g[VEC], u[VEC], out[VEC];
    load_vec<VEC>(g, gate + r * ld_in + c);
    load_vec<VEC>(u, up + r * ld_in + c);
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = swiglu_value(g[j], u[j]);
    store_vec<VEC>(h + r * H + c, out);
  }
}

template <int VEC>
__global__ void swiglu_backward_kernel(bf16* dgate, bf16* dup, bf16* h_out, const bf16* dh,
                                       const bf16* gate, const bf16* up, int64_t rows, int64_t H,
                                       int64_t ld_in) {
  // No __restrict__: h_out may alias dh and dgate/dup may alias gate/up; every
  // thread reads its elements before it writes the same elements.
  const int64_t vec_per_row = H / VEC;
  const int64_t n = rows * vec_per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / vec_per_row;
    const int64_t c = (i - r * vec_per_row) * VEC;
    float g[VEC], u[VEC], d[VEC], dg[VEC], du[VEC], hv[VEC];
    load_vec<VEC>(g, gate + r * ld_in + c);
    load_vec<VEC>(u, up + r * ld_in + c);
    load_vec<VEC>(d, dh + r * H + c);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const SwigluGrad x = swiglu_grad(d[j], g[j], u[j]);
      dg[j] = x.dgate;
      du[j] = x.dup;
      hv[j] = x.h;
    }
    store_vec<VEC>(dgate + r * ld_in + c, dg);
    store_vec<VEC>(dup + r * ld_in + c, du);
    if (h_out != nullptr) store_vec<VEC>(h_out + r * H + c, hv);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

int grid_for(int64_t n_items) {
  // Enough blocks to fill any current GPU several times over; the loop covers the rest.
  const int64_t blocks = (n_items + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace

void swiglu_forward(bf16* h, const bf16* gate, const bf16* up, int64_t rows, int64_t H, int64_t ld_in,
                    cudaStream_t stream) {
  const char* op = "swiglu_forward";
  if (rows <= 0 || H <= 0) return;
  // 16-byte vectors only where every pointer and row stride allows; scalar otherwise.
  require(ld_in >= H, op, "ld_in must be ≥ H");
  require_ptr(h, 2, op, "h");
  require_ptr(gate, 2, op, "gate");
  require_ptr(up, 2, op, "up");
  const bool vec8 = H % 8 == 0 && ld_in % 8 == 0 && aligned16(h) && aligned16(gate) && aligned16(up);
  if (vec8) {
    launch(swiglu_forward_kernel<8>, grid_for(rows * H / 8), kThreads, 0, stream, h, gate, up, rows, H, ld_in);
  } else {
    launch(swiglu_forward_kernel<1>, grid_for(rows * H), kThreads, 0, stream, h, gate, up, rows, H, ld_in);
  }
  cuda_check_launch();
}

void swiglu_backward(bf16* dgate, bf16* dup, bf16* h_out, const bf16* dh, const bf16* gate,
                     const bf16* up, int64_t rows, int64_t H, int64_t ld_in, cudaStream_t stream) {
  const char* op = "swiglu_backward";
  if (rows <= 0 || H <= 0) return;
  require(ld_in >= H, op, "ld_in must be ≥ H");
  require_ptr(dgate, 2, op, "dgate");
  require_ptr(dup, 2, op, "dup");
  require_aligned(h_out, 2, op, "h_out");
  require_ptr(dh, 2, op, "dh");
  require_ptr(gate, 2, op, "gate");
  require_ptr(up, 2, op, "up");
  const bool vec8 = H % 8 == 0 && ld_in % 8 == 0 && aligned16(dgate) && aligned16(dup) &&
                    aligned16(h_out) && aligned16(dh) && aligned16(gate) && aligned16(up);
  if (vec8) {
    launch(swiglu_backward_kernel<8>, grid_for(rows * H / 8), kThreads, 0, stream, dgate, dup, h_out, dh, gate, up,
           rows, H, ld_in);
  } else {
    launch(swiglu_backward_kernel<1>, grid_for(rows * H), kThreads, 0, stream, dgate, dup, h_out, dh, gate, up, rows,
           H, ld_in);
  }
  cuda_check_launch();
}

}  // namespace spes::cuda
