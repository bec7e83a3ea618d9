// The emulated cuBLASLt (cublas_emu.cpp) against a reference written from the
// definition of the product, so that the kernel and whole-step tests rest on GEMMs
// that are cuBLASLt's, not the project's idea of them: D = alpha·op(A)·op(B) + beta·C,
// column-major, op(A)(i, p) = A(p, i) when transposed, accumulated in double here.
//
// Every matrix sits in a device buffer of exactly the elements from its first to its
// last, with NaN in the padding rows between columns (ld > rows), so that a read of
// the padding or past the end shows (NaN in the output, or the emulator's bounds
// check); D starts as NaN where beta = 0 (it must not be read) and its padding must
// keep its bits. Tolerances: a bf16 output within 1 bf16 step of the reference (one
// rounding of an fp32 sum); an fp32 output within 1e-5 relative error (‖·‖₂).
//
// Also: the documented refusals of the heuristic query (INVALID_VALUE for layouts
// that disagree, NOT_SUPPORTED for types outside cuBLASLt's table); and, in a child
// process, the aborts where a GPU would fault (D one element past its buffer, D less
// aligned than the algorithm was chosen for).
//
// Inputs are seeded (kSeed) per case: this test runs on every commit.
#include "tests/emu/emu_test.hpp"

#include <cublasLt.h>
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
      first_off = std::string("(").append(std::to_string(r)) + ", " + std::to_string(c) + "): got " + std::to_string(got[idx]) +
                  ", want " + std::to_string(ref[r + c * p.m]);
  }
  CHECK_MESSAGE(padding_written == 0, what << ": " << padding_written << " padding elements of the output written");
  if (out.type == CUDA_R_16BF)
    CHECK_MESSAGE(off == 0, what << ": " << off << " bf16 outputs more than " << kMaxBf16Steps
                                 << " step from the reference, first at " << first_off);
  else
    report.check("f32 output", what, got_dense, want_dense, kTolF32);
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

// Each documented rule once, on layouts otherwise valid: m = 4, n = 6, k = 8.
TEST_CASE("emu cublas: cuBLASLt refuses layouts that disagree and types outside its table") {
  cublasLtHandle_t lt = nullptr;
  REQUIRE(cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS);
  const auto N = CUBLAS_OP_N, T = CUBLAS_OP_T;
  const auto bf = CUDA_R_16BF, f = CUDA_R_32F;
  const auto invalid = CUBLAS_STATUS_INVALID_VALUE;
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

// Each in a child process, which must abort with the reason (emu::fail).
TEST_CASE("emu cublas: where a GPU would fault, the emulator aborts and says why") {
  cublasLtHandle_t lt = nullptr;
  REQUIRE(cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS);
  rng().seed(kSeed);
  const Problem p{false, false, 8, 6, 5, 1.0f, 0.0f};
  const Operands o = operands(p, CUDA_R_16BF, CUDA_R_16BF, 1);
  const GlobalBuffer workspace(1 << 16);

  // D's last element one past the end of its buffer: a leading dimension one above
  // the one its buffer was sized for.
  Stored past = stored(p.m, p.n, p.m + 1, CUDA_R_16BF, false);
  past.ld += 1;
  std::string msg = run_in_child([&] { lt_matmul(lt, p, o.a, o.b, o.c, past, workspace); });
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "cublasLtMatmul: D (8×6") && has(msg, "outside every device buffer")),
                msg);

  // The algorithm chosen for 256-byte aligned pointers, D 2 bytes off.
  msg = run_in_child([&] { lt_matmul(lt, p, o.a, o.b, o.c, o.c, workspace, 2); });
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "cublasLtMatmul: D at") && has(msg, "not 256-byte aligned")), msg);
  cublasLtDestroy(lt);
}
