// Linear layer without bias: out = inp · weightᵀ, weights stored [out, in] (the HF
// layout, so exports need no transpose). All three products go to OpenBLAS sgemm.
//
// Threading: OpenBLAS runs single-threaded and OpenMP splits each product into
// fixed blocks of rows, one sgemm per block. Letting OpenBLAS start its own thread
// pool instead made every OpenMP op after a GEMM fight OpenBLAS's spinning threads
// for the cores: on 2 cores rmsnorm fwd+bwd at the tiny config took 23.8 ms instead
// of 0.1 ms. Blocks are fixed in size (not per thread), so the result does not
// depend on the thread count.
#include <cblas.h>

#include <algorithm>

#include "model/cpu/ops.hpp"

namespace spes::cpu {
namespace {

constexpr int64_t kRowBlock = 64;

// Set on every call (it only stores a number) rather than once, so that code
// elsewhere changing OpenBLAS's thread count cannot bring the contention back.
void blas_single_threaded() { openblas_set_num_threads(1); }

int i32(int64_t x) { return static_cast<int>(x); }

// Calls f(first, count) for the fixed kRowBlock-sized blocks of [0, n), in parallel.
template <class F>
void for_row_blocks(int64_t n, F f) {
  const int64_t n_blocks = (n + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < n_blocks; ++blk) f(blk * kRowBlock, std::min(kRowBlock, n - blk * kRowBlock));
}

}  // namespace

void matmul_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC) {
  if (N == 0 || OC == 0) return;  // an expert that received no tokens
  blas_single_threaded();
  for_row_blocks(N, [&](int64_t n0, int64_t rows) {
    // out[rows,OC] = inp[rows,C] · weight[OC,C]ᵀ
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, i32(rows), i32(OC), i32(C), 1.0f,
                inp + n0 * C, i32(C), weight, i32(C), 0.0f, out + n0 * OC, i32(OC));
  });
}

void matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t C, int64_t OC) {
  if (N == 0) return;  // nothing flows back, and dweight += 0 is a no-op
  blas_single_threaded();
  if (dinp != nullptr) {
    if (OC == 0) {
      std::fill(dinp, dinp + N * C, 0.0f);
    } else {
      for_row_blocks(N, [&](int64_t n0, int64_t rows) {
        // dinp[rows,C] = dout[rows,OC] · weight[OC,C]   (overwrite: beta = 0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, i32(rows), i32(C), i32(OC), 1.0f,
                    dout + n0 * OC, i32(OC), weight, i32(C), 0.0f, dinp + n0 * C, i32(C));
      });
    }
  }
  // Frozen weights (dweight == nullptr) skip this GEMM entirely: the saving SPES is about.
  if (dweight != nullptr && OC > 0) {
    // Split over rows of dweight (output channels): each block reduces over all N
    // tokens inside one sgemm, so no cross-thread reduction is needed.
    for_row_blocks(OC, [&](int64_t o0, int64_t rows) {
      // dweight[rows,C] += dout[N, o0:o0+rows]ᵀ · inp[N,C]   (accumulate: beta = 1)
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, i32(rows), i32(C), i32(N), 1.0f,
                  dout + o0, i32(OC), inp, i32(C), 1.0f, dweight + o0 * C, i32(C));
    });
  }
}

}  // namespace spes::cpu
