// RMSNorm + residual: forward and backward. Layout and dweight scheme: norm_common.cuh.
//
// Memory passes (bf16 = 2 B/channel):
//   forward:  read res_in, branch; write res_out, out       = 8 B/channel/row
//   backward: read dout, dres_in, x; write dres_out         = 8 B/channel/row
//             + G·C·8 B for the dweight partials (G ≈ resident blocks, ≈1–3 %)
// Both are single-pass and bandwidth-bound.
#include "cuda/launch.cuh"
#include "cuda/norm_common.cuh"
#include "cuda/rmsnorm.cuh"

namespace spes::cuda {

namespace {

using norm::RowLayout;

template <int VPT>
__global__ void __launch_bounds__(norm::kMaxThreads) rmsnorm_forward_kernel(bf16* out, float* __restrict__ rstd, bf16* res_out,
                                                               const bf16* res_in, const bf16* __restrict__ branch,
                                                               const bf16* __restrict__ weight, int64_t N, int C,
                                                               float eps, const bf16* __restrict__ post_res) {
  __shared__ float scratch[norm::kMaxRowsPerBlock * kWarp];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < N;  // no early return: row_sum synchronises the block
  const int c8 = C / 8;
  float x[VPT][8];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (active && v < c8) {
      const int64_t off = row * C + v * 8;
      load8(x[k], res_in + off);
      if (branch != nullptr) {
        float b[8];
        load8(b, branch + off);
#pragma unroll
        for (int i = 0; i < 8; ++i) x[k][i] = __bfloat162float(__float2bfloat16_rn(x[k][i] + b[i]));
        store8(res_out + off, x[k]);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) ss += x[k][i] * x[k][i];
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[k][i] = 0.0f;
    }
  }
  const float total = row_sum(ss, scratch);
  const float r = rsqrtf(total / static_cast<float>(C) + eps);
  if (!active) return;
  if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v < c8) {
      float w[8], y[8];
      load8(w, weight + v * 8);
#pragma unroll
      for (int i = 0; i < 8; ++i) y[i] = x[k][i] * r * w[i];
      if (post_res != nullptr) {  // post-norm: out = post_res + the normalised row, one rounding
        float p[8];
        load8(p, post_res + row * C + v * 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] += p[i];
      }
      store8(out + row * C + v * 8, y);
    }
  }
}

// Grid: G blocks striding over row groups (see norm_common.cuh). partial: [G][C]
// or nullptr when the weight is frozen. dbranch (post-norm): the gradient is
// g = bf16(dout + dbranch), written to g_out (may alias dout) before its use.
template <int VPT>
__global__ void __launch_bounds__(norm::kMaxThreads) rmsnorm_backward_kernel(bf16* dres_out, float* __restrict__ partial,
                                                                const bf16* dout, const bf16* dres_in,
                                                                const bf16* __restrict__ x_in,
                                                                const bf16* __restrict__ weight,
                                                                const float* __restrict__ rstd, int64_t N, int C,
                                                                const bf16* __restrict__ dbranch, bf16* g_out) {
  float* smem = dynamic_smem<float>;  // C floats, for the block's dweight partial
  __shared__ float scratch[norm::kMaxRowsPerBlock * kWarp];
  const int c8 = C / 8;
  const float inv_c = 1.0f / static_cast<float>(C);
  float dw[VPT][8];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int i = 0; i < 8; ++i) dw[k][i] = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < N; base += stride) {
    const int64_t row = base + threadIdx.y;
    const bool active = row < N;  // uniform trip count: row_sum synchronises
    const float r = active ? rstd[row] : 0.0f;
    // All three row loads are issued before the reduction's barrier and kept packed
    // (4 registers per 8 channels); unpacked again after it.
    int4 g_raw[VPT], x_raw[VPT], d_raw[VPT];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int v = threadIdx.x + k * blockDim.x;
      g_raw[k] = x_raw[k] = d_raw[k] = make_int4(0, 0, 0, 0);
      if (active && v < c8) {
        const int64_t off = row * C + v * 8;
        g_raw[k] = load16_stream(dout + off);
        x_raw[k] = load16_stream(x_in + off);
        if (dres_in != nullptr) d_raw[k] = load16(dres_in + off);  // zeros: bf16 +0
        float w[8], g[8], xh[8];
        load8(w, weight + v * 8);  // L1-resident, re-read rather than held in registers
        unpack8(g, g_raw[k]);
        if (dbranch != nullptr) {
          float b[8];
          load8(b, dbranch + off);
#pragma unroll
          for (int i = 0; i < 8; ++i) g[i] = __bfloat162float(__float2bfloat16_rn(g[i] + b[i]));
          store8(g_out + off, g);
          g_raw[k] = pack8(g);  // the rounded sum, exact in bf16
        }
        unpack8(xh, x_raw[k]);
#pragma unroll
        for (int i = 0; i < 8; ++i) dot += g[i] * w[i] * (xh[i] * r);
      }
    }
    const float mean_dot = row_sum(dot, scratch) * inv_c;
    if (!active) continue;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int v = threadIdx.x + k * blockDim.x;
      if (v < c8) {
        float w[8], g[8], xh[8], d[8];
        load8(w, weight + v * 8);
        unpack8(g, g_raw[k]);
        unpack8(xh, x_raw[k]);
        unpack8(d, d_raw[k]);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          xh[i] *= r;
          d[i] += r * (g[i] * w[i] - xh[i] * mean_dot);
          dw[k][i] += g[i] * xh[i];
        }
        store8(dres_out + row * C + v * 8, d);
      }
    }
  }
  if (partial != nullptr) norm::store_block_partial<VPT>(dw, partial + static_cast<int64_t>(blockIdx.x) * C, smem, C);
}

template <int VPT>
int backward_blocks(const RowLayout& l, int64_t N, int64_t C) {
  return norm::partial_blocks(rmsnorm_backward_kernel<VPT>, l, C * sizeof(float), N);
}

int backward_blocks(const RowLayout& l, int64_t N, int64_t C) {
  switch (l.vpt) {
    case 1: return backward_blocks<1>(l, N, C);
    case 2: return backward_blocks<2>(l, N, C);
    default: return backward_blocks<4>(l, N, C);
  }
}

// The forward launch: rmsnorm_forward's, or with post_res rmsnorm_post_forward's.
void forward_launch(const RowLayout& l, bf16* out, float* rstd, bf16* res_out, const bf16* res_in, const bf16* branch,
                    const bf16* weight, int64_t N, int64_t C, float eps, const bf16* post_res, cudaStream_t stream) {
  if (N == 0) return;
  const dim3 block(l.tx, l.ty);
  const unsigned grid = static_cast<unsigned>(ceil_div(N, l.ty));
  const int c = static_cast<int>(C);
  switch (l.vpt) {
    case 1: launch(rmsnorm_forward_kernel<1>, grid, block, 0, stream, out, rstd, res_out, res_in, branch, weight, N, c, eps, post_res); break;
    case 2: launch(rmsnorm_forward_kernel<2>, grid, block, 0, stream, out, rstd, res_out, res_in, branch, weight, N, c, eps, post_res); break;
    default: launch(rmsnorm_forward_kernel<4>, grid, block, 0, stream, out, rstd, res_out, res_in, branch, weight, N, c, eps, post_res); break;
  }
  cuda_check_launch();
}

// The backward launch: rmsnorm_backward's, or with dbranch rmsnorm_post_backward's.
void backward_launch(const RowLayout& l, bf16* dres_out, float* dweight, void* scratch, const bf16* dout,
                     const bf16* dres_in, const bf16* x, const bf16* weight, const float* rstd, int64_t N, int64_t C,
                     const bf16* dbranch, bf16* g_out, cudaStream_t stream) {
  if (N == 0) return;
  const int G = backward_blocks(l, N, C);
  float* partial = dweight ? static_cast<float*>(scratch) : nullptr;
  const dim3 block(l.tx, l.ty);
  const size_t smem = C * sizeof(float);
  const int c = static_cast<int>(C);
  switch (l.vpt) {
    case 1: launch(rmsnorm_backward_kernel<1>, G, block, smem, stream, dres_out, partial, dout, dres_in, x, weight, rstd, N, c, dbranch, g_out); break;
    case 2: launch(rmsnorm_backward_kernel<2>, G, block, smem, stream, dres_out, partial, dout, dres_in, x, weight, rstd, N, c, dbranch, g_out); break;
    default: launch(rmsnorm_backward_kernel<4>, G, block, smem, stream, dres_out, partial, dout, dres_in, x, weight, rstd, N, c, dbranch, g_out); break;
  }
  cuda_check_launch();
  if (dweight) norm::launch_dweight_reduce(dweight, partial, G, C, stream);
}

}  // namespace

void rmsnorm_forward(bf16* out, float* rstd, bf16* res_out, const bf16* res_in, const bf16* branch,
                     const bf16* weight, int64_t N, int64_t C, float eps, cudaStream_t stream) {
  const char* op = "rmsnorm_forward";
  const RowLayout l = norm::row_layout(C, op);
  require(N >= 0, op, "N must be ≥ 0");
  // Rows of C % 8 == 0 bf16 values are moved as 16-byte vectors (load8/store8), so
  // every bf16 base pointer must be 16-byte aligned; rows then stay aligned.
  require_ptr(out, 16, op, "out");
  require_ptr(rstd, 4, op, "rstd");
  require_aligned(res_out, 16, op, "res_out");
  require_ptr(res_in, 16, op, "res_in");
  require_aligned(branch, 16, op, "branch");
  require_ptr(weight, 16, op, "weight");
  require(branch == nullptr || res_out != nullptr, op, "a branch needs res_out for the new residual");
  const size_t bytes = size_t(N * C) * sizeof(bf16);
  require_disjoint(out, bytes, branch, bytes, op, "branch must not overlap out");
  require_disjoint(res_out, bytes, branch, bytes, op, "branch must not overlap res_out");
  forward_launch(l, out, rstd, res_out, res_in, branch, weight, N, C, eps, nullptr, stream);
}

void rmsnorm_post_forward(bf16* res_out, float* rstd, const bf16* res_in, const bf16* x, const bf16* weight,
                          int64_t N, int64_t C, float eps, cudaStream_t stream) {
  const char* op = "rmsnorm_post_forward";
  const RowLayout l = norm::row_layout(C, op);
  require(N >= 0, op, "N must be ≥ 0");
  require_ptr(res_out, 16, op, "res_out");
  require_ptr(rstd, 4, op, "rstd");
  require_ptr(res_in, 16, op, "res_in");
  require_ptr(x, 16, op, "x");
  require_ptr(weight, 16, op, "weight");
  const size_t bytes = size_t(N * C) * sizeof(bf16);
  require_disjoint(res_out, bytes, x, bytes, op, "x must not overlap res_out");
  forward_launch(l, res_out, rstd, nullptr, x, nullptr, weight, N, C, eps, res_in, stream);
}

size_t rmsnorm_backward_scratch_bytes(int64_t N, int64_t C) {
  const RowLayout l = norm::row_layout(C, "rmsnorm_backward");
  if (N == 0) return 0;
  return static_cast<size_t>(backward_blocks(l, N, C)) * C * sizeof(float);
}

void rmsnorm_backward(bf16* dres_out, float* dweight, void* scratch, const bf16* dout, const bf16* dres_in,
                      const bf16* x, const bf16* weight, const float* rstd, int64_t N, int64_t C,
                      cudaStream_t stream) {
  const char* op = "rmsnorm_backward";
  const RowLayout l = norm::row_layout(C, op);
  require(N >= 0, op, "N must be ≥ 0");
  require_ptr(dres_out, 16, op, "dres_out");
  norm::check_dweight_args(op, dweight, scratch, "rmsnorm_backward_scratch_bytes");
  require_ptr(dout, 16, op, "dout");
  require_aligned(dres_in, 16, op, "dres_in");
  require_ptr(x, 16, op, "x");
  require_ptr(weight, 16, op, "weight");
  require_ptr(rstd, 4, op, "rstd");
  const size_t bytes = size_t(N * C) * sizeof(bf16);
  require_disjoint(dres_out, bytes, dout, bytes, op, "dout must not overlap dres_out");
  require_disjoint(dres_out, bytes, x, bytes, op, "x must not overlap dres_out");
  backward_launch(l, dres_out, dweight, scratch, dout, dres_in, x, weight, rstd, N, C, nullptr, nullptr, stream);
}

void rmsnorm_post_backward(bf16* dx, float* dweight, void* scratch, bf16* dres, const bf16* dbranch, const bf16* x,
                           const bf16* weight, const float* rstd, int64_t N, int64_t C, cudaStream_t stream) {
  const char* op = "rmsnorm_post_backward";
  const RowLayout l = norm::row_layout(C, op);
  require(N >= 0, op, "N must be ≥ 0");
  require_ptr(dx, 16, op, "dx");
  norm::check_dweight_args(op, dweight, scratch, "rmsnorm_backward_scratch_bytes");
  require_ptr(dres, 16, op, "dres");
  require_aligned(dbranch, 16, op, "dbranch");
  require_ptr(x, 16, op, "x");
  require_ptr(weight, 16, op, "weight");
  require_ptr(rstd, 4, op, "rstd");
  const size_t bytes = size_t(N * C) * sizeof(bf16);
  require_disjoint(dx, bytes, dres, bytes, op, "dres must not overlap dx");
  require_disjoint(dx, bytes, x, bytes, op, "x must not overlap dx");
  require_disjoint(dx, bytes, dbranch, bytes, op, "dbranch must not overlap dx");
  require_disjoint(dres, bytes, dbranch, bytes, op, "dbranch must not overlap dres");
  backward_launch(l, dx, dweight, scratch, dres, nullptr, x, weight, rstd, N, C, dbranch, dbranch ? dres : nullptr,
                  stream);
}

}  // namespace spes::cuda
