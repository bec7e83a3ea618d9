// QK-norm + RoPE (rotate_half), forward and backward. Row layout and the dweight
// scheme are those of rmsnorm.cu (norm_common.cuh). RoPE pairs channel i of a head
// with channel i + D/2, which another thread owns, so each row's normalised values
// (forward) or incoming gradient (backward) are exchanged through shared memory in
// fp32. cos/sin come from the precomputed table (L1/L2 resident, 8 B per pair).
// When D % 16 == 0 (every head dim the attention kernels take) a thread's 8
// channels lie in one half of one head, so it reads its own values, the partner
// half's and the cos/sin pairs as float4s (rotate8_paired); else scalars (rotate8),
// whose reads are 8-way shared-memory bank conflicts.
// The per-head norm (Qwen3) runs the same kernels over rows of one head each
// (NormRows below): a row of D = 128 channels is 16 vectors, so half of each row's
// 32 threads idle (a warp never straddles rows), and 4 rows share a block.
//
// Memory passes: forward reads inp and writes out (4 B/channel/row); backward reads
// dout and inp, writes dinp (6 B/channel/row) + the dweight partials. Single pass.
#include <algorithm>

#include "cuda/launch.cuh"
#include "cuda/norm_common.cuh"
#include "cuda/rope.cuh"

namespace spes::cuda {

namespace {

using norm::RowLayout;

// Without an opt-in a block may use 48 KB of shared memory in all, the kernels'
// static `scratch` included: only the rest is there for the dynamic row buffers.
// (C = 6144 gave ty = 2 rows of 24 KB = 48 KB dynamic + 512 B static: over the limit,
// so the launch failed.)
constexpr size_t kStaticSmem = norm::kMaxRowsPerBlock * kWarp * sizeof(float);
constexpr size_t kSmemBudget = 48 * 1024 - kStaticSmem;

// Row stride in the shared buffer (C % 8 == 0 keeps rows 16-byte aligned).
int smem_row_floats(int64_t C) { return static_cast<int>(C); }

RowLayout rope_layout(int64_t C, const char* op) {
  RowLayout l = norm::row_layout(C, op);
  const size_t row_bytes = smem_row_floats(C) * sizeof(float);
  l.ty = static_cast<int>(std::max<size_t>(1, std::min<size_t>(l.ty, kSmemBudget / row_bytes)));
  return l;
}

// cos/sin of t·theta^(−2i/D) in double, rounded once to fp32 (the expression of
// cpu::rope_forward). One thread per (t, i).
__global__ void rope_table_kernel(float2* __restrict__ table, int64_t T, int D, double theta) {
  const int half = D / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= T * half) return;
  const int64_t t = idx / half;
  const int i = static_cast<int>(idx - t * half);
  const double inv_freq = pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
  double s, c;
  sincos(static_cast<double>(t) * inv_freq, &s, &c);
  table[idx] = make_float2(static_cast<float>(c), static_cast<float>(s));
}

// One rotated channel: x1 is the pair's first-half value, x2 its second-half value,
// s = sign · sin. Both rotations below call this, so that they round alike: both
// products are rounded before the sum (__fmul_rn is never fused into an FMA), since
// nvcc would otherwise contract x1·c − x2·s into an FMA of its choosing, and chose
// differently where rotate8 and rotate8_paired inline it.
__device__ __forceinline__ float rotate_channel(bool first_half, float x1, float x2, float c, float s) {
  return first_half ? __fmul_rn(x1, c) - __fmul_rn(x2, s) : __fmul_rn(x2, c) + __fmul_rn(x1, s);
}

// The 8 rotated values of vector v of a row held in shared memory `ys`; `cst` is
// the table row of the row's position. sign = +1 rotates by +angle (forward), −1
// by −angle (backward: the rotation's transpose).
__device__ __forceinline__ void rotate8(float (&o)[8], const float* ys, const float2* __restrict__ cst, int v, int D,
                                        float sign) {
  const int half = D / 2;
  int d = (v * 8) % D;  // position inside the head
#pragma unroll
  for (int i = 0; i < 8; ++i, ++d) {
    if (d == D) d = 0;  // a vector may straddle two heads when D % 8 != 0
    const int e = v * 8 + i;
    const int j = d < half ? d : d - half;
    const float x1 = ys[e - d + j];
    const float x2 = ys[e - d + j + half];
    const float2 cs = __ldg(cst + j);
    o[i] = rotate_channel(d < half, x1, x2, cs.x, sign * cs.y);
  }
}

// rotate8 when D % 16 == 0 and the table is 16-byte aligned (every head dim the
// attention kernels take): the 8 channels of vector v then lie in one half of one
// head, so the own values, the partner half's and the 8 cos/sin pairs are each
// contiguous and move as float4s. rotate8's scalar reads, 32 bytes apart from lane to
// lane, are 8-way shared-memory bank conflicts, and its 8-byte table loads as many
// L1 wavefronts. The same rotate_channel on the same values: bitwise rotate8's result.
__device__ __forceinline__ void rotate8_paired(float (&o)[8], const float* ys, const float2* __restrict__ cst, int v,
                                               int D, float sign) {
  const int half = D / 2;
  const int d = (v * 8) % D;
  const bool first_half = d < half;
  const int j = first_half ? d : d - half;
  const float* head = ys + v * 8 - d;
  float x1[8], x2[8];
  load8(x1, head + j);
  load8(x2, head + j + half);
  const float4* cs4 = reinterpret_cast<const float4*>(cst + j);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 cs = __ldg(cs4 + q);  // pairs 2q and 2q + 1: (cos, sin, cos, sin)
    o[2 * q] = rotate_channel(first_half, x1[2 * q], x2[2 * q], cs.x, sign * cs.y);
    o[2 * q + 1] = rotate_channel(first_half, x1[2 * q + 1], x2[2 * q + 1], cs.z, sign * cs.w);
  }
}

// rotate8_paired where its condition holds (uniform per launch), else rotate8.
__device__ __forceinline__ void rotate8_any(float (&o)[8], const float* ys, const float2* __restrict__ cst, int v,
                                            int D, float sign, bool paired) {
  if (paired) {
    rotate8_paired(o, ys, cst, v, D, sign);
  } else {
    rotate8(o, ys, cst, v, D, sign);
  }
}

template <int VPT>
__global__ void __launch_bounds__(norm::kMaxThreads)
    qknorm_rope_forward_kernel(bf16* out, float* __restrict__ rstd, const bf16* inp, const bf16* __restrict__ weight,
                               const float2* __restrict__ table, int64_t N, int C, int64_t T, int rows_per_token,
                               int D, float eps, int stride, bool paired) {
  float* smem = dynamic_smem<float>;
  __shared__ float scratch[norm::kMaxRowsPerBlock * kWarp];
  float* ys = smem + threadIdx.y * stride;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < N;  // no early return before the last __syncthreads
  const int c8 = C / 8;

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
  __syncthreads();  // normalised row visible to the whole row slice
  if (!active) return;
  const float2* cst = table + (row / rows_per_token % T) * (D / 2);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v < c8) {
      float o[8];
      rotate8_any(o, ys, cst, v, D, 1.0f, paired);
      store8(out + row * C + v * 8, o);
    }
  }
}

template <int VPT>
__global__ void __launch_bounds__(norm::kMaxThreads)
    qknorm_rope_backward_kernel(bf16* dinp, float* __restrict__ partial, const bf16* __restrict__ dout,
                                const bf16* __restrict__ inp, const bf16* __restrict__ weight,
                                const float* __restrict__ rstd, const float2* __restrict__ table, int64_t N, int C,
                                int64_t T, int rows_per_token, int D, int stride, bool paired) {
  float* smem = dynamic_smem<float>;
  __shared__ float scratch[norm::kMaxRowsPerBlock * kWarp];
  float* ys = smem + threadIdx.y * stride;
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
    int4 x_raw[VPT];  // the saved input, loaded before the barrier, kept packed
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int v = threadIdx.x + k * blockDim.x;
      x_raw[k] = make_int4(0, 0, 0, 0);
      if (active && v < c8) {
        float t[8];
        load8_stream(t, dout + row * C + v * 8);
        x_raw[k] = load16_stream(inp + row * C + v * 8);
        store8(ys + v * 8, t);
      }
    }
    __syncthreads();  // incoming gradient row visible
    const float r = active ? rstd[row] : 0.0f;
    const float2* cst = table + (active ? row / rows_per_token % T : 0) * (D / 2);
    float g[VPT][8];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int v = threadIdx.x + k * blockDim.x;
      if (active && v < c8) {
        rotate8_any(g[k], ys, cst, v, D, -1.0f, paired);  // gradient w.r.t. the normalised row
        float w[8], xh[8];
        load8(w, weight + v * 8);
        unpack8(xh, x_raw[k]);
#pragma unroll
        for (int i = 0; i < 8; ++i) dot += g[k][i] * w[i] * (xh[i] * r);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) g[k][i] = 0.0f;
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
        float w[8], xh[8], d[8];
        load8(w, weight + v * 8);
        unpack8(xh, x_raw[k]);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          xh[i] *= r;
          d[i] = r * (g[k][i] * w[i] - xh[i] * mean_dot);
          dw[k][i] += g[k][i] * xh[i];
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

// Shapes, then pointers: bf16 rows (C = H·D, a multiple of 8) move as 16-byte
// vectors, so bf16 base pointers must be 16-byte aligned; the table is read as float2.
void check_shape(const char* op, int64_t B, int64_t T, int64_t H, int64_t D, const float2* table) {
  require(B >= 0 && T > 0 && H > 0 && D > 0 && D % 2 == 0, op, "need B ≥ 0, T, H > 0 and an even head dim D");
  require_ptr(table, 8, op, "table (rope_table_init)");
}

// rotate8_paired's condition: 8-channel vectors never straddle a half head, and the
// table's float4 loads are aligned (its rows are D/2 pairs = 4·D bytes).
bool pairs_contiguous(int64_t D, const float2* table) {
  return D % 16 == 0 && (reinterpret_cast<uintptr_t>(table) & 15) == 0;
}

// The rows the norm runs over: the whole projection (N = B·T rows of C = H·D, one per
// token) or each head (N = B·T·H rows of C = D, H per token). Either way a row holds
// whole heads, and row n's position is n / rows_per_token mod T.
struct NormRows {
  int64_t N, C;
  int rows_per_token;
};
NormRows whole_rows(int64_t B, int64_t T, int64_t H, int64_t D) { return {B * T, H * D, 1}; }
NormRows head_rows(int64_t B, int64_t T, int64_t H, int64_t D) { return {B * T * H, D, static_cast<int>(H)}; }

void forward_rows(const char* op, const NormRows& r, bf16* out, float* rstd, const bf16* inp, const bf16* weight,
                  const float2* table, int64_t B, int64_t T, int64_t H, int64_t D, float eps, cudaStream_t stream) {
  check_shape(op, B, T, H, D, table);
  require_ptr(out, 16, op, "out");
  require_ptr(rstd, 4, op, "rstd");
  require_ptr(inp, 16, op, "inp");
  require_ptr(weight, 16, op, "weight");
  require(static_cast<const void*>(out) != static_cast<const void*>(inp), op, "out must not alias inp");
  const RowLayout l = rope_layout(r.C, op);
  if (r.N == 0) return;
  const int stride = smem_row_floats(r.C);
  const size_t smem = size_t(l.ty) * stride * sizeof(float);
  const dim3 block(l.tx, l.ty);
  const unsigned grid = static_cast<unsigned>(ceil_div(r.N, l.ty));
  const int c = static_cast<int>(r.C), d = static_cast<int>(D), rpt = r.rows_per_token;
  const int64_t N = r.N;
  const bool paired = pairs_contiguous(D, table);
  switch (l.vpt) {
    case 1: launch(qknorm_rope_forward_kernel<1>, grid, block, smem, stream, out, rstd, inp, weight, table, N, c, T, rpt, d, eps, stride, paired); break;
    case 2: launch(qknorm_rope_forward_kernel<2>, grid, block, smem, stream, out, rstd, inp, weight, table, N, c, T, rpt, d, eps, stride, paired); break;
    default: launch(qknorm_rope_forward_kernel<4>, grid, block, smem, stream, out, rstd, inp, weight, table, N, c, T, rpt, d, eps, stride, paired); break;
  }
  cuda_check_launch();
}

size_t backward_scratch_rows(const char* op, const NormRows& r) {
  const RowLayout l = rope_layout(r.C, op);
  if (r.N == 0) return 0;
  const size_t smem = size_t(l.ty) * smem_row_floats(r.C) * sizeof(float);
  return static_cast<size_t>(backward_blocks(l, smem, r.N)) * r.C * sizeof(float);
}

void backward_rows(const char* op, const NormRows& r, bf16* dinp, float* dweight, void* scratch, const bf16* dout,
                   const bf16* inp, const bf16* weight, const float* rstd, const float2* table, int64_t B, int64_t T,
                   int64_t H, int64_t D, cudaStream_t stream) {
  check_shape(op, B, T, H, D, table);
  require_ptr(dinp, 16, op, "dinp");
  norm::check_dweight_args(op, dweight, scratch, "the op's *_backward_scratch_bytes");
  require_ptr(dout, 16, op, "dout");
  require_ptr(inp, 16, op, "inp");
  require_ptr(weight, 16, op, "weight");
  require_ptr(rstd, 4, op, "rstd");
  const size_t bytes = size_t(r.N * r.C) * sizeof(bf16);
  require_disjoint(dinp, bytes, dout, bytes, op, "dout must not overlap dinp");
  require_disjoint(dinp, bytes, inp, bytes, op, "inp must not overlap dinp");
  const RowLayout l = rope_layout(r.C, op);
  if (r.N == 0) return;
  const int stride = smem_row_floats(r.C);
  const size_t smem = size_t(l.ty) * stride * sizeof(float);
  const int G = backward_blocks(l, smem, r.N);
  float* partial = dweight ? static_cast<float*>(scratch) : nullptr;
  const dim3 block(l.tx, l.ty);
  const int c = static_cast<int>(r.C), d = static_cast<int>(D), rpt = r.rows_per_token;
  const int64_t N = r.N;
  const bool paired = pairs_contiguous(D, table);
  switch (l.vpt) {
    case 1: launch(qknorm_rope_backward_kernel<1>, G, block, smem, stream, dinp, partial, dout, inp, weight, rstd, table, N, c, T, rpt, d, stride, paired); break;
    case 2: launch(qknorm_rope_backward_kernel<2>, G, block, smem, stream, dinp, partial, dout, inp, weight, rstd, table, N, c, T, rpt, d, stride, paired); break;
    default: launch(qknorm_rope_backward_kernel<4>, G, block, smem, stream, dinp, partial, dout, inp, weight, rstd, table, N, c, T, rpt, d, stride, paired); break;
  }
  cuda_check_launch();
  if (dweight) norm::launch_dweight_reduce(dweight, partial, G, r.C, stream);
}

}  // namespace

size_t rope_table_bytes(int64_t T, int64_t D) { return static_cast<size_t>(T * (D / 2)) * sizeof(float2); }

void rope_table_init(float2* table, int64_t T, int64_t D, double theta, cudaStream_t stream) {
  require(T > 0 && D > 0 && D % 2 == 0 && theta > 0, "rope_table_init", "need T > 0, an even D > 0, theta > 0");
  require_ptr(table, 8, "rope_table_init", "table");
  const int64_t n = T * (D / 2);
  launch(rope_table_kernel, static_cast<unsigned>(ceil_div(n, 256)), 256, 0, stream, table, T, static_cast<int>(D),
         theta);
  cuda_check_launch();
}

void qknorm_rope_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight, const float2* table,
                         int64_t B, int64_t T, int64_t H, int64_t D, float eps, cudaStream_t stream) {
  forward_rows("qknorm_rope_forward", whole_rows(B, T, H, D), out, rstd, inp, weight, table, B, T, H, D, eps, stream);
}

size_t qknorm_rope_backward_scratch_bytes(int64_t B, int64_t T, int64_t H, int64_t D) {
  return backward_scratch_rows("qknorm_rope_backward", whole_rows(B, T, H, D));
}

void qknorm_rope_backward(bf16* dinp, float* dweight, void* scratch, const bf16* dout, const bf16* inp,
                          const bf16* weight, const float* rstd, const float2* table, int64_t B, int64_t T, int64_t H,
                          int64_t D, cudaStream_t stream) {
  backward_rows("qknorm_rope_backward", whole_rows(B, T, H, D), dinp, dweight, scratch, dout, inp, weight, rstd, table,
                B, T, H, D, stream);
}

void qknorm_head_rope_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight, const float2* table,
                              int64_t B, int64_t T, int64_t H, int64_t D, float eps, cudaStream_t stream) {
  forward_rows("qknorm_head_rope_forward", head_rows(B, T, H, D), out, rstd, inp, weight, table, B, T, H, D, eps,
               stream);
}

size_t qknorm_head_rope_backward_scratch_bytes(int64_t B, int64_t T, int64_t H, int64_t D) {
  return backward_scratch_rows("qknorm_head_rope_backward", head_rows(B, T, H, D));
}

void qknorm_head_rope_backward(bf16* dinp, float* dweight, void* scratch, const bf16* dout, const bf16* inp,
                               const bf16* weight, const float* rstd, const float2* table, int64_t B, int64_t T,
                               int64_t H, int64_t D, cudaStream_t stream) {
  backward_rows("qknorm_head_rope_backward", head_rows(B, T, H, D), dinp, dweight, scratch, dout, inp, weight, rstd,
                table, B, T, H, D, stream);
}

}  // namespace spes::cuda
