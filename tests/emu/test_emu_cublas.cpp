// The emulated cuBLAS and cuBLASLt (cublas_emu.cpp) against a reference written from
// the definition of the product, so that the whole-step emulated tests rest on GEMMs
// that are cuBLAS's, not the project's idea of them: C = alpha·op(A)·op(B) + beta·C,
// column-major, op(A)(i, p) = A(p, i) when transposed, accumulated in double here.
//
// Every matrix sits in a device buffer of exactly the elements from its first to its
// last, with NaN in the padding rows between columns (ld > rows), so that a read of
// the padding or past the end shows (NaN in the output, or the emulator's bounds
// check); C starts as NaN where beta = 0 (it must not be read) and its padding must
// keep its bits. Tolerances: a bf16 output within 1 bf16 step of the reference (one
// rounding of an fp32 sum); an fp32 output within 1e-5 relative error (‖·‖₂).
//
// Also: the documented refusals (INVALID_VALUE for sizes and leading dimensions, the
// grouped API's NOT_SUPPORTED for bf16 in with fp32 out) write nothing; empty
// products; the handle's state; and, in a child process, the aborts where a GPU would
// fault or cuBLAS is not emulated (C one element past its buffer, by its pointer or
// its ldc; A in host memory; device pointer mode; a grouped call's pointer array in
// host memory, or two of its outputs overlapping; D less aligned than cuBLASLt's
// algorithm was chosen for; a freed workspace, unless cublasSetStream dropped it).
//
// Inputs are seeded (kSeed) per case: this test runs on every commit.
#include "tests/emu/emu_test.hpp"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace spes::test;
using emu::GlobalBuffer;

constexpr uint64_t kSeed = 20250612;
constexpr double kTolF32 = 1e-5;
constexpr int kMaxBf16Steps = 1;

size_t elem_bytes(cudaDataType t) { return t == CUDA_R_16BF ? 2 : 4; }
const char* name(cudaDataType t) { return t == CUDA_R_16BF ? "bf16" : "f32"; }
int64_t span(int64_t rows, int64_t cols, int64_t ld) { return rows == 0 || cols == 0 ? 0 : (cols - 1) * ld + rows; }

// A column-major matrix, rows × cols with leading dimension ld, in a device buffer of
// its span; `host` is what the buffer holds (values a bf16 buffer holds exactly).
struct Stored {
  int64_t rows, cols, ld;
  cudaDataType type;
  std::vector<float> host;
  GlobalBuffer dev;

  float at(int64_t r, int64_t c) const { return host[r + c * ld]; }
  void* ptr() const { return dev.as<unsigned char>(); }
  std::vector<unsigned char> bytes() const { return {dev.as<unsigned char>(), dev.as<unsigned char>() + dev.bytes()}; }
};

// Random values in the matrix (or NaN everywhere when !filled), NaN in the padding.
Stored stored(int64_t rows, int64_t cols, int64_t ld, cudaDataType type, bool filled) {
  const int64_t n = span(rows, cols, ld);
  std::vector<float> v = type == CUDA_R_16BF ? random_bf16_values(n) : random_vector(n);
  for (int64_t i = 0; i < n; ++i)
    if (!filled || i % ld >= rows) v[i] = NAN;
  Stored s{rows, cols, ld, type, v, GlobalBuffer(std::max<size_t>(size_t(n) * elem_bytes(type), 1))};
  if (type == CUDA_R_16BF)
    upload_bf16(s.dev, v);
  else
    upload(s.dev, v);
  return s;
}

std::vector<float> download_as(const Stored& s) {
  const int64_t n = span(s.rows, s.cols, s.ld);
  return s.type == CUDA_R_16BF ? download_bf16(s.dev, n) : download(s.dev, n);
}

struct Problem {
  bool ta, tb;
  int64_t m, n, k;
  float alpha, beta;
  std::string describe() const {
    return std::string("transa=") + (ta ? "T" : "N") + " transb=" + (tb ? "T" : "N") + " m=" + std::to_string(m) +
           " n=" + std::to_string(n) + " k=" + std::to_string(k) + " alpha=" + std::to_string(alpha) +
           " beta=" + std::to_string(beta);
  }
};

struct Operands {
  Stored a, b, c;
};

// A, B and C of a problem as stored, each with `pad` (or more) padding rows; C filled
// only when beta ≠ 0.
Operands operands(const Problem& p, cudaDataType ab, cudaDataType c, int64_t pad) {
  const int64_t a_rows = p.ta ? p.k : p.m, a_cols = p.ta ? p.m : p.k;
  const int64_t b_rows = p.tb ? p.n : p.k, b_cols = p.tb ? p.k : p.n;
  return {stored(a_rows, a_cols, a_rows + pad, ab, true), stored(b_rows, b_cols, b_rows + pad + 2, ab, true),
          stored(p.m, p.n, p.m + pad + 1, c, p.beta != 0.0f)};
}

// C(i, j) = alpha·Σ_p op(A)(i, p)·op(B)(p, j) + beta·C(i, j) in double, straight from
// the definition; C is not read when beta = 0. Dense m×n, column-major.
std::vector<double> reference(const Problem& p, const Stored& A, const Stored& B, const Stored& C) {
  std::vector<double> ref(size_t(p.m * p.n));
  for (int64_t j = 0; j < p.n; ++j)
    for (int64_t i = 0; i < p.m; ++i) {
      double sum = 0;
      for (int64_t q = 0; q < p.k; ++q) {
        const double a = p.ta ? A.at(q, i) : A.at(i, q);
        const double b = p.tb ? B.at(j, q) : B.at(q, j);
        sum += a * b;
      }
      ref[i + j * p.m] = p.alpha * sum + (p.beta != 0.0f ? double(p.beta) * C.at(i, j) : 0.0);
    }
  return ref;
}

// Distance in bf16 steps (the bits of a bf16 as a line of ordered integers); NaN is far.
int64_t bf16_steps(float got, double want) {
  auto line = [](float x) {
    uint16_t u;
    const bf16 b = __float2bfloat16_rn(x);
    std::memcpy(&u, &b, sizeof u);
    return (u & 0x8000) ? -int64_t(u & 0x7fff) : int64_t(u);
  };
  if (std::isnan(got) || std::isnan(want)) return INT64_MAX;
  return std::abs(line(got) - line(float(want)));
}

// The output D (of `out`'s layout) against the reference, and its padding against the
// bytes it held before the call.
void check_output(const std::string& what, const Problem& p, const Stored& out,
                  const std::vector<unsigned char>& before, const std::vector<double>& ref, ErrorReport& report) {
  const std::vector<float> got = download_as(out);
  const std::vector<unsigned char> after = out.bytes();
  const size_t es = elem_bytes(out.type);
  int64_t padding_written = 0, off = 0;
  std::string first_off;
  std::vector<float> got_dense(ref.size()), want_dense(ref.size());
  for (int64_t idx = 0; idx < int64_t(got.size()); ++idx) {
    const int64_t r = idx % out.ld, c = idx / out.ld;
    if (r >= p.m) {
      padding_written += std::memcmp(&after[idx * es], &before[idx * es], es) != 0;
      continue;
    }
    got_dense[r + c * p.m] = got[idx];
    want_dense[r + c * p.m] = float(ref[r + c * p.m]);
    if (out.type == CUDA_R_16BF && bf16_steps(got[idx], ref[r + c * p.m]) > kMaxBf16Steps && off++ == 0)
      first_off = "(" + std::to_string(r) + ", " + std::to_string(c) + "): got " + std::to_string(got[idx]) +
                  ", want " + std::to_string(ref[r + c * p.m]);
  }
  CHECK_MESSAGE(padding_written == 0, what << ": " << padding_written << " padding elements of the output written");
  if (out.type == CUDA_R_16BF)
    CHECK_MESSAGE(off == 0, what << ": " << off << " bf16 outputs more than " << kMaxBf16Steps
                                 << " step from the reference, first at " << first_off);
  else
    report.check("f32 output", what, got_dense, want_dense, kTolF32);
}

// The product C = alpha·op(A)·op(B) + beta·C through cublasGemmEx.
cublasStatus_t gemm_ex(cublasHandle_t h, const Problem& p, const Stored& A, const Stored& B, const Stored& C) {
  return cublasGemmEx(h, p.ta ? CUBLAS_OP_T : CUBLAS_OP_N, p.tb ? CUBLAS_OP_T : CUBLAS_OP_N, int(p.m), int(p.n),
                      int(p.k), &p.alpha, A.ptr(), A.type, int(A.ld), B.ptr(), B.type, int(B.ld), &p.beta, C.ptr(),
                      C.type, int(C.ld), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

// Largest power of two (≤ 256) dividing the address, as cuda/matmul.cu promises it.
uint32_t alignment_of(const void* p) {
  uint32_t al = 256;
  while (al > 1 && reinterpret_cast<uintptr_t>(p) % al != 0) al /= 2;
  return al;
}

// D = alpha·op(A)·op(B) + beta·C through the cuBLASLt calls cuda/matmul.cu makes: a
// descriptor with the operations, layouts of the matrices as stored, a preference
// promising each pointer's own alignment, the heuristic's algorithm. d_shift moves D's
// pointer by that many bytes after the heuristic query.
cublasStatus_t lt_matmul(cublasLtHandle_t lt, const Problem& p, const Stored& A, const Stored& B, const Stored& C,
                         const Stored& D, const GlobalBuffer& workspace, size_t d_shift = 0) {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr, ld = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasOperation_t ta = p.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = p.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const uint64_t ws = workspace.bytes();
  const uint32_t al[4] = {alignment_of(A.ptr()), alignment_of(B.ptr()), alignment_of(C.ptr()), alignment_of(D.ptr())};
  cublasStatus_t s = cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  auto then = [&s](cublasStatus_t next) {
    if (s == CUBLAS_STATUS_SUCCESS) s = next;
  };
  then(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  then(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  then(cublasLtMatrixLayoutCreate(&la, A.type, A.rows, A.cols, A.ld));
  then(cublasLtMatrixLayoutCreate(&lb, B.type, B.rows, B.cols, B.ld));
  then(cublasLtMatrixLayoutCreate(&lc, C.type, C.rows, C.cols, C.ld));
  then(cublasLtMatrixLayoutCreate(&ld, D.type, D.rows, D.cols, D.ld));
  then(cublasLtMatmulPreferenceCreate(&pref));
  then(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  for (int x = 0; x < 4; ++x)
    then(cublasLtMatmulPreferenceSetAttribute(
        pref, cublasLtMatmulPreferenceAttributes_t(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES + x), &al[x],
        sizeof al[x]));
  then(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, ld, pref, 1, &result, &found));
  if (s == CUBLAS_STATUS_SUCCESS && found != 1) s = CUBLAS_STATUS_INTERNAL_ERROR;
  then(cublasLtMatmul(lt, op, &p.alpha, A.ptr(), la, B.ptr(), lb, &p.beta, C.ptr(), lc,
                      static_cast<unsigned char*>(D.ptr()) + d_shift, ld, &result.algo, workspace.as<unsigned char>(),
                      workspace.bytes(), nullptr));
  cublasLtMatmulPreferenceDestroy(pref);
  for (cublasLtMatrixLayout_t l : {la, lb, lc, ld}) cublasLtMatrixLayoutDestroy(l);
  cublasLtMatmulDescDestroy(op);
  return s;
}

struct Shape {
  int64_t m, n, k;
};
constexpr Shape kShapes[] = {{37, 29, 45}, {64, 96, 300}};
struct Types {
  cudaDataType ab, c;
};
constexpr Types kTypes[] = {{CUDA_R_16BF, CUDA_R_16BF}, {CUDA_R_16BF, CUDA_R_32F}, {CUDA_R_32F, CUDA_R_32F}};

// Every (transa, transb, types, beta) over kShapes: beta = 0 over a NaN C, and an
// accumulation (beta = 1, alpha = −0.5).
template <class Run>
void for_each_case(Run&& run) {
  for (const Shape& s : kShapes)
    for (const bool ta : {false, true})
      for (const bool tb : {false, true})
        for (const Types& t : kTypes)
          for (const float beta : {0.0f, 1.0f}) {
            const Problem p{ta, tb, s.m, s.n, s.k, beta == 0.0f ? 1.0f : -0.5f, beta};
            run(p, t, p.describe() + " A/B " + name(t.ab) + " C " + name(t.c));
          }
}

// The arguments of a cublasGemmGroupedBatchedEx call over problems given group by group
// (`ops` in that order): per group, host arrays of its problem, size and leading
// dimensions (its first member's: a group shares them); per problem, device arrays of
// its matrices' pointers, as cuBLAS reads them on the GPU.
struct GroupedCall {
  std::vector<cublasOperation_t> transa, transb;
  std::vector<int> m, n, k, lda, ldb, ldc, size;
  std::vector<float> alpha, beta;
  GlobalBuffer a, b, c;

  cublasStatus_t run(cublasHandle_t h, cudaDataType ab, cudaDataType ct) const {
    return cublasGemmGroupedBatchedEx(h, transa.data(), transb.data(), m.data(), n.data(), k.data(), alpha.data(),
                                      a.as<const void*>(), ab, lda.data(), b.as<const void*>(), ab, ldb.data(),
                                      beta.data(), c.as<void*>(), ct, ldc.data(), int(size.size()), size.data(),
                                      CUBLAS_COMPUTE_32F);
  }
};

GroupedCall grouped_call(const std::vector<Problem>& groups, const std::vector<int>& sizes,
                         const std::vector<Operands>& ops) {
  const size_t bytes = ops.size() * sizeof(void*);
  GroupedCall call{
      {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, GlobalBuffer(bytes), GlobalBuffer(bytes), GlobalBuffer(bytes)};
  size_t i = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const Problem& p = groups[g];
    const Operands& first = ops[i];
    call.transa.push_back(p.ta ? CUBLAS_OP_T : CUBLAS_OP_N);
    call.transb.push_back(p.tb ? CUBLAS_OP_T : CUBLAS_OP_N);
    call.m.push_back(int(p.m)), call.n.push_back(int(p.n)), call.k.push_back(int(p.k));
    call.lda.push_back(int(first.a.ld)), call.ldb.push_back(int(first.b.ld)), call.ldc.push_back(int(first.c.ld));
    call.size.push_back(sizes[g]);
    call.alpha.push_back(p.alpha), call.beta.push_back(p.beta);
    for (int j = 0; j < sizes[g]; ++j, ++i) {
      call.a.as<void*>()[i] = ops[i].a.ptr();
      call.b.as<void*>()[i] = ops[i].b.ptr();
      call.c.as<void*>()[i] = ops[i].c.ptr();
    }
  }
  return call;
}

// The problems of `groups` (sizes[g] each), every one with its own operands.
std::vector<Operands> group_operands(const std::vector<Problem>& groups, const std::vector<int>& sizes, cudaDataType ab,
                                     cudaDataType c) {
  std::vector<Operands> ops;
  for (size_t g = 0; g < groups.size(); ++g)
    for (int j = 0; j < sizes[g]; ++j) ops.push_back(operands(groups[g], ab, c, 2));
  return ops;
}

// The status of a cuBLASLt heuristic query for these layouts (A, B, C, D) and operations.
struct Dims {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
};
cublasStatus_t lt_heuristic(cublasLtHandle_t lt, cublasOperation_t ta, const Dims (&l)[4]) {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t layouts[4] = {};
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  REQUIRE(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) == CUBLAS_STATUS_SUCCESS);
  for (int x = 0; x < 4; ++x)
    REQUIRE(cublasLtMatrixLayoutCreate(&layouts[x], l[x].type, l[x].rows, l[x].cols, l[x].ld) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS);
  const cublasStatus_t s =
      cublasLtMatmulAlgoGetHeuristic(lt, op, layouts[0], layouts[1], layouts[2], layouts[3], pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  for (cublasLtMatrixLayout_t x : layouts) cublasLtMatrixLayoutDestroy(x);
  cublasLtMatmulDescDestroy(op);
  return s;
}

}  // namespace

TEST_CASE("emu cublas: cublasGemmEx computes the definition for every transpose, type and beta") {
  cublasHandle_t h = nullptr;
  REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
  ErrorReport report;
  for_each_case([&](const Problem& p, const Types& t, const std::string& what) {
    INFO(what);
    rng().seed(kSeed);
    const Operands o = operands(p, t.ab, t.c, 3);
    const std::vector<double> ref = reference(p, o.a, o.b, o.c);
    const std::vector<unsigned char> before = o.c.bytes();
    REQUIRE(gemm_ex(h, p, o.a, o.b, o.c) == CUBLAS_STATUS_SUCCESS);
    check_output("cublasGemmEx " + what, p, o.c, before, ref, report);
  });
  cublasDestroy(h);
}

// In place (C = D, the project's use) and into a separate D of another leading
// dimension (C read, not written).
TEST_CASE("emu cublas: cublasLtMatmul computes the definition, in place and into a separate D") {
  cublasLtHandle_t lt = nullptr;
  REQUIRE(cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS);
  const GlobalBuffer workspace(1 << 20);
  ErrorReport report;
  for_each_case([&](const Problem& p, const Types& t, const std::string& what) {
    INFO(what);
    rng().seed(kSeed);
    const Operands o = operands(p, t.ab, t.c, 3);
    const std::vector<double> ref = reference(p, o.a, o.b, o.c);
    const Stored d = stored(p.m, p.n, p.m + 7, t.c, false);
    const std::vector<unsigned char> c_before = o.c.bytes(), d_before = d.bytes();
    REQUIRE(lt_matmul(lt, p, o.a, o.b, o.c, d, workspace) == CUBLAS_STATUS_SUCCESS);
    check_output("cublasLtMatmul into D " + what, p, d, d_before, ref, report);
    CHECK_MESSAGE(o.c.bytes() == c_before, what << ": C written");
    REQUIRE(lt_matmul(lt, p, o.a, o.b, o.c, o.c, workspace) == CUBLAS_STATUS_SUCCESS);
    check_output("cublasLtMatmul in place " + what, p, o.c, c_before, ref, report);
  });
  cublasLtDestroy(lt);
}

// Two groups of different shapes, transposes and scalars (the second accumulating),
// three problems.
TEST_CASE("emu cublas: cublasGemmGroupedBatchedEx computes each problem; bf16 in, f32 out is NOT_SUPPORTED") {
  cublasHandle_t h = nullptr;
  REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
  ErrorReport report;
  rng().seed(kSeed);
  const std::vector<Problem> groups = {{false, true, 24, 16, 40, 1.0f, 0.0f}, {true, false, 13, 30, 21, 0.5f, 1.0f}};
  const std::vector<int> sizes = {2, 1};
  const std::vector<Operands> ops = group_operands(groups, sizes, CUDA_R_16BF, CUDA_R_16BF);
  const GroupedCall call = grouped_call(groups, sizes, ops);
  std::vector<std::vector<unsigned char>> before;
  for (const Operands& o : ops) before.push_back(o.c.bytes());

  // cuBLAS's table for the grouped API has no bf16 in with fp32 out (MoeLayer falls
  // back to cublasGemmEx per expert for its fp32 weight gradients).
  CHECK(call.run(h, CUDA_R_16BF, CUDA_R_32F) == CUBLAS_STATUS_NOT_SUPPORTED);
  for (size_t i = 0; i < ops.size(); ++i) CHECK_MESSAGE(ops[i].c.bytes() == before[i], "refusal wrote C[" << i << "]");

  REQUIRE(call.run(h, CUDA_R_16BF, CUDA_R_16BF) == CUBLAS_STATUS_SUCCESS);
  const Problem problems[3] = {groups[0], groups[0], groups[1]};
  for (size_t i = 0; i < ops.size(); ++i)
    check_output("grouped problem " + std::to_string(i) + ": " + problems[i].describe(), problems[i], ops[i].c,
                 before[i], reference(problems[i], ops[i].a, ops[i].b, ops[i].c), report);
  cublasDestroy(h);
}

// Each documented rule once, on arguments otherwise valid; nothing written.
TEST_CASE("emu cublas: invalid sizes, leading dimensions and layouts are refused and write nothing") {
  cublasHandle_t h = nullptr;
  REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
  rng().seed(kSeed);
  // m < k, so that lda = m is enough for transa = N and too small for T.
  const Problem p{false, false, 4, 6, 8, 1.0f, 0.0f};
  const Operands o = operands(p, CUDA_R_16BF, CUDA_R_16BF, 4);
  const std::vector<unsigned char> before = o.c.bytes();
  const float one = 1.0f, zero = 0.0f;
  auto gemm = [&](cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, int lda, int ldb, int ldc) {
    return cublasGemmEx(h, ta, tb, m, n, k, &one, o.a.ptr(), CUDA_R_16BF, lda, o.b.ptr(), CUDA_R_16BF, ldb, &zero,
                        o.c.ptr(), CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  const auto N = CUBLAS_OP_N, T = CUBLAS_OP_T;
  const auto invalid = CUBLAS_STATUS_INVALID_VALUE;
  CHECK(gemm(N, N, 4, 6, 8, 3, 8, 4) == invalid);  // lda < m (A m×k as stored)
  CHECK(gemm(T, N, 4, 6, 8, 4, 8, 4) == invalid);  // lda < k (A k×m as stored)
  CHECK(gemm(N, N, 4, 6, 8, 4, 7, 4) == invalid);  // ldb < k
  CHECK(gemm(N, T, 4, 6, 8, 4, 5, 4) == invalid);  // ldb < n (B n×k as stored)
  CHECK(gemm(N, N, 4, 6, 8, 4, 8, 3) == invalid);  // ldc < m
  CHECK(gemm(N, N, -1, 6, 8, 4, 8, 4) == invalid);
  CHECK(gemm(N, N, 4, 6, -1, 4, 8, 4) == invalid);
  CHECK(gemm(CUBLAS_OP_CONJG, N, 4, 6, 8, 4, 8, 4) == invalid);
  // f32 in, bf16 out: not a row of cublasGemmEx's table.
  CHECK(cublasGemmEx(h, N, N, 2, 2, 2, &one, o.a.ptr(), CUDA_R_32F, 2, o.b.ptr(), CUDA_R_32F, 2, &zero, o.c.ptr(),
                     CUDA_R_16BF, 4, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_NOT_SUPPORTED);
  CHECK(o.c.bytes() == before);

  // The grouped call checks every group before it runs any: group 1's A, transposed,
  // is k × m as stored, and lda = m is below its k rows.
  const std::vector<Problem> groups = {p, {true, false, 4, 6, 8, 1.0f, 0.0f}};
  const std::vector<Operands> ops = group_operands(groups, {1, 1}, CUDA_R_16BF, CUDA_R_16BF);
  GroupedCall call = grouped_call(groups, {1, 1}, ops);
  call.lda[1] = 4;
  const std::vector<unsigned char> before0 = ops[0].c.bytes(), before1 = ops[1].c.bytes();
  CHECK(call.run(h, CUDA_R_16BF, CUDA_R_16BF) == invalid);
  CHECK(ops[0].c.bytes() == before0);
  CHECK(ops[1].c.bytes() == before1);
  call.size[0] = -1;
  call.lda[1] = 8;
  CHECK(call.run(h, CUDA_R_16BF, CUDA_R_16BF) == invalid);
  cublasDestroy(h);

  // cuBLASLt: layouts that disagree with the operations or each other, or a leading
  // dimension below the rows, are INVALID_VALUE; C and D of different types, or A and
  // B of different types, NOT_SUPPORTED. m = 4, n = 6, k = 8.
  cublasLtHandle_t lt = nullptr;
  REQUIRE(cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS);
  const auto bf = CUDA_R_16BF, f = CUDA_R_32F;
  CHECK(lt_heuristic(lt, N, {{bf, 4, 8, 4}, {bf, 8, 6, 8}, {bf, 4, 6, 4}, {bf, 4, 6, 4}}) == CUBLAS_STATUS_SUCCESS);
  CHECK(lt_heuristic(lt, T, {{bf, 8, 4, 8}, {bf, 8, 6, 8}, {bf, 4, 6, 4}, {bf, 4, 6, 4}}) == CUBLAS_STATUS_SUCCESS);
  CHECK(lt_heuristic(lt, T, {{bf, 4, 8, 4}, {bf, 8, 6, 8}, {bf, 4, 6, 4}, {bf, 4, 6, 4}}) == invalid);
  CHECK(lt_heuristic(lt, N, {{bf, 4, 8, 3}, {bf, 8, 6, 8}, {bf, 4, 6, 4}, {bf, 4, 6, 4}}) == invalid);
  CHECK(lt_heuristic(lt, N, {{bf, 4, 8, 4}, {bf, 8, 6, 8}, {bf, 4, 5, 4}, {bf, 4, 6, 4}}) == invalid);
  CHECK(lt_heuristic(lt, N, {{bf, 4, 8, 4}, {bf, 8, 6, 8}, {f, 4, 6, 4}, {bf, 4, 6, 4}}) ==
        CUBLAS_STATUS_NOT_SUPPORTED);
  CHECK(lt_heuristic(lt, N, {{f, 4, 8, 4}, {bf, 8, 6, 8}, {f, 4, 6, 4}, {f, 4, 6, 4}}) == CUBLAS_STATUS_NOT_SUPPORTED);
  cublasLtDestroy(lt);
}

// An empty output touches no matrix (null pointers included); an empty reduction
// (k = 0) reads neither A nor B and gives beta·C: zeros over NaN for beta = 0.
TEST_CASE("emu cublas: m = 0 or n = 0 touches nothing; k = 0 gives beta·C") {
  cublasHandle_t h = nullptr;
  REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
  const float one = 1.0f, zero = 0.0f;
  const auto N = CUBLAS_OP_N;
  const auto bf = CUDA_R_16BF;
  CHECK(cublasGemmEx(h, N, N, 0, 5, 3, &one, nullptr, bf, 1, nullptr, bf, 3, &zero, nullptr, bf, 1, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  CHECK(cublasGemmEx(h, N, N, 4, 0, 3, &one, nullptr, bf, 4, nullptr, bf, 3, &zero, nullptr, bf, 4, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  ErrorReport report;
  for (const cudaDataType ct : {CUDA_R_16BF, CUDA_R_32F})
    for (const float beta : {0.0f, 2.0f}) {
      rng().seed(kSeed);
      const Problem p{false, false, 5, 4, 0, 1.0f, beta};
      const Operands o = operands(p, ct, ct, 3);
      const std::vector<unsigned char> before = o.c.bytes();
      REQUIRE(cublasGemmEx(h, N, N, 5, 4, 0, &one, nullptr, ct, 5, nullptr, ct, 1, &beta, o.c.ptr(), ct, int(o.c.ld),
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
      check_output(std::string("k = 0, C ") + name(ct) + " beta " + std::to_string(beta), p, o.c, before,
                   reference(p, o.a, o.b, o.c), report);
    }
  cublasDestroy(h);
}

// What the handle keeps, and the documented refusals of its setters.
TEST_CASE("emu cublas: handle state: stream, pointer mode, workspace, math mode, status names") {
  cublasHandle_t h = nullptr;
  REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(uintptr_t(1));
  CHECK(cublasGetStream(h, &stream) == CUBLAS_STATUS_SUCCESS);
  CHECK(stream == nullptr);  // the NULL stream until set
  const auto some_stream = reinterpret_cast<cudaStream_t>(uintptr_t(0x1230));
  CHECK(cublasSetStream(h, some_stream) == CUBLAS_STATUS_SUCCESS);
  CHECK(cublasGetStream(h, &stream) == CUBLAS_STATUS_SUCCESS);
  CHECK(stream == some_stream);
  cublasPointerMode_t mode = CUBLAS_POINTER_MODE_DEVICE;
  CHECK(cublasGetPointerMode(h, &mode) == CUBLAS_STATUS_SUCCESS);
  CHECK(mode == CUBLAS_POINTER_MODE_HOST);
  CHECK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE) == CUBLAS_STATUS_SUCCESS);
  CHECK(cublasGetPointerMode(h, &mode) == CUBLAS_STATUS_SUCCESS);
  CHECK(mode == CUBLAS_POINTER_MODE_DEVICE);
  CHECK(cublasSetPointerMode(h, cublasPointerMode_t(7)) == CUBLAS_STATUS_INVALID_VALUE);
  const GlobalBuffer workspace(1 << 16);
  CHECK(cublasSetWorkspace(h, workspace.as<unsigned char>() + 128, 1024) == CUBLAS_STATUS_INVALID_VALUE);
  CHECK(cublasSetWorkspace(h, workspace.as<unsigned char>(), workspace.bytes()) == CUBLAS_STATUS_SUCCESS);
  CHECK(cublasSetMathMode(h, CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION) == CUBLAS_STATUS_SUCCESS);
  CHECK(cublasSetMathMode(h, cublasMath_t(5)) == CUBLAS_STATUS_INVALID_VALUE);
  CHECK(std::string(cublasGetStatusName(CUBLAS_STATUS_NOT_SUPPORTED)) == "CUBLAS_STATUS_NOT_SUPPORTED");
  CHECK(std::string(cublasGetStatusName(CUBLAS_STATUS_INVALID_VALUE)) == "CUBLAS_STATUS_INVALID_VALUE");
  CHECK(!std::string(cublasGetStatusString(CUBLAS_STATUS_NOT_SUPPORTED)).empty());
  CHECK(cublasDestroy(h) == CUBLAS_STATUS_SUCCESS);
  CHECK(cublasDestroy(nullptr) == CUBLAS_STATUS_NOT_INITIALIZED);
}

// Each in a child process, which must abort with the reason (emu::fail); the last one
// must run: cublasSetStream gives the handle back cuBLAS's own workspace.
TEST_CASE("emu cublas: where a GPU would fault, the emulator aborts and says why") {
  cublasHandle_t h = nullptr;
  cublasLtHandle_t lt = nullptr;
  REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS);
  rng().seed(kSeed);
  const Problem p{false, false, 8, 6, 5, 1.0f, 0.0f};
  const Operands o = operands(p, CUDA_R_16BF, CUDA_R_16BF, 1);
  const float one = 1.0f, zero = 0.0f;
  const auto N = CUBLAS_OP_N;
  const auto bf = CUDA_R_16BF;

  // C's last element one past the end of its buffer: C one element further on, or
  // ldc one above the one its buffer was sized for.
  auto gemm_c = [&](void* c, int64_t ldc) {
    cublasGemmEx(h, N, N, 8, 6, 5, &one, o.a.ptr(), bf, int(o.a.ld), o.b.ptr(), bf, int(o.b.ld), &zero, c, bf, int(ldc),
                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  std::string msg = run_in_child([&] { gemm_c(static_cast<bf16*>(o.c.ptr()) + 1, o.c.ld); });
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "cublasGemmEx: C (8×6") && has(msg, "outside every device buffer")),
                msg);
  msg = run_in_child([&] { gemm_c(o.c.ptr(), o.c.ld + 1); });
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "cublasGemmEx: C (8×6") && has(msg, "outside every device buffer")),
                msg);

  // A in host memory.
  const std::vector<bf16> host_a(size_t(o.a.ld * o.a.cols));
  msg = run_in_child([&] {
    cublasGemmEx(h, N, N, 8, 6, 5, &one, host_a.data(), bf, int(o.a.ld), o.b.ptr(), bf, int(o.b.ld), &zero, o.c.ptr(),
                 bf, int(o.c.ld), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  });
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "cublasGemmEx: A (8×5") && has(msg, "outside every device buffer")),
                msg);

  // Alpha and beta in device pointer mode.
  msg = run_in_child([&] {
    cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE);
    gemm_ex(h, p, o.a, o.b, o.c);
  });
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "CUBLAS_POINTER_MODE_DEVICE")), msg);

  // The grouped call's pointer arrays in host memory.
  const std::vector<Problem> groups = {p};
  const std::vector<Operands> ops = group_operands(groups, {2}, bf, bf);
  msg = run_in_child([&] {
    const GroupedCall call = grouped_call(groups, {2}, ops);
    const void* a[2] = {ops[0].a.ptr(), ops[1].a.ptr()};
    cublasGemmGroupedBatchedEx(h, call.transa.data(), call.transb.data(), call.m.data(), call.n.data(), call.k.data(),
                               call.alpha.data(), a, bf, call.lda.data(), call.b.as<const void*>(), bf, call.ldb.data(),
                               call.beta.data(), call.c.as<void*>(), bf, call.ldc.data(), 1, call.size.data(),
                               CUBLAS_COMPUTE_32F);
  });
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "Aarray (2 pointers") && has(msg, "device memory")), msg);

  // Two problems of one grouped call writing the same C.
  msg = run_in_child([&] {
    GroupedCall call = grouped_call(groups, {2}, ops);
    call.c.as<void*>()[1] = call.c.as<void*>()[0];
    call.run(h, bf, bf);
  });
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "outputs of problems 0 and 1 overlap")), msg);

  // cuBLASLt's algorithm chosen for 256-byte aligned pointers, D 2 bytes off.
  const GlobalBuffer workspace(1 << 16);
  msg = run_in_child([&] { lt_matmul(lt, p, o.a, o.b, o.c, o.c, workspace, 2); });
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "cublasLtMatmul: D at") && has(msg, "not 256-byte aligned")), msg);

  // A workspace freed after cublasSetWorkspace; then the same with cublasSetStream
  // between, which puts the handle back on cuBLAS's own workspace.
  auto set_freed_workspace = [&] {
    const GlobalBuffer freed(1 << 16);
    cublasSetWorkspace(h, freed.as<unsigned char>(), freed.bytes());
  };
  msg = run_in_child([&] {
    set_freed_workspace();
    gemm_ex(h, p, o.a, o.b, o.c);
  });
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "no longer inside a device buffer")), msg);
  msg = run_in_child([&] {
    set_freed_workspace();
    cublasSetStream(h, nullptr);
    if (gemm_ex(h, p, o.a, o.b, o.c) != CUBLAS_STATUS_SUCCESS) std::abort();
  });
  CHECK_MESSAGE(has(msg, "[returned]"), msg);

  cublasLtDestroy(lt);
  cublasDestroy(h);
}
