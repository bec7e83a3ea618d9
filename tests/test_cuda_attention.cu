// CUDA flash attention vs the CPU reference (spes::cpu::attention_forward/backward).
// Inputs are random, rounded to bf16 and given to both sides as the same values; the
// CPU computes in fp32 from them. Tolerances (bf16 kernels, README, Architecture:
// Precision; relative error ‖gpu − cpu‖/‖cpu‖): out, dq, dk, dv 2e-2 (bf16 storage of
// out/grads alone costs ~3e-3, P and dS are rounded to bf16 for the tensor-core
// products); lse 1e-3 (fp32, differs only through fp32 summation order and
// ex2.approx). The kernels use no atomics, so a second backward run must give
// bit-identical gradients. The same tolerances hold for every head dim: each output
// element is one bf16 rounding of an fp32 sum, and the P/dS roundings are relative,
// so a smaller D (fewer terms per q·k dot product) changes nothing in the error
// budget.
#include <cstring>
#include <string>
#include <vector>

#include "cuda/attention.cuh"
#include "model/cpu/ops.hpp"
#include "tests/cuda_test.cuh"

using namespace spes::test;

namespace {

using spes::cuda::bf16;

struct Shape {
  int64_t B, T, H, Hkv, D;
  float q_scale;  // > 1 makes the softmax peaky, exercising the online rescale
};

void check_attention(const Shape& s) {
  const auto [B, T, H, Hkv, D, q_scale] = s;
  const std::string tag = "B=" + std::to_string(B) + " T=" + std::to_string(T) + " H=" + std::to_string(H) +
                          " Hkv=" + std::to_string(Hkv) + " D=" + std::to_string(D);
  INFO(tag);
  const int64_t nq = B * T * H * D, nkv = B * T * Hkv * D, nl = B * H * T;

  const std::vector<float> q = rounded_bf16(random_vector(nq, q_scale)), k = rounded_bf16(random_vector(nkv)),
                           v = rounded_bf16(random_vector(nkv)), dout = rounded_bf16(random_vector(nq));

  std::vector<float> out_ref(nq), lse_ref(nl), dq_ref(nq), dk_ref(nkv), dv_ref(nkv);
  spes::cpu::attention_forward(out_ref.data(), lse_ref.data(), q.data(), k.data(), v.data(), B, T, H, Hkv, D);
  spes::cpu::attention_backward(dq_ref.data(), dk_ref.data(), dv_ref.data(), dout.data(), q.data(), k.data(),
                                v.data(), out_ref.data(), lse_ref.data(), B, T, H, Hkv, D);

  auto d_q = upload_bf16(q), d_k = upload_bf16(k), d_v = upload_bf16(v), d_dout = upload_bf16(dout);
  DevTensor<bf16> out(nq), gq(nq), gk(nkv), gv(nkv);
  DevTensor<float> lse(nl);
  DevTensor<unsigned char> scratch(int64_t(spes::cuda::attention_backward_scratch_bytes(B, T, H)));
  out.poison();
  lse.poison();
  gq.poison();
  gk.poison();
  gv.poison();
  scratch.poison();

  spes::cuda::attention_forward(out, lse, d_q, d_k, d_v, B, T, H, Hkv, D, stream());
  spes::cuda::attention_backward(gq, gk, gv, d_dout, d_q, d_k, d_v, out, lse, scratch, B, T, H, Hkv, D, stream());

  const auto out_g = download(out.get(), nq), lse_g = download(lse.get(), nl);
  const auto dq_g = download(gq.get(), nq), dk_g = download(gk.get(), nkv), dv_g = download(gv.get(), nkv);
  const std::string n_out = "out " + tag, n_lse = "lse " + tag, n_dq = "dq " + tag, n_dk = "dk " + tag,
                    n_dv = "dv " + tag;
  CHECK_REL(n_out, out_g.data(), out_ref.data(), nq, 2e-2);
  CHECK_REL(n_lse, lse_g.data(), lse_ref.data(), nl, 1e-3);
  if (T > 1) {
    CHECK_REL(n_dq, dq_g.data(), dq_ref.data(), nq, 2e-2);
    CHECK_REL(n_dk, dk_g.data(), dk_ref.data(), nkv, 2e-2);
  } else {
    // One key: its probability is 1 whatever the scores, so dq and dk are zero and
    // both sides hold only rounding (dO·v − dO·O with O in bf16): a relative error
    // against that noise means nothing. Bound it absolutely instead.
    CHECK_MAX_ABS(n_dq, dq_g.data(), nq, 5e-2);
    CHECK_MAX_ABS(n_dk, dk_g.data(), nkv, 5e-2);
  }
  CHECK_REL(n_dv, dv_g.data(), dv_ref.data(), nkv, 2e-2);

  // Determinism: same inputs, freshly poisoned outputs → the same bits.
  gq.poison();
  gk.poison();
  gv.poison();
  spes::cuda::attention_backward(gq, gk, gv, d_dout, d_q, d_k, d_v, out, lse, scratch, B, T, H, Hkv, D, stream());
  const auto dq2 = download(gq.get(), nq), dk2 = download(gk.get(), nkv), dv2 = download(gv.get(), nkv);
  CHECK_MESSAGE(std::memcmp(dq2.data(), dq_g.data(), nq * sizeof(float)) == 0, "dq not deterministic " << tag);
  CHECK_MESSAGE(std::memcmp(dk2.data(), dk_g.data(), nkv * sizeof(float)) == 0, "dk not deterministic " << tag);
  CHECK_MESSAGE(std::memcmp(dv2.data(), dv_g.data(), nkv * sizeof(float)) == 0, "dv not deterministic " << tag);
}

}  // namespace

// Forward tiles are 128 queries × 64 keys; backward 64 × 64 (every head dim). The
// shapes cover one partial tile, tails of every kind, T = 1, MHA / GQA / MQA, every
// head dim, B > 1, and T > 1k (long K/V pipelines, many CTAs per head).
GPU_TEST_CASE("cuda attention matches the CPU reference, head dim 32") {
  // First: the tiny demo's attention (configs/tiny.toml: micro_batch 8, seq_len 256,
  // d_model 128 over 4 heads).
  for (const Shape& s : {Shape{8, 256, 4, 4, 32, 1.0f}, Shape{1, 64, 1, 1, 32, 1.0f}, Shape{2, 100, 4, 2, 32, 3.0f},
                         Shape{1, 1, 2, 1, 32, 1.0f}, Shape{3, 129, 6, 3, 32, 1.0f}, Shape{1, 515, 8, 1, 32, 1.0f},
                         Shape{1, 1030, 2, 2, 32, 3.0f}})
    check_attention(s);
}

GPU_TEST_CASE("cuda attention matches the CPU reference, head dim 64") {
  for (const Shape& s : {Shape{1, 64, 1, 1, 64, 1.0f}, Shape{2, 100, 4, 4, 64, 1.0f}, Shape{1, 1, 2, 1, 64, 1.0f},
                         Shape{1, 515, 8, 1, 64, 3.0f}, Shape{2, 256, 4, 2, 64, 1.0f},
                         Shape{1, 1030, 2, 2, 64, 1.0f}})
    check_attention(s);
}

GPU_TEST_CASE("cuda attention matches the CPU reference, head dim 128") {
  for (const Shape& s : {Shape{1, 128, 2, 2, 128, 1.0f}, Shape{1, 257, 4, 2, 128, 1.0f},
                         Shape{2, 300, 6, 2, 128, 3.0f}, Shape{1, 17, 3, 1, 128, 1.0f},
                         Shape{3, 192, 2, 2, 128, 1.0f}, Shape{1, 1100, 4, 1, 128, 1.0f}})
    check_attention(s);
}

// Argument checks run on the host before any CUDA call, so these cases need no GPU:
// the fake device addresses below are never dereferenced, and every call has exactly
// one bad argument (a call with none would launch on them). ctest runs this file only
// on a GPU machine; `spes_tests --source-file='*test_cuda_attention.cu'` runs these
// anywhere (the GPU cases then report themselves skipped).
namespace {
bf16* fake_bf16(uintptr_t address) { return reinterpret_cast<bf16*>(address); }
float* fake_f32(uintptr_t address) { return reinterpret_cast<float*>(address); }
}  // namespace

TEST_CASE("cuda attention: unsupported shapes and misaligned or null pointers throw before any CUDA call") {
  using spes::cuda::attention_backward;
  using spes::cuda::attention_forward;
  bf16* a = fake_bf16(0x10000);   // 16-byte aligned
  bf16* m = fake_bf16(0x10002);   // bf16-aligned only: what a view at an odd element offset gives
  float* l = fake_f32(0x20000);
  void* sc = reinterpret_cast<void*>(0x30000);
  const auto fwd = [&](bf16* out, float* lse, bf16* q, bf16* k, bf16* v, int64_t H, int64_t Hkv, int64_t D) {
    attention_forward(out, lse, q, k, v, 2, 16, H, Hkv, D, nullptr);
  };
  CHECK_THROWS_ERROR(fwd(a, l, a, a, a, 4, 3, 64), "attention_forward: H must be a positive multiple of Hkv");
  CHECK_THROWS_ERROR(fwd(a, l, a, a, a, 4, 4, 96), "head dim D must be 32, 64 or 128");
  CHECK_THROWS_ERROR(fwd(a, l, a, a, a, 4, 4, 16), "head dim D must be 32, 64 or 128");
  CHECK_THROWS_ERROR(fwd(a, l, a, a, a, 4, 4, 48), "head dim D must be 32, 64 or 128");
  // D = 32 passes the shape check: the one bad argument left is the one reported.
  CHECK_THROWS_ERROR(fwd(a, l, m, a, a, 4, 2, 32), "attention_forward: q must be 16-byte aligned");
  CHECK_THROWS_ERROR(fwd(a, l, m, a, a, 4, 4, 64), "attention_forward: q must be 16-byte aligned");
  CHECK_THROWS_ERROR(fwd(a, l, a, m, a, 4, 2, 128), "attention_forward: k must be 16-byte aligned");
  CHECK_THROWS_ERROR(fwd(a, l, a, a, m, 4, 4, 64), "attention_forward: v must be 16-byte aligned");
  CHECK_THROWS_ERROR(fwd(m, l, a, a, a, 4, 4, 64), "attention_forward: out must be 16-byte aligned");
  CHECK_THROWS_ERROR(fwd(a, nullptr, a, a, a, 4, 4, 64), "attention_forward: lse must not be null");
  CHECK_THROWS_ERROR(fwd(a, fake_f32(0x20002), a, a, a, 4, 4, 64), "lse must be 4-byte aligned");
  CHECK_THROWS_ERROR(fwd(nullptr, l, a, a, a, 4, 4, 64), "out must not be null");

  const auto bwd = [&](bf16* dq, bf16* dk, bf16* dv, bf16* dout, bf16* q, void* scratch) {
    attention_backward(dq, dk, dv, dout, q, a, a, a, l, scratch, 1, 100, 4, 2, 64, nullptr);
  };
  CHECK_THROWS_ERROR(bwd(m, a, a, a, a, sc), "attention_backward: dq must be 16-byte aligned");
  CHECK_THROWS_ERROR(bwd(a, m, a, a, a, sc), "attention_backward: dk must be 16-byte aligned");
  CHECK_THROWS_ERROR(bwd(a, a, m, a, a, sc), "attention_backward: dv must be 16-byte aligned");
  CHECK_THROWS_ERROR(bwd(a, a, a, m, a, sc), "attention_backward: dout must be 16-byte aligned");
  CHECK_THROWS_ERROR(bwd(a, a, a, a, m, sc), "attention_backward: q must be 16-byte aligned");
  CHECK_THROWS_ERROR(bwd(a, a, a, a, a, reinterpret_cast<void*>(0x30004)), "scratch must be 16-byte aligned");
  CHECK_THROWS_ERROR(bwd(a, a, a, a, a, nullptr), "scratch must not be null");
  CHECK_THROWS_ERROR(attention_backward(a, a, a, a, a, a, a, a, l, sc, 1, 100, 6, 4, 64, nullptr),
                     "attention_backward: H must be a positive multiple of Hkv");
  CHECK_THROWS_ERROR(attention_backward(a, a, a, a, a, a, a, a, l, sc, 1, 100, 4, 2, 80, nullptr),
                     "attention_backward: head dim D must be 32, 64 or 128");
  CHECK_THROWS_ERROR(attention_backward(a, a, a, a, a, a, a, a, l, nullptr, 1, 100, 4, 2, 32, nullptr),
                     "attention_backward: scratch must not be null");
}

