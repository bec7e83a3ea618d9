// Token-routed experts on the device (README, Architecture: "The model", "Ownership"):
// dropless dispatch / combine kernels (semantics: cpu::moe_dispatch_indices,
// moe_gather_*, moe_combine_*), and MoeLayer, the whole MoE block of one layer:
//   logits = x·Wrᵀ → router → dispatch → gather → per-expert gate/up GEMMs → SwiGLU
//   → per-expert down GEMMs → weighted combine,
// plus its backward, where frozen (not owned) experts get activation gradients only.
//
// Precision (README, Architecture: "Precision and determinism"): bf16 activations and weights, fp32 GEMM accumulation, fp32
// router math, fp32 weight gradients accumulated with += (beta = 1) so micro-batches
// accumulate like the CPU reference.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/runtime.cuh"

namespace spes::cuda {

// ---- dispatch / combine kernels -------------------------------------------------
// Slots s ∈ [0, S = N·K) are ordered by expert, then token, then k; expert e owns
// [offsets[e], offsets[e+1]). Computed by counts → scan → rank, all on the device and
// without relying on atomic ordering (only integer counts use atomics), so the
// permutation is exactly the CPU's. Requires topk_idx ∈ [0, E), E ≤ 1024.

// int32 elements of scratch that moe_dispatch_indices needs.
int64_t moe_dispatch_scratch_count(int64_t N, int64_t E, int64_t K);
void moe_dispatch_indices(int32_t* offsets, int32_t* slot_token, int32_t* token_slot, int32_t* scratch,
                          const int32_t* topk_idx, int64_t N, int64_t E, int64_t K,
                          cudaStream_t stream);
// xe[s] = x[slot_token[s]], rows of C.
void moe_gather_forward(bf16* xe, const bf16* x, const int32_t* slot_token, int64_t S, int64_t C,
                        cudaStream_t stream);
// dx[t] = Σ_k dxe[token_slot[t·K+k]] (fp32 sum in k order; each token sums its own
// K rows, so no atomics).
void moe_gather_backward(bf16* dx, const bf16* dxe, const int32_t* token_slot, int64_t N, int64_t K,
                         int64_t C, cudaStream_t stream);
// out[t] = Σ_k topk_w[t,k]·ye[token_slot[t·K+k]] (fp32 sum in k order).
void moe_combine_forward(bf16* out, const bf16* ye, const float* topk_w, const int32_t* token_slot,
                         int64_t N, int64_t K, int64_t C, cudaStream_t stream);
// dye[slot(t,k)] = topk_w[t,k]·dout[t]; dtopk_w[t,k] = dout[t]·ye[slot(t,k)] (fp32,
// fixed-order warp reduction).
void moe_combine_backward(bf16* dye, float* dtopk_w, const bf16* dout, const bf16* ye,
                          const float* topk_w, const int32_t* token_slot, int64_t N, int64_t K,
                          int64_t C, cudaStream_t stream);

// ---- the MoE layer ----------------------------------------------------------------

struct MoeShape {
  int64_t tokens = 0;     // N = B·T of the micro-batch
  int64_t d_model = 0;    // d
  int64_t n_experts = 0;  // E (≤ 256)
  int64_t top_k = 0;      // K
  int64_t hidden = 0;     // H, expert hidden size
  bool renorm = false;    // norm_topk_prob
  int64_t slots() const { return tokens * top_k; }
};

// How the per-expert GEMMs over variable token counts are issued. Both need the
// counts on the host (see MoeLayer::forward); bench_moe times both.
//  per_expert: one cublasGemmEx per (expert, product); zero-token experts skipped.
//  grouped:    one cublasGemmGroupedBatchedEx per product over all non-empty experts
//              (device pointer arrays built on the host once per forward).
enum class ExpertGemm { per_expert, grouped };

// Weights in the flat parameter buffer (compute precision). Per expert e:
// gate[e], up[e]: [H, d]; down[e]: [d, H] (HF [out, in]). When up[e] == gate[e] + H·d
// (the layout's order) gate and up run as one GEMM with N = 2H.
struct MoeWeights {
  const bf16* router = nullptr;  // [E, d]
  std::vector<const bf16*> gate, up, down;
};

// fp32 weight gradients, accumulated (+=). An expert is frozen iff its three pointers
// are null: it gets no weight-gradient GEMM and needs no gradient buffer. router may
// be null (frozen router, e.g. for tests).
struct MoeGrads {
  float* router = nullptr;
  std::vector<float*> gate, up, down;
};

// Activations kept from forward to backward (one set per layer), in buffers the
// caller plans (model/gpu_memory.hpp names them).
struct MoeSaved {
  float* probs = nullptr;         // [N, E] fp32 (the router logits land here first)
  float* lse = nullptr;           // [N]
  int32_t* topk_idx = nullptr;    // [N, K]
  float* topk_w = nullptr;        // [N, K]
  int32_t* offsets = nullptr;     // [E+1]
  int32_t* slot_token = nullptr;  // [S]
  int32_t* token_slot = nullptr;  // [S]
  float* lb_weight = nullptr;     // [E] (router_aux_forward)
  float* aux = nullptr;           // [2]: this layer's LB and RZ (unscaled)
  bf16* xe = nullptr;             // [S, d] gathered input
  bf16* gu = nullptr;             // [S, 2H] gate | up pre-activations
  bf16* ye = nullptr;             // [S, d] expert outputs
  void** gemm_ptrs = nullptr;     // [moe_gemm_pointer_count(E)]: device pointer arrays for ExpertGemm::grouped
};

// Per-step temporaries; one set can serve every layer.
struct MoeScratch {
  float* router_partials = nullptr;  // router_partials_count(N, E)
  int32_t* dispatch = nullptr;       // moe_dispatch_scratch_count(N, E, K)
  bf16* h = nullptr;                 // [S, H]: h (fwd); dh, then h recomputed (bwd)
  bf16* dye = nullptr;               // [S, d]: dye, then dxe (bwd)
  bf16* dgu = nullptr;               // [S, 2H]
  float* dtopk_w = nullptr;          // [N, K]
  bf16* dlogits = nullptr;           // [N, E]
};

// The device pointers MoeSaved::gemm_ptrs holds for E experts.
int64_t moe_gemm_pointer_count(int64_t E);

class MoeLayer {
 public:
  // Checks shapes and pointer tables; allocates only small host state (pinned
  // staging, an event). Buffers are the caller's, planned up front.
  MoeLayer(const MoeShape& shape, ExpertGemm gemm, MoeWeights weights, MoeGrads grads, MoeSaved saved,
           MoeScratch scratch);
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  // out[N, d] = MoE(x). count_scale: device [E] per-expert factor on the LB counts
  // (SPES decayed aux loss), null = 1. The layer's LB and RZ land in saved.aux.
  //
  // Host sync: cuBLAS (plain and grouped) takes GEMM sizes from host memory, so the
  // E+1 offsets are copied device→host once per layer forward and the host waits on
  // an event right after enqueueing the aux-loss and gather kernels, which keep the
  // GPU busy while the host plans the GEMMs. Backward reuses the host offsets and
  // does not sync. The cost is one host round trip per layer forward (the GPU idles
  // for roughly one kernel launch latency) and that forward cannot be captured in a
  // CUDA graph; the alternative — a grouped GEMM reading the offsets on the device —
  // means our own GEMM kernel, not justified until the bench shows the gap.
  void forward(cublasHandle_t handle, bf16* out, const bf16* x, const float* count_scale,
               cudaStream_t stream);

  // dx[N, d] (overwritten) from dout[N, d]; x is the forward input. The loss holds
  // this layer as lb_loss_scale·LB + rz_loss_scale·RZ (e.g. lb_coef / n_layers).
  // Weight gradients of the router and the owned experts are accumulated.
  void backward(cublasHandle_t handle, bf16* dx, const bf16* dout, const bf16* x, float lb_loss_scale,
                float rz_loss_scale, cudaStream_t stream);

  // Expert offsets[E+1] of the last forward (host copy), e.g. for load metrics.
  std::span<const int32_t> expert_offsets() const { return offsets_; }
  const MoeSaved& saved() const { return saved_; }
  // ExpertGemm::grouped only: how many of this layer's GEMM sites run per expert
  // because cublasGemmGroupedBatchedEx refused them (any non-success status, e.g.
  // for the bf16-in / fp32-out weight gradients). A site falls back at its first
  // refusal, says so once per process on stderr, and never retries the grouped call.
  int grouped_fallback_sites() const;

 private:
  // One cuBLAS (column-major) product C = op(A)·op(B) + beta·C, alpha = 1.
  struct GemmOp {
    cublasOperation_t transa, transb;
    int m, n, k;
    const void* a;
    int lda;
    const void* b;
    int ldb;
    void* c;
    int ldc;
    float beta;
  };
  // The GEMMs of one step of the layer; all ops of a site are independent (disjoint
  // outputs), so a site is one grouped call.
  enum Site { kFwdGateUp, kFwdDown, kBwdDh, kBwdDownGrad, kBwdDxe, kBwdDxeUp, kBwdGateUpGrad, kSites };
  struct GemmSite {
    bool c_fp32 = false;
    std::vector<GemmOp> ops;
    // Host-side arrays of cublasGemmGroupedBatchedEx (one group per op).
    std::vector<cublasOperation_t> transa, transb;
    std::vector<int> m, n, k, lda, ldb, ldc, group_size;
    std::vector<float> alpha, beta;
  };

  void plan_gemms();
  void upload_pointer_arrays(cudaStream_t stream);
  void run_site(cublasHandle_t handle, Site site);
  static void report_grouped_fallback(Site site, cublasStatus_t status);
  static void bind(cublasHandle_t handle, cudaStream_t stream);

  MoeShape shape_;
  ExpertGemm gemm_;
  MoeWeights w_;
  MoeGrads g_;
  MoeSaved saved_;
  MoeScratch scratch_;
  std::vector<bool> owned_, gate_up_fused_, grad_fused_;
  std::array<GemmSite, kSites> sites_;
  std::array<bool, kSites> grouped_fallback_{};  // site s runs per expert from now on
  std::vector<int32_t> offsets_;  // host copy of the last forward's offsets
  bool have_forward_ = false;

  PinnedBuffer<int32_t> pinned_offsets_;
  PinnedBuffer<void*> pinned_ptrs_;
  cudaEvent_t offsets_ready_ = nullptr;
  cudaEvent_t ptrs_uploaded_ = nullptr;
};

}  // namespace spes::cuda
