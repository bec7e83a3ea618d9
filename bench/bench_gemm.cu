// GEMM wrapper (cuBLASLt, cached plan) vs plain cuBLAS (cublasGemmEx, default
// algorithm) on the training shapes: the three products of each projection at
// 16k tokens, d_model 768 and 2048. Goal: wrapper within 5 % of plain cuBLAS.
#include <cstdio>
#include <string>
#include <vector>

#include "bench/common.cuh"
#include "cuda/matmul.cuh"
#include "cuda/runtime.cuh"

using namespace spes::cuda;
using spes::bench::Bench;
using spes::bench::DevBuf;

namespace {

struct Shape {
  const char* name;
  int64_t N, C, OC;
  int64_t ldo = 0;  // row stride of out/dout (0 = OC)
};

// Plain cuBLAS with the same column-major operands as the wrapper.
void plain(cublasHandle_t h, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda,
           const void* B, int64_t ldb, void* D, cudaDataType_t dt, int64_t ldd, float beta) {
  const float alpha = 1.0f;
  cublas_check(cublasGemmEx(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, int(m), int(n), int(k),
                            &alpha, A, CUDA_R_16BF, int(lda), B, CUDA_R_16BF, int(ldb), &beta, D, dt, int(ldd),
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

int main() {
  try {
    Bench b;
    if (!b.ok()) return 0;
    Runtime& rt = b.runtime();
    cudaStream_t s = rt.stream();
    Gemm& g = rt.gemm();
    const std::vector<Shape> shapes = {
        {"qkv  768", 16384, 768, 3 * 768},     {"wo   768", 16384, 768, 768},
        {"exp  768->1024", 16384, 768, 1024},  {"qkv 2048", 16384, 2048, 3 * 2048},
        {"wo  2048", 16384, 2048, 2048},       {"exp 2048->1024", 16384, 2048, 1024},
        // logits rows padded to a multiple of 8 elements (see cuda/matmul.cuh); the wrapper
        // runs the odd vocabulary as a body and a tail (cuda/matmul.cu), plain cuBLAS whole;
        // 151680 = 1185 × 128 is the same product with no odd size anywhere.
        {"lm_head 768", 4096, 768, 151665, 151672}, {"lm_head 2048", 4096, 2048, 151665, 151672},
        {"lm_head 768 V=151680", 4096, 768, 151680, 151680},
    };
    std::printf("(each product: wrapper row, then plain cublasGemmEx row; ratio = wrapper time / plain time)\n");
    for (const Shape& sh : shapes) {
      const int64_t N = sh.N, C = sh.C, OC = sh.OC, ldo = sh.ldo ? sh.ldo : sh.OC;
      DevBuf inp(N * C * 2), w(OC * C * 2), out(N * ldo * 2), dinp(N * C * 2), dw(OC * C * 4);
      spes::bench::fill(inp.as<bf16>(), N * C, s, 1, 0.5f);
      spes::bench::fill(w.as<bf16>(), OC * C, s, 2, 0.05f);
      spes::bench::fill(out.as<bf16>(), N * ldo, s, 3, 0.5f);
      spes::bench::zero(dw.p, OC * C * 4, s);
      const double flops = 2.0 * N * C * OC;
      const std::string size = std::to_string(N) + "x" + std::to_string(C) + "x" + std::to_string(OC);
      const std::string nm = sh.name;
      float a = b.flop_row(nm + " fwd", size, [&] { matmul_forward(g, out.p, DType::bf16, inp.as<bf16>(), w.as<bf16>(), N, C, OC, s, false, ldo); }, flops);
      float p = b.flop_row(nm + " fwd (cuBLAS)", size, [&] { plain(b.cublas(), true, false, OC, N, C, w.p, C, inp.p, C, out.p, CUDA_R_16BF, ldo, 0.0f); }, flops);
      std::printf("    ratio %.3f\n", a / p);
      // the gradient wrt the output is `out` reused as dout
      a = b.flop_row(nm + " bwd dinp", size, [&] { matmul_backward_input(g, dinp.p, DType::bf16, out.as<bf16>(), w.as<bf16>(), N, C, OC, s, false, ldo); }, flops);
      p = b.flop_row(nm + " bwd dinp (cuBLAS)", size, [&] { plain(b.cublas(), false, false, C, N, OC, w.p, C, out.p, ldo, dinp.p, CUDA_R_16BF, C, 0.0f); }, flops);
      std::printf("    ratio %.3f\n", a / p);
      a = b.flop_row(nm + " bwd dweight +=", size, [&] { matmul_backward_weight(g, dw.as<float>(), out.as<bf16>(), inp.as<bf16>(), N, C, OC, s, true, ldo); }, flops);
      p = b.flop_row(nm + " bwd dweight += (cuBLAS)", size, [&] { plain(b.cublas(), false, true, C, OC, N, inp.p, C, out.p, ldo, dw.p, CUDA_R_32F, C, 1.0f); }, flops);
      std::printf("    ratio %.3f\n", a / p);
    }
    std::printf("cached GEMM plans: %zu\n", g.cached_plans());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gemm: %s\n", e.what());
    return 1;
  }
  return 0;
}
