// Linear layer without bias: out = inp · weightᵀ, weights stored [out, in] (the HF
// layout, so exports need no transpose). All three products go to OpenBLAS sgemm.
#include <cblas.h>

#include "engine/ops/ops.hpp"

namespace spes::cpu {

void matmul_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC) {
  if (N == 0 || OC == 0) return;  // an expert that received no tokens
  // out[N,OC] = inp[N,C] · weight[OC,C]ᵀ
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(N), static_cast<int>(OC),
              static_cast<int>(C), 1.0f, inp, static_cast<int>(C), weight, static_cast<int>(C), 0.0f,
              out, static_cast<int>(OC));
}

void matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t C, int64_t OC) {
  if (N == 0) return;  // nothing flows back, and dweight += 0 is a no-op
  if (dinp != nullptr) {
    if (OC == 0) {
      for (int64_t i = 0; i < N * C; ++i) dinp[i] = 0.0f;
    } else {
      // dinp[N,C] = dout[N,OC] · weight[OC,C]   (overwrite: beta = 0)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(N),
                  static_cast<int>(C), static_cast<int>(OC), 1.0f, dout, static_cast<int>(OC),
                  weight, static_cast<int>(C), 0.0f, dinp, static_cast<int>(C));
    }
  }
  // Frozen weights (dweight == nullptr) skip this GEMM entirely: the saving SPES is about.
  if (dweight != nullptr && OC > 0) {
    // dweight[OC,C] += dout[N,OC]ᵀ · inp[N,C]   (accumulate: beta = 1)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(OC), static_cast<int>(C),
                static_cast<int>(N), 1.0f, dout, static_cast<int>(OC), inp, static_cast<int>(C), 1.0f,
                dweight, static_cast<int>(C));
  }
}

}  // namespace spes::cpu
