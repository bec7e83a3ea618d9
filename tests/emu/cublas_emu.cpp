// The cuBLASLt calls of the GPU code (cuda/runtime.cu's handle, cuda/matmul.cu's Gemm)
// and cuBLAS's status strings (cuda/check.cuh's cublas_check), run on the host for the
// emulator (emu.hpp), so that test_emu links no libcublas. They follow cuBLASLt's
// documentation, not the project's use of it, so that a wrong transpose, leading
// dimension, type or alignment shows here:
//   - column-major D = alpha·op(A)·op(B) + beta·C, each dot product accumulated in
//     fp32 over k in order (deterministic), stored as fp32 or rounded to bf16
//     (nearest even); C is not read when beta = 0 (cuBLAS: "C does not have to be a
//     valid input" then), so a NaN there does not propagate; k = 0 gives beta·C,
//     m = 0 or n = 0 touches nothing;
//   - the argument checks return the documented statuses, before anything is read or
//     written: INVALID_VALUE for operations, leading dimensions and layouts that
//     disagree, NOT_SUPPORTED for a type combination cuBLASLt's table leaves out;
//     each refusal also prints one "EMU cuBLAS:" line saying why;
//   - what a GPU would fault on is an "EMU: ..." line and an abort (emu::fail): a matrix
//     (the bytes from its first element to its last) outside every device buffer
//     (emu::GlobalBuffer), a pointer off its element's alignment or off the alignment
//     its algorithm was chosen for; so is what cuBLASLt leaves undefined (C and D
//     partly overlapping);
//   - what cuBLASLt has but this does not emulate (device pointer mode, types other
//     than bf16 and fp32, compute types other than CUBLAS_COMPUTE_32F, epilogues, ...)
//     is an emu::fail too, never a status: the project's fallbacks must see cuBLASLt's
//     refusals only, not the emulator's limits.
// The emulator is synchronous: stream order is call order.
#include <cublasLt.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "tests/emu/emu.hpp"

// The handle (an opaque type the header declares): nothing the emulated calls use.
struct cublasLtContext {};

namespace {

// ---- refusals, types, matrices --------------------------------------------------

// A documented refusal: its status, and why on stderr (cuBLAS says why only in its
// log), so that a test or a run that gets the status knows the reason.
cublasStatus_t refuse(cublasStatus_t status, const std::string& why) {
  std::fprintf(stderr, "EMU cuBLAS: %s: %s\n", cublasGetStatusName(status), why.c_str());
  return status;
}

std::string address(const void* p) {
  char s[32];
  std::snprintf(s, sizeof s, "%p", p);
  return s;
}

std::string type_name(cudaDataType t) {
  return t == CUDA_R_16BF ? "bf16" : t == CUDA_R_32F ? "f32" : "cudaDataType " + std::to_string(int(t));
}
size_t elem_bytes(cudaDataType t) { return t == CUDA_R_16BF ? sizeof(__nv_bfloat16) : sizeof(float); }

// Whether cuBLASLt computes these types, from the table of supported types of the
// cuBLAS documentation, rows of compute type CUBLAS_COMPUTE_32F (scale type
// CUDA_R_32F: alpha and beta are floats) with bf16 and fp32 matrices: Atype = Btype
// and (Atype, Ctype) one of (16BF, 16BF), (16BF, 32F), (32F, 32F). Other types and
// compute types (rows cuBLAS has: fp16, int8, fp64, complex, the _PEDANTIC and _FAST
// ones) are not emulated.
bool supported_types(const char* api, cublasComputeType_t compute, cudaDataType a, cudaDataType b, cudaDataType c) {
  if (compute != CUBLAS_COMPUTE_32F)
    emu::fail(std::string(api) + ": compute type " + std::to_string(int(compute)) +
              " is not emulated (only CUBLAS_COMPUTE_32F)");
  for (cudaDataType t : {a, b, c})
    if (t != CUDA_R_16BF && t != CUDA_R_32F)
      emu::fail(std::string(api) + ": " + type_name(t) + " matrices are not emulated (only bf16 and f32)");
  return a == b && (c == a || (a == CUDA_R_16BF && c == CUDA_R_32F));
}

std::string types(cudaDataType a, cudaDataType b, cudaDataType c) {
  return "A " + type_name(a) + ", B " + type_name(b) + ", C " + type_name(c);
}

// A matrix as stored: column-major, rows × cols, leading dimension ld (in elements).
struct Matrix {
  const void* data;  // an output's too (non-const in the API): one struct for all operands
  cudaDataType type;
  int64_t rows, cols, ld;

  int64_t index(int64_t r, int64_t c) const { return r + c * ld; }
  // The bytes from the first element to the last: what a kernel may touch.
  size_t span_bytes() const { return rows == 0 || cols == 0 ? 0 : size_t((cols - 1) * ld + rows) * elem_bytes(type); }
  std::string describe(const std::string& name) const {
    return name + " (" + std::to_string(rows) + "×" + std::to_string(cols) + ", ld=" + std::to_string(ld) + ", " +
           type_name(type) + ", at " + address(data) + ")";
  }
};

// What a GPU faults on: an element access off the element's alignment, or any byte of
// the span outside every device allocation. A matrix with no elements is not touched.
void require_device(const char* api, const std::string& name, const Matrix& x) {
  if (x.span_bytes() == 0) return;
  if (reinterpret_cast<uintptr_t>(x.data) % elem_bytes(x.type) != 0)
    emu::fail(std::string(api) + ": " + x.describe(name) + " is not aligned to its element size");
  if (!emu::in_device_buffer(x.data, x.span_bytes()))
    emu::fail(std::string(api) + ": " + x.describe(name) + ", " + std::to_string(x.span_bytes()) +
              " bytes from its first element to its last, is outside every device buffer");
}

float load(const Matrix& x, int64_t i) {
  if (x.type == CUDA_R_16BF) return __bfloat162float(static_cast<const __nv_bfloat16*>(x.data)[i]);
  return static_cast<const float*>(x.data)[i];
}
void store(const Matrix& x, int64_t i, float v) {
  void* out = const_cast<void*>(x.data);
  if (x.type == CUDA_R_16BF)
    static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
  else
    static_cast<float*>(out)[i] = v;
}

// ---- the product ----------------------------------------------------------------

// D = alpha·op(A)·op(B) + beta·C with op(A) m×k, op(B) k×n, C and D m×n. D may be C:
// each element of C is read just before the element of D over it is written. C is not
// read when beta = 0. Each dot product is a float sum over p = 0, 1, ..., k−1.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const Matrix& A, const Matrix& B, float beta,
          const Matrix& C, const Matrix& D) {
  // The rows of op(A) and the columns of op(B) as floats, each contiguous in k.
  std::vector<float> a(size_t(m * k)), b(size_t(n * k));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p) a[i * k + p] = load(A, ta ? A.index(p, i) : A.index(i, p));
  for (int64_t j = 0; j < n; ++j)
    for (int64_t p = 0; p < k; ++p) b[j * k + p] = load(B, tb ? B.index(j, p) : B.index(p, j));
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      float acc = 0.0f;
      for (int64_t p = 0; p < k; ++p) acc += a[i * k + p] * b[j * k + p];
      float v = k > 0 ? alpha * acc : 0.0f;  // k = 0: an empty product, D = beta·C
      if (beta != 0.0f) v += beta * load(C, C.index(i, j));
      store(D, D.index(i, j), v);
    }
}

// ---- operations ---------------------------------------------------------------------

bool valid_op(cublasOperation_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C; }
// CUBLAS_OP_C is op(X) = Xᴴ, which for real X is Xᵀ.
bool transposed(cublasOperation_t op) { return op != CUBLAS_OP_N; }

// ---- cuBLASLt descriptors -----------------------------------------------------------

// The descriptors, behind the opaque pointer types of cublasLt.h.
struct Layout : cublasLtMatrixLayoutOpaque_t {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;  // CUBLASLT_ORDER_COL, the default order (the only one emulated)
};
struct MatmulDesc : cublasLtMatmulDescOpaque_t {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  cublasOperation_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
};
struct Preference : cublasLtMatmulPreferenceOpaque_t {
  uint64_t max_workspace_bytes = 0;                                 // default: no workspace
  uint32_t reduction_scheme_mask = CUBLASLT_REDUCTION_SCHEME_MASK;  // default: any scheme
  uint32_t min_alignment[4] = {256, 256, 256, 256};                 // A, B, C, D; default 256 each
};

// The algorithm cublasLtMatmulAlgoGetHeuristic returns: no workspace, no split-K (so
// no reduction, whatever the preference's mask allows). It records the minimum
// alignments the preference promised, which cublasLtMatmul requires of the pointers:
// a kernel chosen for 16-byte aligned A issues 16-byte loads of A.
constexpr uint64_t kAlgoTag = 0x4f474c41554d45ull;  // "EMUALGO"
enum AlgoData { kTag, kAlignA, kAlignB, kAlignC, kAlignD };

// An attribute's value, of exactly its documented size (the Set*Attribute functions:
// INVALID_VALUE "if buf is NULL or sizeInBytes doesn't match size of internal storage").
template <class T>
bool read_attribute(const void* buf, size_t bytes, T* value) {
  if (buf == nullptr || bytes != sizeof(T)) return false;
  std::memcpy(value, buf, sizeof(T));
  return true;
}

// The product the descriptor and layouts describe (D is m×n; op(A) m×k; op(B) k×n; C
// as D), or why it is refused: INVALID_VALUE ("parameters are in conflict or in an
// impossible configuration") for layouts that disagree with each other and the
// operations, an operation other than N, T, C, or a leading dimension below the rows
// (CUBLASLT_MATRIX_LAYOUT_LD: "must be large enough so that matrix memory locations are
// not overlapping"); NOT_SUPPORTED for types cuBLASLt's table leaves out (Ctype = Dtype,
// scale type CUDA_R_32F for CUBLAS_COMPUTE_32F, see supported_types).
struct LtProblem {
  bool ta, tb;
  int64_t m, n, k;
};
cublasStatus_t lt_problem(const char* api, const MatmulDesc& op, const Layout& A, const Layout& B, const Layout& C,
                          const Layout& D, LtProblem* out) {
  auto dims = [](const char* name, const Layout& l) {
    return std::string(name) + " " + std::to_string(l.rows) + "×" + std::to_string(l.cols) +
           " ld=" + std::to_string(l.ld) + " " + type_name(l.type);
  };
  const std::string shape = " (transa=" + std::to_string(int(op.transa)) + " transb=" + std::to_string(int(op.transb)) +
                            "; " + dims("A", A) + ", " + dims("B", B) + ", " + dims("C", C) + ", " + dims("D", D) + ")";
  if (!valid_op(op.transa) || !valid_op(op.transb))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, std::string(api) + ": transa and transb must be N, T or C" + shape);
  const bool ta = transposed(op.transa), tb = transposed(op.transb);
  const uint64_t m = D.rows, n = D.cols, k = ta ? A.rows : A.cols;
  if ((ta ? A.cols : A.rows) != m || (tb ? B.cols : B.rows) != k || (tb ? B.rows : B.cols) != n || C.rows != m ||
      C.cols != n)
    return refuse(CUBLAS_STATUS_INVALID_VALUE,
                  std::string(api) + ": layouts disagree (op(A) must be m×k, op(B) k×n, C and D m×n)" + shape);
  for (const Layout* l : {&A, &B, &C, &D})
    if (l->ld < std::max<int64_t>(1, int64_t(l->rows)))
      return refuse(CUBLAS_STATUS_INVALID_VALUE, std::string(api) + ": a leading dimension is below its rows" + shape);
  if (!supported_types(api, op.compute, A.type, B.type, D.type) || C.type != D.type || op.scale != CUDA_R_32F)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, std::string(api) + ": types not in cuBLASLt's table (" +
                                                   types(A.type, B.type, C.type) + ", D " + type_name(D.type) +
                                                   ", scale " + type_name(op.scale) + ")" + shape);
  *out = {ta, tb, int64_t(m), int64_t(n), int64_t(k)};
  return CUBLAS_STATUS_SUCCESS;
}

// A pointer of cublasLtMatmul at least as aligned as its algorithm assumes.
void require_alignment(const char* name, const void* p, uint64_t promised) {
  if (reinterpret_cast<uintptr_t>(p) % std::max<uint64_t>(promised, 1) != 0)
    emu::fail(std::string("cublasLtMatmul: ") + name + " at " + address(p) + " is not " + std::to_string(promised) +
              "-byte aligned, the alignment its algorithm was chosen for (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_" + name +
              "_BYTES of the heuristic query)");
}

}  // namespace

// ---- cuBLAS status names (cublas_check, and the refusals above) -------------------

const char* cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "the operation completed successfully";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR: return "error detected trying to check the license";
  }
  return "unknown error";
}

// ---- cuBLASLt -------------------------------------------------------------------------

cublasStatus_t cublasLtCreate(cublasLtHandle_t* lightHandle) {
  if (lightHandle == nullptr) return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtCreate: handle is NULL");
  *lightHandle = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle) {
  if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete lightHandle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* matLayout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  if (matLayout == nullptr) return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatrixLayoutCreate: NULL");
  *matLayout = new Layout{{}, type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout) {
  delete static_cast<Layout*>(matLayout);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* matmulDesc, cublasComputeType_t computeType,
                                        cudaDataType_t scaleType) {
  if (matmulDesc == nullptr) return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulDescCreate: NULL");
  *matmulDesc = new MatmulDesc{{}, computeType, scaleType};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc) {
  delete static_cast<MatmulDesc*>(matmulDesc);
  return CUBLAS_STATUS_SUCCESS;
}

// The attributes and their types as cublasLt.h documents them (int32_t for the
// types, pointer mode and operations, uint32_t for the epilogue).
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t sizeInBytes) {
  if (matmulDesc == nullptr) return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulDescSetAttribute: NULL");
  MatmulDesc& d = *static_cast<MatmulDesc*>(matmulDesc);
  int32_t i32 = 0;
  uint32_t u32 = 0;
  bool ok = false;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE:
      if ((ok = read_attribute(buf, sizeInBytes, &i32))) d.compute = cublasComputeType_t(i32);
      break;
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE:
      if ((ok = read_attribute(buf, sizeInBytes, &i32))) d.scale = cudaDataType_t(i32);
      break;
    case CUBLASLT_MATMUL_DESC_TRANSA:
      if ((ok = read_attribute(buf, sizeInBytes, &i32))) d.transa = cublasOperation_t(i32);
      break;
    case CUBLASLT_MATMUL_DESC_TRANSB:
      if ((ok = read_attribute(buf, sizeInBytes, &i32))) d.transb = cublasOperation_t(i32);
      break;
    case CUBLASLT_MATMUL_DESC_POINTER_MODE:
      ok = read_attribute(buf, sizeInBytes, &i32);
      if (ok && i32 != CUBLASLT_POINTER_MODE_HOST)
        emu::fail("cublasLtMatmulDescSetAttribute: pointer mode " + std::to_string(i32) +
                  " is not emulated (only CUBLASLT_POINTER_MODE_HOST)");
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      ok = read_attribute(buf, sizeInBytes, &u32);
      if (ok && u32 != CUBLASLT_EPILOGUE_DEFAULT)
        emu::fail("cublasLtMatmulDescSetAttribute: epilogue " + std::to_string(u32) +
                  " is not emulated (only CUBLASLT_EPILOGUE_DEFAULT)");
      break;
    default: emu::fail("cublasLtMatmulDescSetAttribute: attribute " + std::to_string(int(attr)) + " is not emulated");
  }
  if (!ok)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulDescSetAttribute: attribute " +
                                                   std::to_string(int(attr)) + ": buf NULL or sizeInBytes " +
                                                   std::to_string(sizeInBytes) + " not its size");
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (pref == nullptr) return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulPreferenceCreate: NULL");
  *pref = new Preference;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete static_cast<Preference*>(pref);
  return CUBLAS_STATUS_SUCCESS;
}

// uint64_t MAX_WORKSPACE_BYTES; uint32_t REDUCTION_SCHEME_MASK and MIN_ALIGNMENT_{A,B,C,D}_BYTES.
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t sizeInBytes) {
  if (pref == nullptr) return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulPreferenceSetAttribute: NULL");
  Preference& p = *static_cast<Preference*>(pref);
  bool ok = false;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: ok = read_attribute(buf, sizeInBytes, &p.max_workspace_bytes); break;
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
      ok = read_attribute(buf, sizeInBytes, &p.reduction_scheme_mask);
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
      ok = read_attribute(buf, sizeInBytes, &p.min_alignment[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES]);
      break;
    default:
      emu::fail("cublasLtMatmulPreferenceSetAttribute: attribute " + std::to_string(int(attr)) + " is not emulated");
  }
  if (!ok)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulPreferenceSetAttribute: attribute " +
                                                   std::to_string(int(attr)) + ": buf NULL or sizeInBytes " +
                                                   std::to_string(sizeInBytes) + " not its size");
  return CUBLAS_STATUS_SUCCESS;
}

// One algorithm (see kAlgoTag) for any problem the layouts describe consistently;
// INVALID_VALUE "if requestedAlgoCount is less or equal to zero".
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc,
                                              cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                              cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                              cublasLtMatmulPreference_t preference, int requestedAlgoCount,
                                              cublasLtMatmulHeuristicResult_t heuristicResultsArray[],
                                              int* returnAlgoCount) {
  const char* api = "cublasLtMatmulAlgoGetHeuristic";
  if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (requestedAlgoCount <= 0)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, std::string(api) + ": requestedAlgoCount ≤ 0");
  if (!operationDesc || !Adesc || !Bdesc || !Cdesc || !Ddesc || !preference || !heuristicResultsArray ||
      !returnAlgoCount)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, std::string(api) + ": a descriptor or output is NULL");
  LtProblem problem;
  const cublasStatus_t status =
      lt_problem(api, *static_cast<MatmulDesc*>(operationDesc), *static_cast<Layout*>(Adesc),
                 *static_cast<Layout*>(Bdesc), *static_cast<Layout*>(Cdesc), *static_cast<Layout*>(Ddesc), &problem);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  const Preference& pref = *static_cast<Preference*>(preference);
  cublasLtMatmulHeuristicResult_t& r = heuristicResultsArray[0];
  r = {};
  r.algo.data[kTag] = kAlgoTag;
  for (int x = 0; x < 4; ++x) r.algo.data[kAlignA + x] = pref.min_alignment[x];
  r.workspaceSize = 0;
  r.state = CUBLAS_STATUS_SUCCESS;
  r.wavesCount = 1.0f;
  *returnAlgoCount = 1;
  return CUBLAS_STATUS_SUCCESS;
}

// D = alpha·op(A)·op(B) + beta·C. In place (C = D) with one layout for both, as the
// project runs it; C not read when beta = 0.
cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspaceSizeInBytes, cudaStream_t stream) {
  const char* api = "cublasLtMatmul";
  if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  emu::require_current_device(stream, api);
  if (!computeDesc || !Adesc || !Bdesc || !Cdesc || !Ddesc || !alpha || !beta)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, std::string(api) + ": a descriptor, alpha or beta is NULL");
  const Layout &la = *static_cast<Layout*>(Adesc), &lb = *static_cast<Layout*>(Bdesc),
               &lc = *static_cast<Layout*>(Cdesc), &ld = *static_cast<Layout*>(Ddesc);
  LtProblem p;
  const cublasStatus_t status = lt_problem(api, *static_cast<MatmulDesc*>(computeDesc), la, lb, lc, ld, &p);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  const float a_scale = *static_cast<const float*>(alpha), b_scale = *static_cast<const float*>(beta);
  if (p.m == 0 || p.n == 0) return CUBLAS_STATUS_SUCCESS;
  const bool reads_ab = p.k > 0, reads_c = b_scale != 0.0f;
  if (algo != nullptr) {  // NULL: cuBLASLt makes the heuristic query itself; no alignment promised
    if (algo->data[kTag] != kAlgoTag)
      emu::fail("cublasLtMatmul: algo does not come from cublasLtMatmulAlgoGetHeuristic");
    if (reads_ab) require_alignment("A", A, algo->data[kAlignA]);
    if (reads_ab) require_alignment("B", B, algo->data[kAlignB]);
    if (reads_c) require_alignment("C", C, algo->data[kAlignC]);
    require_alignment("D", D, algo->data[kAlignD]);
  }
  if (workspaceSizeInBytes > 0 && !emu::in_device_buffer(workspace, workspaceSizeInBytes))
    emu::fail("cublasLtMatmul: workspace (" + std::to_string(workspaceSizeInBytes) + " bytes at " + address(workspace) +
              ") is outside every device buffer");
  const Matrix a{A, la.type, int64_t(la.rows), int64_t(la.cols), la.ld},
      b{B, lb.type, int64_t(lb.rows), int64_t(lb.cols), lb.ld}, c{C, lc.type, p.m, p.n, lc.ld},
      d{D, ld.type, p.m, p.n, ld.ld};
  require_device(api, "A", a);
  require_device(api, "B", b);
  if (reads_c) require_device(api, "C", c);
  require_device(api, "D", d);
  // Each element of D from the element of C in the same place, or from elsewhere: C
  // and D partly overlapping would make D depend on the order the kernel writes it.
  const auto cb = reinterpret_cast<uintptr_t>(C), db = reinterpret_cast<uintptr_t>(D);
  const bool overlap = reads_c && cb < db + d.span_bytes() && db < cb + c.span_bytes();
  if (overlap && (C != D || lc.ld != ld.ld))
    emu::fail("cublasLtMatmul: " + c.describe("C") + " and " + d.describe("D") +
              " overlap without being one matrix (same pointer and layout)");
  emu::on_stream(stream, [=] { gemm(p.ta, p.tb, p.m, p.n, p.k, a_scale, a, b, b_scale, c, d); });
  return CUBLAS_STATUS_SUCCESS;
}
