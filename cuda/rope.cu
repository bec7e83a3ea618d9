// QK-norm + RoPE (rotate_half), forward and backward. Row layout and the dweight
// scheme are those of rmsnorm.cu (norm_common.cuh). RoPE pairs channel i of a head
// with channel i + D/2, which another thread owns, so each row's normalised values
// (forward) or incoming gradient (backward) are exchanged through shared memory in
// fp32, next to that row's D/2 cos/sin values (computed in double per row, as
// cpu::rope_forward does, and shared by all H heads of the row).
//
// Memory passes: forward reads inp and writes out (4 B/channel/row); backward reads
// dout and inp, writes dinp (6 B/channel/row) + the dweight partials. Single pass.
#include <algorithm>

#include "cuda/norm_common.cuh"
#include "cuda/rope.cuh"

namespace spes::cuda {

namespace {

using norm::RowLayout;

constexpr size_t kSmemBudget = 48 * 1024;  // default dynamic smem limit, no opt-in needed

// Row stride in the shared buffer: C values then cos[D/2], sin[D/2], padded so the
// next row stays 16-byte aligned for float4 accesses.
int smem_row_floats(int64_t C, int64_t D) { return static_cast<int>(C + round_up(D, 8)); }

RowLayout rope_layout(int64_t C, int64_t D, const char* op) {
  RowLayout l = norm::row_layout(C, op);
  const size_t row_bytes = smem_row_floats(C, D) * sizeof(float);
  l.ty = static_cast<int>(std::max<size_t>(1, std::min<size_t>(l.ty, kSmemBudget / row_bytes)));
  return l;
}

// cos/sin of position t for the D/2 frequencies: angle = t·theta^(−2i/D) in double,
// rounded once to fp32 (bit-for-bit the expression of cpu::rope_forward).
__device__ void rope_angles(float* cs, float* sn, int64_t t, int D, double theta) {
  const int half = D / 2;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const double inv_freq = pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
    double s, c;
    sincos(static_cast<double>(t) * inv_freq, &s, &c);
    cs[i] = static_cast<float>(c);
    sn[i] = static_cast<float>(s);
  }
}

// The 8 rotated values of vector v of a row held in shared memory `ys`. sign = +1
// rotates by +angle (forward), −1 by −angle (backward: the rotation's transpose).
__device__ __forceinline__ void rotate8(float (&o)[8], const float* ys, const float* cs, const float* sn, int v,
                                        int D, float sign) {
  const int half = D / 2;
  int d = (v * 8) % D;  // position inside the head
#pragma unroll
  for (int i = 0; i < 8; ++i, ++d) {
    if (d == D) d = 0;  // a vector may straddle two heads when D % 8 != 0
    const int e = v * 8 + i;
    const int j = d < half ? d : d - half;
    const float x1 = ys[e - d + j];
    const float x2 = ys[e - d + j + half];
    const float s = sign * sn[j];
    o[i] = d < half ? x1 * cs[j] - x2 * s : x2 * cs[j] + x1 * s;
  }
}

template <int VPT>
__global__ void __launch_bounds__(norm::kMaxThreads)
    qknorm_rope_forward_kernel(bf16* out, float* __restrict__ rstd, const bf16* inp, const bf16* __restrict__ weight,
                               int64_t N, int C, int64_t T, int D, float eps, double theta, int stride) {
  extern __shared__ float smem[];
  __shared__ float scratch[norm::kMaxRowsPerBlock * kWarp];
  float* ys = smem + threadIdx.y * stride;
  float* cs = ys + C;
  float* sn = cs + D / 2;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < N;  // no early return before the last __syncthreads
  const int c8 = C / 8;
  if (active) rope_angles(cs, sn, row % T, D, theta);

  float x[VPT][8];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (active && v < c8) {
      load8(x[k], inp + row * C + v * 8);
#pragma unroll
      for (int i = 0; i < 8; ++i) ss += x[k][i] * x[k][i];
    }
  }
  const float r = rsqrtf(row_sum(ss, scratch) / static_cast<float>(C) + eps);
  if (active) {
    if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int v = threadIdx.x + k * blockDim.x;
      if (v < c8) {
        float w[8];
        load8(w, weight + v * 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) x[k][i] = x[k][i] * r * w[i];
        store8(ys + v * 8, x[k]);
      }
    }
  }
  __syncthreads();  // normalised row and cos/sin visible to the whole row slice
  if (!active) return;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v < c8) {
      float o[8];
      rotate8(o, ys, cs, sn, v, D, 1.0f);
      store8(out + row * C + v * 8, o);
    }
  }
}

template <int VPT>
__global__ void __launch_bounds__(norm::kMaxThreads)
    qknorm_rope_backward_kernel(bf16* dinp, float* __restrict__ partial, const bf16* __restrict__ dout,
                                const bf16* __restrict__ inp, const bf16* __restrict__ weight,
                                const float* __restrict__ rstd, int64_t N, int C, int64_t T, int D, double theta,
                                int stride) {
  extern __shared__ float smem[];
  __shared__ float scratch[norm::kMaxRowsPerBlock * kWarp];
  float* ys = smem + threadIdx.y * stride;
  float* cs = ys + C;
  float* sn = cs + D / 2;
  const int c8 = C / 8;
  const float inv_c = 1.0f / static_cast<float>(C);
  float dw[VPT][8];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int i = 0; i < 8; ++i) dw[k][i] = 0.0f;

  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < N; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool active = row < N;  // uniform trip count: the block synchronises below
    if (active) {
      rope_angles(cs, sn, row % T, D, theta);
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int v = threadIdx.x + k * blockDim.x;
        if (v < c8) {
          float t[8];
          load8_stream(t, dout + row * C + v * 8);
          store8(ys + v * 8, t);
        }
      }
    }
    __syncthreads();  // incoming gradient row and cos/sin visible
    const float r = active ? rstd[row] : 0.0f;
    float g[VPT][8], xh[VPT][8];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int v = threadIdx.x + k * blockDim.x;
      if (active && v < c8) {
        rotate8(g[k], ys, cs, sn, v, D, -1.0f);  // gradient w.r.t. the normalised row
        float w[8];
        load8(w, weight + v * 8);
        load8(xh[k], inp + row * C + v * 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          xh[k][i] *= r;
          dot += g[k][i] * w[i] * xh[k][i];
        }
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) g[k][i] = xh[k][i] = 0.0f;
      }
    }
    // row_sum's barriers also order this iteration's smem reads before the next
    // iteration's writes.
    const float mean_dot = row_sum(dot, scratch) * inv_c;
    if (!active) continue;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int v = threadIdx.x + k * blockDim.x;
      if (v < c8) {
        float w[8], d[8];
        load8(w, weight + v * 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          d[i] = r * (g[k][i] * w[i] - xh[k][i] * mean_dot);
          dw[k][i] += g[k][i] * xh[k][i];
        }
        store8(dinp + row * C + v * 8, d);
      }
    }
  }
  if (partial != nullptr) norm::store_block_partial<VPT>(dw, partial + static_cast<int64_t>(blockIdx.x) * C, smem, C);
}

template <int VPT>
int backward_blocks_t(const RowLayout& l, size_t smem, int64_t N) {
  return norm::partial_blocks(qknorm_rope_backward_kernel<VPT>, l, smem, N);
}
int backward_blocks(const RowLayout& l, size_t smem, int64_t N) {
  switch (l.vpt) {
    case 1: return backward_blocks_t<1>(l, smem, N);
    case 2: return backward_blocks_t<2>(l, smem, N);
    default: return backward_blocks_t<4>(l, smem, N);
  }
}

void check_args(const char* op, int64_t B, int64_t T, int64_t H, int64_t D, std::initializer_list<const void*> ptrs) {
  require(B >= 0 && T > 0 && H > 0 && D > 0 && D % 2 == 0, op, "need B ≥ 0, T, H > 0 and an even head dim D");
  for (const void* p : ptrs) require(p == nullptr || aligned(p, 16), op, "bf16 buffers must be 16-byte aligned");
}

}  // namespace

void qknorm_rope_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight, int64_t B, int64_t T,
                         int64_t H, int64_t D, float eps, double theta, cudaStream_t stream) {
  const char* op = "qknorm_rope_forward";
  check_args(op, B, T, H, D, {out, inp, weight});
  require(static_cast<const void*>(out) != static_cast<const void*>(inp), op, "out must not alias inp");
  const int64_t N = B * T, C = H * D;
  const RowLayout l = rope_layout(C, D, op);
  if (N == 0) return;
  const int stride = smem_row_floats(C, D);
  const size_t smem = size_t(l.ty) * stride * sizeof(float);
  const dim3 block(l.tx, l.ty);
  const unsigned grid = static_cast<unsigned>(ceil_div(N, l.ty));
  const int c = static_cast<int>(C), d = static_cast<int>(D);
  switch (l.vpt) {
    case 1: qknorm_rope_forward_kernel<1><<<grid, block, smem, stream>>>(out, rstd, inp, weight, N, c, T, d, eps, theta, stride); break;
    case 2: qknorm_rope_forward_kernel<2><<<grid, block, smem, stream>>>(out, rstd, inp, weight, N, c, T, d, eps, theta, stride); break;
    default: qknorm_rope_forward_kernel<4><<<grid, block, smem, stream>>>(out, rstd, inp, weight, N, c, T, d, eps, theta, stride); break;
  }
  cuda_check_launch();
}

size_t qknorm_rope_backward_scratch_bytes(int64_t B, int64_t T, int64_t H, int64_t D) {
  const int64_t N = B * T, C = H * D;
  const RowLayout l = rope_layout(C, D, "qknorm_rope_backward");
  if (N == 0) return 0;
  const size_t smem = size_t(l.ty) * smem_row_floats(C, D) * sizeof(float);
  return static_cast<size_t>(backward_blocks(l, smem, N)) * C * sizeof(float);
}

void qknorm_rope_backward(bf16* dinp, float* dweight, void* scratch, const bf16* dout, const bf16* inp,
                          const bf16* weight, const float* rstd, int64_t B, int64_t T, int64_t H, int64_t D,
                          double theta, cudaStream_t stream) {
  const char* op = "qknorm_rope_backward";
  check_args(op, B, T, H, D, {dinp, dout, inp, weight, scratch});
  require(dweight == nullptr || scratch != nullptr, op, "dweight needs scratch (qknorm_rope_backward_scratch_bytes)");
  const int64_t N = B * T, C = H * D;
  const RowLayout l = rope_layout(C, D, op);
  if (N == 0) return;
  const int stride = smem_row_floats(C, D);
  const size_t smem = size_t(l.ty) * stride * sizeof(float);
  const int G = backward_blocks(l, smem, N);
  float* partial = dweight ? static_cast<float*>(scratch) : nullptr;
  const dim3 block(l.tx, l.ty);
  const int c = static_cast<int>(C), d = static_cast<int>(D);
  switch (l.vpt) {
    case 1: qknorm_rope_backward_kernel<1><<<G, block, smem, stream>>>(dinp, partial, dout, inp, weight, rstd, N, c, T, d, theta, stride); break;
    case 2: qknorm_rope_backward_kernel<2><<<G, block, smem, stream>>>(dinp, partial, dout, inp, weight, rstd, N, c, T, d, theta, stride); break;
    default: qknorm_rope_backward_kernel<4><<<G, block, smem, stream>>>(dinp, partial, dout, inp, weight, rstd, N, c, T, d, theta, stride); break;
  }
  cuda_check_launch();
  if (dweight) norm::launch_dweight_reduce(dweight, partial, G, C, stream);
}

}  // namespace spes::cuda
