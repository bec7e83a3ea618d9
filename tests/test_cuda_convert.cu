// fp32 → bf16 on the device (cuda/convert.cu): the cast that makes the compute copy
// of θ at every load and every sync round. Checked bit for bit against the CPU's
// round-to-nearest-even (model/safetensors.cpp, the HF export's, tested on its own in
// test_export): every length around the 8-wide vector path, aligned and unaligned
// pointers (the scalar path), the values rounding cares about, and a guard element
// after the output that must stay untouched, under every schedule
// (for_each_schedule). Then the chunked copy from host memory through a staging
// buffer smaller than θ, as GpuBackend::push_theta runs it for any model over 16 M
// parameters (the test models are far smaller and run one chunk).
#include <cuda_runtime.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cuda/convert.cuh"
#include "model/safetensors.hpp"
#include "tests/cuda_test.cuh"

using namespace spes::test;
using spes::cuda::bf16;

namespace {

// Random values with the cases rounding cares about mixed in: ties to even (both
// ways), just above a tie, ±0, subnormals, ±inf, the largest float (rounds to inf),
// NaN.
std::vector<float> values_to_round(int64_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  const float special[] = {std::bit_cast<float>(0x3F808000u), std::bit_cast<float>(0x3F818000u),
                           std::bit_cast<float>(0x3F808001u), -0.0f, 0.0f, std::bit_cast<float>(0x00000001u),
                           std::bit_cast<float>(0x807FFFFFu), std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                           std::nanf("")};
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = i % 13 == 5 ? special[(i / 13) % 11] : d(g);
  return v;
}

// Number of outputs that are not the CPU's rounding of `in` (NaN only as a NaN: the
// device's canonical NaN need not have the CPU's payload).
int64_t wrong_roundings(const std::vector<uint16_t>& out, const float* in, int64_t n, int64_t* first) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t want = spes::float_to_bf16(in[i]);
    const uint16_t got = out[size_t(i)];
    const bool ok = std::isnan(in[i]) ? ((got & 0x7F80) == 0x7F80 && (got & 0x7F) != 0) : got == want;
    if (!ok && bad++ == 0) *first = i;
  }
  return bad;
}

std::vector<uint16_t> bits_of(const DevTensor<bf16>& t, int64_t offset, int64_t n) {
  const std::vector<bf16> h = copy_to_host(t.get() + offset, n);
  std::vector<uint16_t> bits(h.size());
  std::memcpy(bits.data(), h.data(), h.size() * sizeof(uint16_t));
  return bits;
}

}  // namespace

GPU_TEST_CASE("float_to_bf16: round to nearest even, bit for bit, any length and alignment") {
  for (const int64_t n : {int64_t(1), int64_t(7), int64_t(8), int64_t(9), int64_t(15), int64_t(4099)}) {
    for (const int64_t out_off : {0, 1}) {
      for (const int64_t in_off : {0, 1}) {
        const std::vector<float> h = values_to_round(n + in_off, unsigned(n * 4 + out_off * 2 + in_off));
        const DevTensor<float> in = upload(h);
        DevTensor<bf16> out(n + out_off + 1);  // + a guard element after the last output
        for_each_schedule("float_to_bf16", {out}, [&] {
          spes::cuda::float_to_bf16(out.get() + out_off, in.get() + in_off, n, stream());
          const std::vector<uint16_t> got = bits_of(out, out_off, n + 1);
          int64_t first = -1;
          const int64_t bad = wrong_roundings(got, h.data() + in_off, n, &first);
          CHECK_MESSAGE(bad == 0, "n " << n << ", out +" << out_off << ", in +" << in_off << ": " << bad
                                       << " wrong, first at " << first);
          CHECK_MESSAGE(got[size_t(n)] == 0xFFFF, "n " << n << ": the element after the output was written");
        });
      }
    }
  }
  spes::cuda::float_to_bf16(nullptr, nullptr, 0, stream());  // nothing to do
  CHECK_THROWS_AS(spes::cuda::float_to_bf16(nullptr, nullptr, 4, stream()), spes::Error);
}

GPU_TEST_CASE("float_to_bf16_from_host: chunks through a small staging buffer equal one whole conversion") {
  const int64_t n = 2053;  // prime: no staging size below divides it
  const std::vector<float> h = values_to_round(n, 99);
  float* pinned = nullptr;
  cuda_check(cudaMallocHost(&pinned, size_t(n) * sizeof(float)));
  std::memcpy(pinned, h.data(), size_t(n) * sizeof(float));
  for (const int64_t staging_count : {int64_t(1), int64_t(7), int64_t(256), int64_t(1000), n, 2 * n}) {
    for (const int64_t out_off : {0, 1}) {
      DevTensor<float> staging(staging_count);
      staging.poison();
      DevTensor<bf16> out(n + out_off + 1);
      out.poison();
      spes::cuda::float_to_bf16_from_host(out.get() + out_off, pinned, n, staging.get(), staging_count, stream());
      const std::vector<uint16_t> got = bits_of(out, out_off, n + 1);  // syncs the stream
      int64_t first = -1;
      const int64_t bad = wrong_roundings(got, h.data(), n, &first);
      CHECK_MESSAGE(bad == 0, "staging " << staging_count << ", out +" << out_off << ": " << bad
                                         << " wrong, first at " << first);
      CHECK_MESSAGE(got[size_t(n)] == 0xFFFF, "staging " << staging_count << ": the element after the output was written");
    }
  }
  DevTensor<float> staging(4);
  DevTensor<bf16> out(4);
  CHECK_THROWS_AS(spes::cuda::float_to_bf16_from_host(out.get(), pinned, 4, staging.get(), 0, stream()), spes::Error);
  cuda_check(cudaFreeHost(pinned));
}
