// The check of the sm90a attention kernels against the portable ones on the device
// that is about to run them (contract: attention.cuh, attention_sm90a_check_failure).
//
// Why: the sm90a kernels read their operands through wgmma's matrix descriptors and
// register fragments, whose layouts only the hardware defines; the emulator runs them
// as we decoded the PTX ISA. A GPU whose reading differs would train on wrong
// gradients without a word, so before the automatic choice first takes them on a
// device, the launchers run both families on one small problem and compare. The
// problem covers what the layouts and the pipelines touch: both head dims, a partial
// query block and key block (T = 160: blocks of 128 queries and 64 keys), several
// key blocks per query block, GQA (4 query heads over 2 kv heads), values of either
// sign. Relative error per output (‖sm90a − portable‖ / ‖portable‖), non-finite
// counting as infinite, against test_cuda_attention's bf16 tolerance; on the
// emulator the two agree bit for bit. The inputs come from a fixed generator, so the
// check is the same on every run. It costs a few milliseconds on a GPU, once per
// device and process.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda/attention.cuh"
#include "cuda/check.cuh"
#include "cuda/runtime.cuh"
#include "cuda/sm90a_device.cuh"
#include "engine/base/error.hpp"

namespace spes::cuda {
namespace {

constexpr int64_t kB = 1, kT = 160, kH = 4, kHkv = 2;
constexpr double kTolerance = 2e-2;  // test_cuda_attention's bf16 tolerance

// n values in [-1, 1) from a fixed linear congruential generator, rounded to bf16.
std::vector<bf16> check_values(size_t n, uint32_t seed) {
  std::vector<bf16> v(n);
  uint32_t x = seed;
  for (bf16& e : v) {
    x = x * 1664525u + 1013904223u;
    e = __float2bfloat16(float(x >> 8) / float(1u << 23) - 1.0f);
  }
  return v;
}

std::vector<float> download_bf16(const DeviceBuffer& b) {
  const std::vector<bf16> h = download_buffer<bf16>(b);
  std::vector<float> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) f[i] = __bfloat162float(h[i]);
  return f;
}

// ‖a − ref‖ / ‖ref‖, infinite if anything is not finite (ref non-zero: random inputs).
double relative_error(const std::vector<float>& a, const std::vector<float>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(ref[i])) return INFINITY;
    diff += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : (diff > 0 ? INFINITY : 0.0);
}

// The outputs of one family: out, lse, dq, dk, dv.
constexpr const char* kOutputs[5] = {"out", "lse", "dq", "dk", "dv"};

std::vector<std::vector<float>> run_path(AttentionPath path, int64_t D, const DeviceBuffer& q, const DeviceBuffer& k,
                                         const DeviceBuffer& v, const DeviceBuffer& dout) {
  const size_t nq = size_t(kB * kT * kH * D), nkv = size_t(kB * kT * kHkv * D), nl = size_t(kB * kH * kT);
  DeviceBuffer out(nq * sizeof(bf16), "attention check out"), lse(nl * sizeof(float), "attention check lse"),
      dq(nq * sizeof(bf16), "attention check dq"), dk(nkv * sizeof(bf16), "attention check dk"),
      dv(nkv * sizeof(bf16), "attention check dv"),
      scratch(attention_backward_scratch_bytes(kB, kT, kH), "attention check scratch");
  const cudaStream_t stream = nullptr;  // the legacy stream: cudaMemcpy waits for it
  attention_forward(out.as<bf16>(), lse.as<float>(), q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), kB, kT, kH, kHkv, D,
                    stream, path);
  attention_backward(dq.as<bf16>(), dk.as<bf16>(), dv.as<bf16>(), dout.as<bf16>(), q.as<bf16>(), k.as<bf16>(),
                     v.as<bf16>(), out.as<bf16>(), lse.as<float>(), scratch.get(), kB, kT, kH, kHkv, D, stream, path);
  cuda_check(cudaStreamSynchronize(stream));
  return {download_bf16(out), download_buffer<float>(lse), download_bf16(dq), download_bf16(dk), download_bf16(dv)};
}

// Empty when the two families agree at head dim D, else the first disagreement.
std::string compare_at(int64_t D) {
  const size_t nq = size_t(kB * kT * kH * D), nkv = size_t(kB * kT * kHkv * D);
  const DeviceBuffer q = upload_buffer(check_values(nq, 1), "attention check q"),
                     k = upload_buffer(check_values(nkv, 2), "attention check k"),
                     v = upload_buffer(check_values(nkv, 3), "attention check v"),
                     dout = upload_buffer(check_values(nq, 4), "attention check dout");
  const auto portable = run_path(AttentionPath::portable, D, q, k, v, dout);
  const auto sm90a = run_path(AttentionPath::sm90a, D, q, k, v, dout);
  for (int i = 0; i < 5; ++i) {
    const double err = relative_error(sm90a[i], portable[i]);
    if (!(err <= kTolerance)) {
      char line[160];
      std::snprintf(line, sizeof line, "%s at head dim %lld: relative error %.3g against the portable kernels > %.0e",
                    kOutputs[i], static_cast<long long>(D), err, kTolerance);
      return line;
    }
  }
  return "";
}

struct CheckResult {
  std::string failure;
};

CheckResult run_check(int dev) {
  CheckResult r;
  try {
    for (int64_t D : {64, 128})
      if (r.failure.empty()) r.failure = compare_at(D);
  } catch (const Error& e) {
    throw Error(std::string("attention: checking the sm90a kernels against the portable ones on GPU ") +
                std::to_string(dev) + " failed: " + e.what() + " (SPES_ATTENTION=portable keeps the portable kernels)");
  }
  if (!r.failure.empty())
    std::fprintf(stderr,
                 "spes: attention: the sm90a (wgmma) kernels disagree with the portable ones on GPU %d (%s); the "
                 "portable kernels run instead\n",
                 dev, r.failure.c_str());
  return r;
}

}  // namespace

std::string attention_sm90a_check_failure() {
  if (!attention_sm90a_available()) return "";
  return per_device<CheckResult>(run_check).failure;
}

}  // namespace spes::cuda
