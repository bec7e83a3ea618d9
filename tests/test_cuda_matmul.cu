// cuBLASLt GEMM wrapper vs cpu::matmul_* on the same (bf16-rounded) inputs.
// Tolerances: fp32 outputs 1e-4 (products of bf16 are exact in fp32; only the
// summation order differs), bf16 outputs 1e-2 (one rounding of each result).
#include <cmath>
#include <tuple>

#include "cuda/matmul.cuh"
#include "model/cpu/ops.hpp"
#include "tests/cuda_test.cuh"

using namespace spes::cuda;
using namespace spes::test;

namespace {

constexpr double kTolF32 = 1e-4;
constexpr double kTolBf16 = 1e-2;

struct Problem {
  int64_t N, C, OC;
  std::vector<float> inp, weight, dout;  // bf16-representable values
  Problem(int64_t n, int64_t c, int64_t oc)
      : N(n), C(c), OC(oc), inp(rounded_bf16(random_vector(n * c))), weight(rounded_bf16(random_vector(oc * c, 0.1f))),
        dout(rounded_bf16(random_vector(n * oc))) {}
};

}  // namespace

GPU_TEST_CASE("cuda matmul: forward, both backward products, accumulation, vs cpu") {
  // Expert GEMMs see any token count N (including 1 and odd), so N varies freely;
  // C and OC are model widths (multiples of 8); OC = 1160 is run as a body of 1152
  // rows and a tail of 8 (cuda/matmul.cu: aligned_body), accumulation included.
  for (auto [N, C, OC] : {std::tuple<int64_t, int64_t, int64_t>{64, 96, 160}, {37, 64, 200}, {1, 128, 40},
                          {515, 768, 384}, {24, 64, 1160}}) {
    CAPTURE(N);
    CAPTURE(C);
    CAPTURE(OC);
    Problem p(N, C, OC);
    Gemm& g = runtime().gemm();
    auto inp = upload_bf16(p.inp), weight = upload_bf16(p.weight), dout = upload_bf16(p.dout);

    // forward
    std::vector<float> ref(N * OC);
    spes::cpu::matmul_forward(ref.data(), p.inp.data(), p.weight.data(), N, C, OC);
    DevTensor<bf16> out_bf(N * OC);
    DevTensor<float> out_f(N * OC);
    out_bf.poison();
    out_f.poison();
    matmul_forward(g, out_bf, DType::bf16, inp, weight, N, C, OC, stream());
    matmul_forward(g, out_f, DType::f32, inp, weight, N, C, OC, stream());
    CHECK_REL("forward bf16 out", download(out_bf.get(), N * OC).data(), ref.data(), N * OC, kTolBf16);
    CHECK_REL("forward f32 out", download(out_f.get(), N * OC).data(), ref.data(), N * OC, kTolF32);

    // forward with accumulate (beta = 1) onto existing fp32 values
    std::vector<float> prior = random_vector(N * OC);
    auto acc = upload(prior);
    matmul_forward(g, acc, DType::f32, inp, weight, N, C, OC, stream(), /*accumulate=*/true);
    std::vector<float> ref_acc(N * OC);
    for (int64_t i = 0; i < N * OC; ++i) ref_acc[i] = prior[i] + ref[i];
    CHECK_REL("forward accumulate", download(acc.get(), N * OC).data(), ref_acc.data(), N * OC, kTolF32);

    // backward: dinp = dout·W (overwrite), dweight += doutᵀ·inp (beta = 1)
    std::vector<float> dinp_ref(N * C);
    std::vector<float> dw_prior = random_vector(OC * C);
    std::vector<float> dw_ref = dw_prior;
    spes::cpu::matmul_backward(dinp_ref.data(), dw_ref.data(), p.dout.data(), p.inp.data(), p.weight.data(), N, C, OC);
    DevTensor<bf16> dinp_bf(N * C);
    DevTensor<float> dinp_f(N * C);
    dinp_bf.poison();
    dinp_f.poison();
    auto dw = upload(dw_prior);
    matmul_backward(g, dinp_bf, dw, dout, inp, weight, N, C, OC, stream());
    matmul_backward_input(g, dinp_f, DType::f32, dout, weight, N, C, OC, stream());
    CHECK_REL("backward dinp bf16", download(dinp_bf.get(), N * C).data(), dinp_ref.data(), N * C, kTolBf16);
    CHECK_REL("backward dinp f32", download(dinp_f.get(), N * C).data(), dinp_ref.data(), N * C, kTolF32);
    CHECK_REL("backward dweight += (beta=1)", download(dw.get(), OC * C).data(), dw_ref.data(), OC * C, kTolF32);

    // dweight overwrite (beta = 0) into a poisoned buffer; frozen weight (null) skips it
    std::vector<float> dw0_ref(OC * C, 0.0f);
    spes::cpu::matmul_backward(nullptr, dw0_ref.data(), p.dout.data(), p.inp.data(), p.weight.data(), N, C, OC);
    DevTensor<float> dw0(OC * C);
    dw0.poison();
    matmul_backward_weight(g, dw0, dout, inp, N, C, OC, stream(), /*accumulate=*/false);
    CHECK_REL("backward dweight (beta=0)", download(dw0.get(), OC * C).data(), dw0_ref.data(), OC * C, kTolF32);
    dinp_bf.poison();
    matmul_backward(g, dinp_bf, nullptr, dout, inp, weight, N, C, OC, stream());  // frozen: no weight product
    CHECK_REL("backward dinp, frozen weight", download(dinp_bf.get(), N * C).data(), dinp_ref.data(), N * C, kTolBf16);

    // activation-gradient accumulation (two branches feeding one input)
    auto dinp_acc = upload(dinp_ref);
    matmul_backward_input(g, dinp_acc, DType::f32, dout, weight, N, C, OC, stream(), /*accumulate=*/true);
    std::vector<float> twice(N * C);
    for (int64_t i = 0; i < N * C; ++i) twice[i] = 2.0f * dinp_ref[i];
    CHECK_REL("backward dinp accumulate", download(dinp_acc.get(), N * C).data(), twice.data(), N * C, kTolF32);
  }
}

GPU_TEST_CASE("cuda matmul: padded row stride of out / dout (lm-head logits)") {
  // An odd vocabulary: split into a body of 1024 rows and a tail of 77 (aligned_body);
  // dout's padding is NaN, so a tail that read past OC would show.
  const int64_t N = 33, C = 64, OC = 1101, ldo = 1104;
  Problem p(N, C, OC);
  Gemm& g = runtime().gemm();
  auto inp = upload_bf16(p.inp), weight = upload_bf16(p.weight);
  std::vector<float> ref(N * OC);
  spes::cpu::matmul_forward(ref.data(), p.inp.data(), p.weight.data(), N, C, OC);
  DevTensor<float> out(N * ldo);
  out.poison();
  matmul_forward(g, out, DType::f32, inp, weight, N, C, OC, stream(), false, ldo);
  const std::vector<float> o = download(out.get(), N * ldo);
  std::vector<float> dense(N * OC);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < OC; ++i) dense[n * OC + i] = o[n * ldo + i];
  CHECK_REL("forward, ldo > OC", dense.data(), ref.data(), N * OC, kTolF32);

  // dout with NaN padding: the backward products must never read it
  std::vector<float> dout_padded(N * ldo, NAN);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < OC; ++i) dout_padded[n * ldo + i] = p.dout[n * OC + i];
  auto dout = upload_bf16(dout_padded);
  std::vector<float> dinp_ref(N * C), dw_ref(OC * C, 0.0f);
  spes::cpu::matmul_backward(dinp_ref.data(), dw_ref.data(), p.dout.data(), p.inp.data(), p.weight.data(), N, C, OC);
  DevTensor<float> dinp(N * C), dw(OC * C);
  dinp.poison();
  dw.poison();
  matmul_backward_input(g, dinp, DType::f32, dout, weight, N, C, OC, stream(), false, ldo);
  matmul_backward_weight(g, dw, dout, inp, N, C, OC, stream(), false, ldo);
  CHECK_REL("backward dinp, ldo > OC", download(dinp.get(), N * C).data(), dinp_ref.data(), N * C, kTolF32);
  CHECK_REL("backward dweight, ldo > OC", download(dw.get(), OC * C).data(), dw_ref.data(), OC * C, kTolF32);
}

GPU_TEST_CASE("cuda matmul: one plan per problem, reused") {
  Gemm& g = runtime().gemm();
  Problem p(48, 64, 72);
  auto inp = upload_bf16(p.inp), weight = upload_bf16(p.weight);
  DevTensor<float> out(p.N * p.OC);
  matmul_forward(g, out, DType::f32, inp, weight, p.N, p.C, p.OC, stream());
  const size_t plans = g.cached_plans();
  for (int i = 0; i < 3; ++i) matmul_forward(g, out, DType::f32, inp, weight, p.N, p.C, p.OC, stream());
  CHECK(g.cached_plans() == plans);
  matmul_forward(g, out, DType::f32, inp, weight, p.N - 1, p.C, p.OC, stream());
  CHECK(g.cached_plans() == plans + 1);
  cuda_check(cudaStreamSynchronize(stream()));
}

namespace {

// True when every value is NaN: a poisoned element nothing wrote.
bool all_nan(const std::vector<float>& v) {
  for (float x : v)
    if (!std::isnan(x)) return false;
  return true;
}

}  // namespace

GPU_TEST_CASE("cuda matmul: empty reduction (k = 0) gives the CPU's zeros, empty outputs are no-ops") {
  Gemm& g = runtime().gemm();
  const size_t plans = g.cached_plans();
  const int64_t N = 5, C = 16, OC = 24, ldo = 32;
  // k = 0 products read nothing: zero-length inputs (one-element buffers here).
  DevTensor<bf16> none(0);
  const std::vector<float> nothing(1);  // the CPU's zero-length inputs
  const float* z = nothing.data();

  // forward, C = 0: every valid entry of out becomes 0 like the CPU; the row padding
  // beyond OC (ldo > OC) stays as it was (poisoned).
  std::vector<float> ref(N * OC, NAN);
  spes::cpu::matmul_forward(ref.data(), z, z, N, 0, OC);
  for (DType t : {DType::f32, DType::bf16}) {
    CAPTURE(int(t));
    DevTensor<float> out_f(N * ldo);
    DevTensor<bf16> out_b(N * ldo);
    out_f.poison();
    out_b.poison();
    void* out = t == DType::f32 ? static_cast<void*>(out_f.get()) : static_cast<void*>(out_b.get());
    matmul_forward(g, out, t, none, none, N, 0, OC, stream(), false, ldo);
    const std::vector<float> o = t == DType::f32 ? download(out_f.get(), N * ldo) : download(out_b.get(), N * ldo);
    std::vector<float> valid, pad;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < ldo; ++i) {
        if (i < OC) valid.push_back(o[n * ldo + i]);
        else pad.push_back(o[n * ldo + i]);
      }
    CHECK_MESSAGE(bitwise_equal(valid, ref), "forward with C = 0 must write the CPU's zeros");
    CHECK_MESSAGE(all_nan(pad), "forward with C = 0 wrote into the row padding beyond OC");
  }
  // ... and with accumulate it adds an empty product: out unchanged.
  const std::vector<float> prior = random_vector(N * OC);
  auto acc = upload(prior);
  matmul_forward(g, acc, DType::f32, none, none, N, 0, OC, stream(), /*accumulate=*/true);
  CHECK(bitwise_equal(download(acc.get(), N * OC), prior));

  // backward, OC = 0: dinp = zeros (cpu::matmul_backward zero-fills it); no dweight.
  std::vector<float> dinp_ref(N * C, NAN);
  spes::cpu::matmul_backward(dinp_ref.data(), nullptr, z, z, z, N, C, 0);
  DevTensor<bf16> dinp(N * C);
  dinp.poison();
  auto inp = upload_bf16(random_vector(N * C));
  matmul_backward(g, dinp, nullptr, none, inp, none, N, C, 0, stream());
  CHECK(bitwise_equal(download(dinp.get(), N * C), dinp_ref));
  DevTensor<float> dinp_f(N * C);
  dinp_f.poison();
  matmul_backward_input(g, dinp_f, DType::f32, none, none, N, C, 0, stream());
  CHECK(bitwise_equal(download(dinp_f.get(), N * C), dinp_ref));

  // backward, N = 0 (an expert with no tokens): dweight += nothing (unchanged, as the
  // CPU), or zeros when overwriting.
  const std::vector<float> dw_prior = random_vector(OC * C);
  std::vector<float> dw_ref = dw_prior;
  spes::cpu::matmul_backward(nullptr, dw_ref.data(), z, z, z, 0, C, OC);
  auto dw = upload(dw_prior);
  matmul_backward_weight(g, dw, none, none, 0, C, OC, stream(), /*accumulate=*/true);
  CHECK(bitwise_equal(download(dw.get(), OC * C), dw_ref));
  matmul_backward_weight(g, dw, none, none, 0, C, OC, stream(), /*accumulate=*/false);
  CHECK(bitwise_equal(download(dw.get(), OC * C), std::vector<float>(OC * C, 0.0f)));

  // Empty outputs (N = 0 or OC = 0 forward, C = 0 backward input): nothing is written.
  DevTensor<float> sentinel(64);
  sentinel.poison();
  matmul_forward(g, sentinel, DType::f32, none, none, 0, C, OC, stream());
  matmul_forward(g, sentinel, DType::f32, none, none, N, C, 0, stream());
  matmul_backward_input(g, sentinel, DType::f32, none, none, N, 0, OC, stream());
  matmul_backward_weight(g, sentinel, none, none, N, C, 0, stream(), false);
  CHECK_MESSAGE(all_nan(download(sentinel.get(), 64)), "an empty product wrote to its output");
  CHECK(g.cached_plans() == plans);  // none of these needed a cuBLASLt plan
}

// Argument checks throw on the host before any CUDA call: no GPU needed (a Gemm over
// no handle is never asked to run; fake device addresses are never dereferenced).
TEST_CASE("cuda matmul: a foreign stream, bad leading dimensions, null pointers throw before any CUDA call") {
  Gemm g(nullptr, nullptr, 0, nullptr);
  bf16* a = reinterpret_cast<bf16*>(0x10000);
  float* f = reinterpret_cast<float*>(0x20000);
  // The shared workspace allows one stream only.
  CHECK_THROWS_ERROR(matmul_forward(g, f, DType::f32, a, a, 4, 8, 16, reinterpret_cast<cudaStream_t>(0x40)),
                     "Runtime's stream only");
  CHECK_THROWS_ERROR(matmul_forward(g, f, DType::f32, a, a, 4, 8, 16, nullptr, false, 10), "leading dimension");
  CHECK_THROWS_ERROR(matmul_forward(g, nullptr, DType::f32, a, a, 4, 8, 16, nullptr),
                     "matmul_forward: out must not be null");
  CHECK_THROWS_ERROR(matmul_forward(g, f, DType::f32, nullptr, a, 4, 8, 16, nullptr), "inp must not be null");
  CHECK_THROWS_ERROR(matmul_forward(g, reinterpret_cast<float*>(0x20002), DType::f32, a, a, 4, 8, 16, nullptr),
                     "out must be 4-byte aligned");
  CHECK_THROWS_ERROR(matmul_backward_input(g, f, DType::bf16, a, nullptr, 4, 8, 16, nullptr),
                     "matmul_backward_input: weight must not be null");
  CHECK_THROWS_ERROR(matmul_backward_weight(g, nullptr, a, a, 4, 8, 16, nullptr), "dweight must not be null");
}
