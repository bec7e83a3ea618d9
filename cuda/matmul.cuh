// GEMMs through cuBLASLt: bf16 inputs, fp32 accumulation (CUBLAS_COMPUTE_32F),
// bf16 or fp32 output. Same contract as cpu::matmul_* (model/cpu/ops.hpp):
// row-major, weights stored [out, in], out = inp · weightᵀ.
//
// Epilogues: the model has no biases and no GELU (its experts are SwiGLU), so the
// only fused epilogue that pays is accumulation: beta = 1 adds
// weight gradients into the fp32 grad buffers across micro-batches, and adds an
// activation gradient into one that another branch already wrote.
//
// Each distinct problem (shape, transposes, leading dims, output type, pointer
// alignment) gets its descriptors and a heuristic-chosen algorithm once; later
// calls reuse the cached plan, so the step loop makes no heuristic queries.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>

#include "cuda/common.cuh"

namespace spes::cuda {

enum class DType { bf16, f32 };

class Gemm {
 public:
  // `workspace` is used by every GEMM this object runs, so they must not overlap in
  // time: all run on `stream` (the Runtime's; its cuBLAS handle shares the same
  // workspace on the same stream). run() refuses any other stream.
  Gemm(cublasLtHandle_t lt, void* workspace, size_t workspace_bytes, cudaStream_t stream);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // Column-major, cuBLAS terms: D[m×n] = alpha·op(A)·op(B) + beta·D, op(A) m×k,
  // op(B) k×n; A is stored k×m when transa (lda ≥ k) else m×k (lda ≥ m); B likewise.
  // A, B bf16; D bf16 or fp32 with leading dimension ldd ≥ m.
  void run(bool transa, bool transb, int64_t m, int64_t n, int64_t k, const bf16* A, int64_t lda,
           const bf16* B, int64_t ldb, void* D, DType d_type, int64_t ldd, float alpha, float beta,
           cudaStream_t stream);

  size_t cached_plans() const { return plans_.size(); }

 private:
  // transa, transb, m, n, k, lda, ldb, ldd, d_type, align A, align B, align D
  using Key = std::array<int64_t, 12>;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  const Plan& plan(const Key& key);

  cublasLtHandle_t lt_;
  void* workspace_;
  size_t workspace_bytes_;
  cudaStream_t stream_;  // the only stream that may use workspace_
  std::map<Key, Plan> plans_;
};

// `ldo` (0 = OC) is the row stride, in elements, of out / dout: the lm head's
// [N, 151665] logits should use a stride rounded up to 8 (151672) so that every
// row is 16-byte aligned — odd strides force slow, unvectorised GEMM kernels. An odd
// OC itself (the vocabulary) is run as two products, a 128-aligned body and a tail,
// for the same reason (matmul.cu: aligned_body).
//
// Sizes as in cpu::matmul_*: an empty output (a zero-size dimension of it) is a
// no-op; an empty reduction (C = 0 forward, OC = 0 for dinp, N = 0 for dweight)
// writes zeros, or leaves the output unchanged when accumulating.

// out[N,OC] = inp[N,C] · weight[OC,C]ᵀ; with accumulate, out += that product.
void matmul_forward(Gemm& g, void* out, DType out_type, const bf16* inp, const bf16* weight, int64_t N,
                    int64_t C, int64_t OC, cudaStream_t stream, bool accumulate = false, int64_t ldo = 0);

// dinp[N,C] = dout[N,OC] · weight[OC,C]  (+= with accumulate).
void matmul_backward_input(Gemm& g, void* dinp, DType dinp_type, const bf16* dout, const bf16* weight,
                           int64_t N, int64_t C, int64_t OC, cudaStream_t stream, bool accumulate = false,
                           int64_t ldo = 0);

// dweight[OC,C] (fp32) += doutᵀ · inp; accumulate = false overwrites instead.
void matmul_backward_weight(Gemm& g, float* dweight, const bf16* dout, const bf16* inp, int64_t N,
                            int64_t C, int64_t OC, cudaStream_t stream, bool accumulate = true, int64_t ldo = 0);

// Mirror of cpu::matmul_backward: dinp (nullable, bf16, overwritten) = dout·weight;
// dweight (nullable: frozen weight, no product at all, fp32) += doutᵀ·inp.
void matmul_backward(Gemm& g, bf16* dinp, float* dweight, const bf16* dout, const bf16* inp,
                     const bf16* weight, int64_t N, int64_t C, int64_t OC, cudaStream_t stream);

}  // namespace spes::cuda
