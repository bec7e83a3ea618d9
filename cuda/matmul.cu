#include "cuda/matmul.cuh"

#include <string>

#include "cuda/check.cuh"

namespace spes::cuda {

namespace {

// Largest power of two (≤ 256) dividing the address: what cuBLASLt may assume.
int64_t pointer_alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  int64_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

cudaDataType_t cuda_type(DType t) { return t == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F; }
size_t elem_bytes(DType t) { return t == DType::bf16 ? 2 : 4; }

// Pointer checks of one product, before any CUDA call: the output whenever it is not
// empty; the inputs only when the reduction is not (k = 0 reads nothing).
void check_pointers(const char* op, int64_t out_elems, int64_t k, const void* out, DType out_type,
                    const char* out_name, const bf16* a, const char* a_name, const bf16* b, const char* b_name) {
  if (out_elems == 0) return;
  require_ptr(out, elem_bytes(out_type), op, out_name);
  if (k == 0) return;
  require_ptr(a, sizeof(bf16), op, a_name);
  require_ptr(b, sizeof(bf16), op, b_name);
}

// cuBLAS runs a product with a large odd dimension far below its rate: cuBLASLt and
// cublasGemmEx alike ran the lm head at a vocabulary of 151665 up to 7× slower than
// at 151680 = 1185 × 128 (bench_gemm; the figures are in bench/RESULTS.md, Kernels).
// So each matmul splits OC into a body, a multiple of kBodyRows, and a tail of fewer
// rows: two products that together are the one asked for (when the reduction is
// split, the tail adds into the body's output). Small OC (< 8 · kBodyRows) is left
// whole: its tail would be most of it.
constexpr int64_t kBodyRows = 128;
int64_t aligned_body(int64_t OC) {
  if (OC < 8 * kBodyRows || OC % kBodyRows == 0) return OC;
  return OC / kBodyRows * kBodyRows;
}

std::string describe(const std::array<int64_t, 12>& k) {
  return std::string("transa=") + std::to_string(k[0]) + " transb=" + std::to_string(k[1]) +
         " m=" + std::to_string(k[2]) + " n=" + std::to_string(k[3]) + " k=" + std::to_string(k[4]) +
         " lda=" + std::to_string(k[5]) + " ldb=" + std::to_string(k[6]) + " ldd=" + std::to_string(k[7]) +
         " out=" + (k[8] == 0 ? "bf16" : "f32") + " align=" + std::to_string(k[9]) + "/" +
         std::to_string(k[10]) + "/" + std::to_string(k[11]);
}

}  // namespace

Gemm::Gemm(cublasLtHandle_t lt, void* workspace, size_t workspace_bytes, cudaStream_t stream)
    : lt_(lt), workspace_(workspace), workspace_bytes_(workspace_bytes), stream_(stream) {}

Gemm::~Gemm() {
  for (auto& [key, p] : plans_) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.d);
    cublasLtMatmulDescDestroy(p.op);
  }
}

const Gemm::Plan& Gemm::plan(const Key& key) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;

  const bool transa = key[0], transb = key[1];
  const uint64_t m = key[2], n = key[3], k = key[4];
  Plan p;
  cublas_check(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublas_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  cublas_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  // Layouts describe the matrices as stored (column-major rows × cols, ld).
  cublas_check(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, transa ? k : m, transa ? m : k, key[5]));
  cublas_check(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, transb ? n : k, transb ? k : n, key[6]));
  cublas_check(cublasLtMatrixLayoutCreate(&p.d, cuda_type(static_cast<DType>(key[8])), m, n, key[7]));

  cublasLtMatmulPreference_t pref = nullptr;
  cublas_check(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = workspace_bytes_;
  cublas_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  const uint32_t al_a = key[9], al_b = key[10], al_d = key[11];
  cublas_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a));
  cublas_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b));
  cublas_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof al_d));
  cublas_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof al_d));
  // Split-K partial sums are added in fp32: a bf16 output may not be reduced in its
  // own type (OUTPUT_TYPE) nor in place (INPLACE adds in the output's type too).
  const uint32_t reduction = static_cast<DType>(key[8]) == DType::f32
                                 ? CUBLASLT_REDUCTION_SCHEME_INPLACE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE
                                 : CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  cublas_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction,
                                                    sizeof reduction));

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_, p.op, p.a, p.b, p.d, p.d, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.d);
    cublasLtMatmulDescDestroy(p.op);
    throw Error("cuBLASLt: no algorithm for GEMM " + describe(key) + " (" + cublasGetStatusString(st) + ")");
  }
  p.algo = result.algo;
  return plans_.emplace(key, p).first->second;
}

void Gemm::run(bool transa, bool transb, int64_t m, int64_t n, int64_t k, const bf16* A, int64_t lda,
               const bf16* B, int64_t ldb, void* D, DType d_type, int64_t ldd, float alpha, float beta,
               cudaStream_t stream) {
  require(m >= 0 && n >= 0 && k >= 0, "gemm", "sizes must be ≥ 0");
  require(stream == stream_, "gemm",
          "runs on the Runtime's stream only (its cuBLASLt workspace is shared, so GEMMs on two streams "
          "would overwrite each other's)");
  if (m == 0 || n == 0) return;  // empty output: nothing to write
  require(lda >= (transa ? k : m) && ldb >= (transb ? n : k) && ldd >= m, "gemm",
          "leading dimension too small (m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" +
              std::to_string(k) + " lda=" + std::to_string(lda) + " ldb=" + std::to_string(ldb) +
              " ldd=" + std::to_string(ldd) + ")");
  if (k == 0) {
    // An empty reduction: op(A)·op(B) is the m×n zero matrix, so D = beta·D — zeros for
    // beta = 0, unchanged for beta = 1 (what cpu::matmul_* give: sgemm with K = 0, dinp
    // zero-filled when OC = 0). Only the m valid entries of each of the n columns are
    // written: the padding of a strided D (ldd > m, e.g. padded logits rows) is left
    // alone, as a GEMM would. No cuBLASLt call (and no cached plan) is needed.
    if (beta == 1.0f) return;
    require(beta == 0.0f, "gemm", "k = 0 supports beta = 0 (zeros) or 1 (unchanged) only");
    const size_t elem = elem_bytes(d_type);
    cuda_check(cudaMemset2DAsync(D, size_t(ldd) * elem, 0, size_t(m) * elem, size_t(n), stream));
    return;
  }
  const Key key = {transa, transb, m, n, k, lda, ldb, ldd, static_cast<int64_t>(d_type),
                   pointer_alignment(A), pointer_alignment(B), pointer_alignment(D)};
  const Plan& p = plan(key);
  cublas_check(cublasLtMatmul(lt_, p.op, &alpha, A, p.a, B, p.b, &beta, D, p.d, D, p.d, &p.algo, workspace_,
                              workspace_bytes_, stream));
}

// Row-major X[r, c] is column-major Xᵀ with ld = c; each product below is written
// as the column-major product of the transposes (as llm.c does).

void matmul_forward(Gemm& g, void* out, DType out_type, const bf16* inp, const bf16* weight, int64_t N,
                    int64_t C, int64_t OC, cudaStream_t stream, bool accumulate, int64_t ldo) {
  check_pointers("matmul_forward", N * OC, C, out, out_type, "out", inp, "inp", weight, "weight");
  // outᵀ[OC,N] = weight_cm[C,OC]ᵀ · inp_cm[C,N], as an aligned body and a short tail
  // (aligned_body): the tail's weight rows start at row `body`, its outputs at column `body`.
  const int64_t body = aligned_body(OC), ld = ldo ? ldo : OC;
  const float beta = accumulate ? 1.0f : 0.0f;
  g.run(true, false, body, N, C, weight, C, inp, C, out, out_type, ld, 1.0f, beta, stream);
  if (body < OC)
    g.run(true, false, OC - body, N, C, weight + body * C, C, inp, C,
          static_cast<char*>(out) + body * int64_t(elem_bytes(out_type)), out_type, ld, 1.0f, beta, stream);
}

void matmul_backward_input(Gemm& g, void* dinp, DType dinp_type, const bf16* dout, const bf16* weight,
                           int64_t N, int64_t C, int64_t OC, cudaStream_t stream, bool accumulate, int64_t ldo) {
  check_pointers("matmul_backward_input", N * C, OC, dinp, dinp_type, "dinp", dout, "dout", weight, "weight");
  // dinpᵀ[C,N] = weight_cm[C,OC] · dout_cm[OC,N]: the reduction over OC as an aligned
  // body, then the tail added on top (aligned_body).
  const int64_t body = aligned_body(OC), ld = ldo ? ldo : OC;
  g.run(false, false, C, N, body, weight, C, dout, ld, dinp, dinp_type, C, 1.0f, accumulate ? 1.0f : 0.0f, stream);
  if (body < OC)
    g.run(false, false, C, N, OC - body, weight + body * C, C, dout + body, ld, dinp, dinp_type, C, 1.0f, 1.0f,
          stream);
}

void matmul_backward_weight(Gemm& g, float* dweight, const bf16* dout, const bf16* inp, int64_t N, int64_t C,
                            int64_t OC, cudaStream_t stream, bool accumulate, int64_t ldo) {
  check_pointers("matmul_backward_weight", OC * C, N, dweight, DType::f32, "dweight", dout, "dout", inp, "inp");
  // dweightᵀ[C,OC] = inp_cm[C,N] · dout_cm[OC,N]ᵀ, as an aligned body and a short tail
  // (aligned_body): the tail's rows of dweight and columns of dout start at `body`.
  const int64_t body = aligned_body(OC), ld = ldo ? ldo : OC;
  const float beta = accumulate ? 1.0f : 0.0f;
  g.run(false, true, C, body, N, inp, C, dout, ld, dweight, DType::f32, C, 1.0f, beta, stream);
  if (body < OC)
    g.run(false, true, C, OC - body, N, inp, C, dout + body, ld, dweight + body * C, DType::f32, C, 1.0f, beta,
          stream);
}

void matmul_backward(Gemm& g, bf16* dinp, float* dweight, const bf16* dout, const bf16* inp,
                     const bf16* weight, int64_t N, int64_t C, int64_t OC, cudaStream_t stream) {
  if (dinp) matmul_backward_input(g, dinp, DType::bf16, dout, weight, N, C, OC, stream, false);
  if (dweight) matmul_backward_weight(g, dweight, dout, inp, N, C, OC, stream, true);
}

}  // namespace spes::cuda
