// Dispatch / combine kernels and the MoE layer. See moe.cuh for the contract.
//
// The expert GEMMs. Expert e's rows are the contiguous slots [offsets[e],
// offsets[e+1]), so every expert product is a plain dense GEMM on a row range, with
// no gather inside the GEMM; what varies is only M per expert. cuBLAS needs those M
// on the host, hence one small D2H copy and one host wait per layer forward (moe.cuh,
// MoeLayer::forward). Two ways to issue the E GEMMs of a product, both timed by
// bench_moe (figures in bench/RESULTS.md):
//  - per_expert: one cublasGemmEx per expert and product;
//  - grouped: one cublasGemmGroupedBatchedEx per product over all experts, which the
//    model uses (model/gpu/gpu_model.cuh, kModelExpertGemm): fewer host calls when
//    every micro-batch routes differently.
// Not cuda::Gemm (cuBLASLt): it caches one plan per exact shape, M included, which
// fits fixed model shapes but would grow without bound as per-expert M varies from
// step to step; cublasGemmEx keeps its own heuristic cache.
#include <cublas_v2.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>

#include "cuda/check.cuh"
#include "cuda/launch.cuh"
#include "cuda/moe.cuh"
#include "cuda/router.cuh"
#include "cuda/runtime.cuh"
#include "cuda/swiglu.cuh"

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

// ---- the MoE layer's GEMMs -----------------------------------------------------------------
namespace {

// Pointer slots per GEMM site for ExpertGemm::grouped: ≤ 2 ops per expert, 3 pointers each.
int64_t ptrs_per_site(int64_t E) { return 3 * 2 * E; }
constexpr int kNumSites = 7;

// Row-major C[M,N] (ldc) = op(A)[M,K] · op(B)[K,N] (+ beta·C), A/B row-major with
// leading dims lda/ldb, as the column-major product Cᵀ = op(B)ᵀ·op(A)ᵀ.
struct RowMajor {
  bool ta, tb;
  int64_t M, N, K;
  const void* A;
  int64_t lda;
  const void* B;
  int64_t ldb;
  void* C;
  int64_t ldc;
  float beta;
};

void gemm_ex(cublasHandle_t handle, const RowMajor& g, cudaDataType_t ctype) {
  const float alpha = 1.0f;
  cublas_check(cublasGemmEx(handle, g.tb ? CUBLAS_OP_T : CUBLAS_OP_N, g.ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                            static_cast<int>(g.N), static_cast<int>(g.M), static_cast<int>(g.K), &alpha,
                            g.B, CUDA_R_16BF, static_cast<int>(g.ldb), g.A, CUDA_R_16BF,
                            static_cast<int>(g.lda), &g.beta, g.C, ctype, static_cast<int>(g.ldc),
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

int64_t moe_gemm_pointer_count(int64_t E) { return kNumSites * ptrs_per_site(E); }

// ---- MoeLayer ------------------------------------------------------------------------------

MoeLayer::MoeLayer(const MoeShape& shape, ExpertGemm gemm, MoeWeights weights, MoeGrads grads,
                   MoeSaved saved, MoeScratch scratch)
    : shape_(shape), gemm_(gemm), w_(std::move(weights)), g_(std::move(grads)), saved_(saved),
      scratch_(scratch) {
  static_assert(kSites == kNumSites);
  const int64_t E = shape_.n_experts, H = shape_.hidden, d = shape_.d_model;
  if (shape_.tokens < 1 || d < 1 || H < 1 || E < 1 || E > kRouterMaxExperts || shape_.top_k < 1 ||
      shape_.top_k > std::min<int64_t>(E, kRouterMaxTopK))
    throw Error("MoeLayer: unsupported shape (N=" + std::to_string(shape_.tokens) + ", d=" + std::to_string(d) +
                ", E=" + std::to_string(E) + ", K=" + std::to_string(shape_.top_k) + ", H=" + std::to_string(H) + ")");
  if (shape_.slots() > INT32_MAX || 2 * H > INT32_MAX || d > INT32_MAX)
    throw Error("MoeLayer: sizes exceed cuBLAS int range");
  auto sized = [E](size_t n) { return n == static_cast<size_t>(E); };
  if (w_.router == nullptr || !sized(w_.gate.size()) || !sized(w_.up.size()) || !sized(w_.down.size()))
    throw Error("MoeLayer: weights need the router and E gate/up/down pointers");
  if (!sized(g_.gate.size()) || !sized(g_.up.size()) || !sized(g_.down.size()))
    throw Error("MoeLayer: grads need E gate/up/down pointers (null for frozen experts)");
  owned_.resize(E);
  gate_up_fused_.resize(E);
  grad_fused_.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    if (w_.gate[e] == nullptr || w_.up[e] == nullptr || w_.down[e] == nullptr)
      throw Error("MoeLayer: expert " + std::to_string(e) + " has a null weight");
    const int n_null = (g_.gate[e] == nullptr) + (g_.up[e] == nullptr) + (g_.down[e] == nullptr);
    if (n_null != 0 && n_null != 3)
      throw Error("MoeLayer: expert " + std::to_string(e) +
                  " is partly frozen (gate/up/down gradients must be all set or all null)");
    owned_[e] = n_null == 0;
    gate_up_fused_[e] = w_.up[e] == w_.gate[e] + H * d;
    grad_fused_[e] = owned_[e] && g_.up[e] == g_.gate[e] + H * d;
  }
  for (auto& site : sites_) {
    site.ops.reserve(2 * E);
    for (auto* v : {&site.m, &site.n, &site.k, &site.lda, &site.ldb, &site.ldc, &site.group_size})
      v->reserve(2 * E);
    site.transa.reserve(2 * E);
    site.transb.reserve(2 * E);
    site.alpha.reserve(2 * E);
    site.beta.reserve(2 * E);
  }
  sites_[kBwdDownGrad].c_fp32 = true;
  sites_[kBwdGateUpGrad].c_fp32 = true;
  offsets_.assign(E + 1, 0);

  pinned_offsets_ = PinnedBuffer<int32_t>(size_t(E + 1));
  pinned_ptrs_ = PinnedBuffer<void*>(size_t(moe_gemm_pointer_count(E)));
  cuda_check(cudaEventCreateWithFlags(&offsets_ready_, cudaEventDisableTiming));
  cuda_check(cudaEventCreateWithFlags(&ptrs_uploaded_, cudaEventDisableTiming));
}

MoeLayer::~MoeLayer() {
  if (offsets_ready_ != nullptr) cudaEventDestroy(offsets_ready_);
  if (ptrs_uploaded_ != nullptr) cudaEventDestroy(ptrs_uploaded_);
}

// All GEMMs of this step's forward and backward, from the host offsets. Expert e's
// rows: [o, o + m) of xe / gu / h / ye / dye / dgu. Zero-row experts are skipped.
void MoeLayer::plan_gemms() {
  const int64_t E = shape_.n_experts, H = shape_.hidden, d = shape_.d_model;
  for (auto& site : sites_) site.ops.clear();
  auto add = [this](Site s, const RowMajor& g) {
    sites_[s].ops.push_back(GemmOp{g.tb ? CUBLAS_OP_T : CUBLAS_OP_N, g.ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                   static_cast<int>(g.N), static_cast<int>(g.M), static_cast<int>(g.K),
                                   g.B, static_cast<int>(g.ldb), g.A, static_cast<int>(g.lda), g.C,
                                   static_cast<int>(g.ldc), g.beta});
  };
  for (int64_t e = 0; e < E; ++e) {
    const int64_t o = offsets_[e], m = offsets_[e + 1] - offsets_[e];
    if (m == 0) continue;
    const bf16* xe = saved_.xe + o * d;
    bf16* gu = saved_.gu + o * 2 * H;
    bf16* h = scratch_.h + o * H;  // h (fwd); dh then recomputed h (bwd)
    bf16* ye = saved_.ye + o * d;
    bf16* dye = scratch_.dye + o * d;  // dye, then overwritten by dxe
    bf16* dgu = scratch_.dgu + o * 2 * H;
    const bf16 *wg = w_.gate[e], *wu = w_.up[e], *wd = w_.down[e];
    // forward: gu = xe·[Wg;Wu]ᵀ, ye = h·Wdᵀ
    if (gate_up_fused_[e]) {
      add(kFwdGateUp, {false, true, m, 2 * H, d, xe, d, wg, d, gu, 2 * H, 0.0f});
    } else {
      add(kFwdGateUp, {false, true, m, H, d, xe, d, wg, d, gu, 2 * H, 0.0f});
      add(kFwdGateUp, {false, true, m, H, d, xe, d, wu, d, gu + H, 2 * H, 0.0f});
    }
    add(kFwdDown, {false, true, m, d, H, h, H, wd, H, ye, d, 0.0f});
    // backward: dh = dye·Wd; dWd += dyeᵀ·h; dxe = dgu·[Wg;Wu]; d[Wg;Wu] += dguᵀ·xe
    add(kBwdDh, {false, false, m, H, d, dye, d, wd, H, h, H, 0.0f});
    if (owned_[e]) add(kBwdDownGrad, {true, false, d, H, m, dye, d, h, H, g_.down[e], H, 1.0f});
    if (gate_up_fused_[e]) {
      add(kBwdDxe, {false, false, m, d, 2 * H, dgu, 2 * H, wg, d, dye, d, 0.0f});
    } else {
      add(kBwdDxe, {false, false, m, d, H, dgu, 2 * H, wg, d, dye, d, 0.0f});
      add(kBwdDxeUp, {false, false, m, d, H, dgu + H, 2 * H, wu, d, dye, d, 1.0f});
    }
    if (owned_[e]) {
      if (grad_fused_[e]) {
        add(kBwdGateUpGrad, {true, false, 2 * H, d, m, dgu, 2 * H, xe, d, g_.gate[e], d, 1.0f});
      } else {
        add(kBwdGateUpGrad, {true, false, H, d, m, dgu, 2 * H, xe, d, g_.gate[e], d, 1.0f});
        add(kBwdGateUpGrad, {true, false, H, d, m, dgu + H, 2 * H, xe, d, g_.up[e], d, 1.0f});
      }
    }
  }
  if (gemm_ != ExpertGemm::grouped) return;
  for (auto& site : sites_) {
    site.transa.clear(), site.transb.clear(), site.m.clear(), site.n.clear(), site.k.clear();
    site.lda.clear(), site.ldb.clear(), site.ldc.clear(), site.group_size.clear();
    site.alpha.clear(), site.beta.clear();
    for (const GemmOp& op : site.ops) {
      site.transa.push_back(op.transa);
      site.transb.push_back(op.transb);
      site.m.push_back(op.m);
      site.n.push_back(op.n);
      site.k.push_back(op.k);
      site.lda.push_back(op.lda);
      site.ldb.push_back(op.ldb);
      site.ldc.push_back(op.ldc);
      site.group_size.push_back(1);
      site.alpha.push_back(1.0f);
      site.beta.push_back(op.beta);
    }
  }
}

// Site s's pointer arrays live at gemm_ptrs + s·ptrs_per_site: A[2E], B[2E], C[2E].
void MoeLayer::upload_pointer_arrays(cudaStream_t stream) {
  const int64_t per_site = ptrs_per_site(shape_.n_experts), third = per_site / 3;
  // The previous upload must have left the staging buffer before we rewrite it.
  cuda_check(cudaEventSynchronize(ptrs_uploaded_));
  void** staging = pinned_ptrs_.data();
  for (int s = 0; s < kSites; ++s) {
    void** base = staging + s * per_site;
    const auto& ops = sites_[s].ops;
    for (size_t i = 0; i < ops.size(); ++i) {
      base[i] = const_cast<void*>(ops[i].a);
      base[third + i] = const_cast<void*>(ops[i].b);
      base[2 * third + i] = ops[i].c;
    }
  }
  cuda_check(cudaMemcpyAsync(saved_.gemm_ptrs, staging, sizeof(void*) * kSites * per_site,
                             cudaMemcpyHostToDevice, stream));
  cuda_check(cudaEventRecord(ptrs_uploaded_, stream));
}

namespace {
// The statuses cuBLAS returns from its argument checks, before any launch.
bool grouped_refusal(cublasStatus_t status) {
  return status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE ||
         status == CUBLAS_STATUS_ARCH_MISMATCH;
}
}  // namespace

void MoeLayer::run_site(cublasHandle_t handle, Site s) {
  const GemmSite& site = sites_[s];
  if (site.ops.empty()) return;
  const cudaDataType_t ctype = site.c_fp32 ? CUDA_R_32F : CUDA_R_16BF;
  if (gemm_ == ExpertGemm::grouped && !grouped_fallback_[s]) {
    const int64_t per_site = ptrs_per_site(shape_.n_experts), third = per_site / 3;
    void** base = saved_.gemm_ptrs + s * per_site;
    const cublasStatus_t status = cublasGemmGroupedBatchedEx(
        handle, site.transa.data(), site.transb.data(), site.m.data(), site.n.data(), site.k.data(),
        site.alpha.data(), base, CUDA_R_16BF, site.lda.data(), base + third, CUDA_R_16BF, site.ldb.data(),
        site.beta.data(), base + 2 * third, ctype, site.ldc.data(), static_cast<int>(site.ops.size()),
        site.group_size.data(), CUBLAS_COMPUTE_32F);
    if (status == CUBLAS_STATUS_SUCCESS) return;
    // Which status a combination the grouped API lacks gets (bf16 A/B with fp32 C, an
    // architecture without grouped kernels) varies with the cuBLAS version:
    // NOT_SUPPORTED, INVALID_VALUE or ARCH_MISMATCH. Those come from the argument
    // checks, before anything is launched, so nothing of this call ran and the
    // per-expert GEMMs below compute the whole site (beta = 1 sites included) exactly
    // once; the site keeps that path for good, so every step takes the same kernels
    // (bitwise resume). Any other status (EXECUTION_FAILED, ALLOC_FAILED, …) may
    // come after some groups ran and added into C: re-running them would count those
    // gradients twice, so it is an error.
    if (!grouped_refusal(status)) cublas_check(status);
    const cudaError_t launch_error = cudaGetLastError();
    if (launch_error != cudaSuccess)
      throw Error(std::string("cublasGemmGroupedBatchedEx refused the call (") + cublasGetStatusString(status) +
                  ") after a launch failed: " + cudaGetErrorString(launch_error));
    grouped_fallback_[s] = true;
    report_grouped_fallback(s, status);
  }
  const float alpha = 1.0f;
  for (const GemmOp& op : site.ops) {
    cublas_check(cublasGemmEx(handle, op.transa, op.transb, op.m, op.n, op.k, &alpha, op.a, CUDA_R_16BF, op.lda,
                              op.b, CUDA_R_16BF, op.ldb, &op.beta, op.c, ctype, op.ldc, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
  }
}

int MoeLayer::grouped_fallback_sites() const {
  int n = 0;
  for (bool b : grouped_fallback_) n += b;
  return n;
}

// One stderr line per site and process (every layer meets the same refusal), so a
// run's log says which path its expert GEMMs actually take.
void MoeLayer::report_grouped_fallback(Site s, cublasStatus_t status) {
  static const char* const kSiteNames[kSites] = {
      "forward gate|up", "forward down", "backward dh", "backward down weight grad (fp32 out)",
      "backward dxe", "backward dxe (separate up)", "backward gate|up weight grad (fp32 out)"};
  static std::atomic<bool> reported[kSites] = {};
  if (reported[s].exchange(true)) return;
  std::fprintf(stderr,
               "spes-engine: MoE grouped GEMM, site '%s': cublasGemmGroupedBatchedEx returned %s (%s); this site "
               "runs one cublasGemmEx per expert from now on\n",
               kSiteNames[s], cublasGetStatusName(status), cublasGetStatusString(status));
}

// cublasSetStream also resets a workspace set with cublasSetWorkspace, so the handle
// is only touched when it is not already bound to this stream.
void MoeLayer::bind(cublasHandle_t handle, cudaStream_t stream) {
  cudaStream_t current = nullptr;
  cublas_check(cublasGetStream(handle, &current));
  if (current != stream) cublas_check(cublasSetStream(handle, stream));
  cublasPointerMode_t mode;
  cublas_check(cublasGetPointerMode(handle, &mode));
  if (mode != CUBLAS_POINTER_MODE_HOST) cublas_check(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
}

void MoeLayer::forward(cublasHandle_t handle, bf16* out, const bf16* x, const float* count_scale,
                       cudaStream_t stream) {
  const int64_t N = shape_.tokens, E = shape_.n_experts, K = shape_.top_k, S = shape_.slots();
  const int64_t d = shape_.d_model, H = shape_.hidden;
  bind(handle, stream);

  // Router: fp32 logits straight into probs, which router_forward overwrites in place.
  gemm_ex(handle, {false, true, N, E, d, x, d, w_.router, d, saved_.probs, E, 0.0f}, CUDA_R_32F);
  router_forward(saved_.probs, saved_.lse, saved_.topk_idx, saved_.topk_w, scratch_.router_partials,
                 saved_.probs, N, E, K, shape_.renorm, stream);
  moe_dispatch_indices(saved_.offsets, saved_.slot_token, saved_.token_slot, scratch_.dispatch,
                       saved_.topk_idx, N, E, K, stream);
  cuda_check(cudaMemcpyAsync(pinned_offsets_.data(), saved_.offsets, sizeof(int32_t) * (E + 1),
                             cudaMemcpyDeviceToHost, stream));
  cuda_check(cudaEventRecord(offsets_ready_, stream));
  // Work that needs no host counts, queued before the wait so the GPU stays busy.
  router_aux_forward(saved_.aux, saved_.lb_weight, scratch_.router_partials, saved_.offsets, count_scale,
                     N, E, K, stream);
  moe_gather_forward(saved_.xe, x, saved_.slot_token, S, d, stream);

  cuda_check(cudaEventSynchronize(offsets_ready_));
  std::memcpy(offsets_.data(), pinned_offsets_.data(), sizeof(int32_t) * (E + 1));
  for (int64_t e = 0; e < E; ++e)
    if (offsets_[e + 1] < offsets_[e])
      throw Error("MoeLayer: device dispatch produced non-monotone offsets (kernel bug)");
  if (offsets_[0] != 0 || offsets_[E] != S)
    throw Error("MoeLayer: device dispatch offsets do not cover N·K slots (kernel bug)");
  plan_gemms();
  if (gemm_ == ExpertGemm::grouped) upload_pointer_arrays(stream);
  have_forward_ = true;

  run_site(handle, kFwdGateUp);
  swiglu_forward(scratch_.h, saved_.gu, saved_.gu + H, S, H, 2 * H, stream);
  run_site(handle, kFwdDown);
  moe_combine_forward(out, saved_.ye, saved_.topk_w, saved_.token_slot, N, K, d, stream);
}

void MoeLayer::backward(cublasHandle_t handle, bf16* dx, const bf16* dout, const bf16* x, float lb_loss_scale,
                        float rz_loss_scale, cudaStream_t stream) {
  if (!have_forward_) throw Error("MoeLayer::backward called before forward");
  const int64_t N = shape_.tokens, E = shape_.n_experts, K = shape_.top_k, S = shape_.slots();
  const int64_t d = shape_.d_model, H = shape_.hidden;
  bind(handle, stream);

  moe_combine_backward(scratch_.dye, scratch_.dtopk_w, dout, saved_.ye, saved_.topk_w, saved_.token_slot,
                       N, K, d, stream);
  run_site(handle, kBwdDh);  // dh into scratch.h
  // dgu from dh, and h recomputed in place of dh for the down-weight gradient.
  swiglu_backward(scratch_.dgu, scratch_.dgu + H, scratch_.h, scratch_.h, saved_.gu, saved_.gu + H, S, H,
                  2 * H, stream);
  run_site(handle, kBwdDownGrad);  // owned experts only
  run_site(handle, kBwdDxe);       // dxe overwrites dye (consumed above)
  run_site(handle, kBwdDxeUp);
  run_site(handle, kBwdGateUpGrad);  // owned experts only
  moe_gather_backward(dx, scratch_.dye, saved_.token_slot, N, K, d, stream);

  router_backward(scratch_.dlogits, scratch_.dtopk_w, saved_.probs, saved_.lse, saved_.topk_idx,
                  saved_.topk_w, saved_.lb_weight, lb_loss_scale, rz_loss_scale / float(N), N, E, K,
                  shape_.renorm, stream);
  // dx += dlogits·Wr; dWr += dlogitsᵀ·x.
  gemm_ex(handle, {false, false, N, d, E, scratch_.dlogits, E, w_.router, d, dx, d, 1.0f}, CUDA_R_16BF);
  if (g_.router != nullptr)
    gemm_ex(handle, {true, false, E, d, N, scratch_.dlogits, E, x, d, g_.router, d, 1.0f}, CUDA_R_32F);
}

}  // namespace spes::cuda
