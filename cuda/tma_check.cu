// The check of the bulk tensor copy (TMA) and the mbarrier on the device that is about
// to run kernels built on them (contract: tma.cuh, tma_check_failure).
//
// Why: the copy engine lays a box out in shared memory in a swizzle that only the
// hardware defines, and signals its bytes on an mbarrier whose phases only the
// hardware keeps; the emulator (tests/emu/) copies and counts as we read the CUDA
// programming guide and the PTX ISA, and the kernels are written against it. A GPU
// whose copies differ would feed the tensor cores wrong operands without a word. So
// the check runs what those kernels do, on a small problem with known answers:
//   - a ring of two stages fed box by box (64 × 64 bf16, 128-byte swizzle) by one
//     producer thread, each stage's "full" barrier expecting the box's bytes and its
//     "empty" barrier released by 64 consumer threads, which undo the swizzle and
//     write the matrix back out; the matrix (200 × 136) has tails in both
//     dimensions, so boxes reach past it and must read zeros there; two CTAs, each
//     using each stage several times (the phases' parities alternate);
//   - one warpgroup's wgmma m64n64k16 × 4 on two boxes as its A and B (the
//     descriptors of cuda/grouped_gemm_sm90.cu's K-major operands), with no proxy
//     fence, against the product computed here.
// It costs well under a millisecond on a GPU, once per device and process.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/check.cuh"
#include "cuda/common.cuh"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/ptx_sm90.cuh"
#include "cuda/runtime.cuh"
#include "cuda/sm90a_device.cuh"
#include "cuda/tma.cuh"
#include "engine/base/error.hpp"

namespace spes::cuda {
namespace {

constexpr int kBox = 64;  // a box's rows and columns: 64 bf16 are one 128-byte swizzle row
constexpr uint32_t kBoxBytes = kBox * kBox * 2;
constexpr int kStages = 2;
constexpr unsigned kConsumers = 64, kRingThreads = 32 + kConsumers;  // warp 0's lane 0 produces
constexpr size_t kRingSmem = 1024 + kStages * kBoxBytes + 2 * kStages * 8;  // under 48 KB: no opt-in
constexpr size_t kWgmmaSmem = 1024 + 2 * kBoxBytes + 8;
constexpr int kRows = 200, kCols = 136;
// A wait gives up after this many cycles (about a second): a device whose barriers
// count otherwise than the emulator's would hang the check instead of failing it.
constexpr long long kWaitCycles = 1ll << 31;

#if SPES_SM90A_DEVICE_CODE
// Waits for the phase of `parity`; false, with *gave_up set, after kWaitCycles.
__device__ __forceinline__ bool wait_or_give_up(uint32_t bar, uint32_t parity, int* gave_up) {
  const long long start = clock64();
  while (!mbarrier_try_wait_parity(bar, parity))
    if (clock64() - start > kWaitCycles) {
      atomicExch(gave_up, 1);
      return false;
    }
  return true;
}
#endif

// The ring (see the file comment): CTA b copies row boxes b, b + gridDim.x, …, each
// row of boxes left to right; out gets the in-matrix part of each box, `outside`
// counts the elements of a box outside the matrix that did not read as zero, and
// gave_up is set by a wait that gave up (the CTA then stops).
__global__ void __launch_bounds__(kRingThreads) ring_copy_kernel(const __grid_constant__ CUtensorMap map,
                                                                 uint16_t* out, int* outside, int* gave_up) {
#if SPES_SM90A_DEVICE_CODE
  unsigned char* smem = dynamic_smem<unsigned char>;
  const uint32_t stages = (smem_addr(smem) + 1023) & ~1023u, bars = stages + kStages * kBoxBytes;
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kStages + s); };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full(s), 1);
      mbarrier_init(empty(s), kConsumers);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  constexpr int col_boxes = (kCols + kBox - 1) / kBox, row_boxes = (kRows + kBox - 1) / kBox;
  int n = 0;  // this CTA's boxes so far: stage n % kStages, in its use n / kStages
  for (int rb = blockIdx.x; rb < row_boxes; rb += gridDim.x)
    for (int cb = 0; cb < col_boxes; ++cb, ++n) {
      const int s = n % kStages;
      const uint32_t parity = uint32_t(n / kStages) & 1, stage = stages + s * kBoxBytes;
      if (threadIdx.x == 0) {
        if (!wait_or_give_up(empty(s), parity ^ 1, gave_up)) return;  // the consumers' release of its last use
        mbarrier_arrive_expect_tx(full(s), kBoxBytes);
        tma_load_2d(stage, &map, cb * kBox, rb * kBox, full(s));
      } else if (threadIdx.x >= 32) {
        if (!wait_or_give_up(full(s), parity, gave_up)) return;
        const unsigned char* box = smem + (stage - smem_addr(smem));
        for (int r = int(threadIdx.x) - 32; r < kBox; r += int(kConsumers))
          for (int chunk = 0; chunk < 8; ++chunk) {
            const uint16_t* v = reinterpret_cast<const uint16_t*>(box + r * 128 + ((chunk ^ (r % 8)) * 16));
            for (int i = 0; i < 8; ++i) {
              const int row = rb * kBox + r, col = cb * kBox + chunk * 8 + i;
              if (row < kRows && col < kCols)
                out[row * kCols + col] = v[i];
              else if (v[i] != 0)
                atomicAdd(outside, 1);
            }
          }
        mbarrier_arrive(empty(s));
      }
    }
#endif
}

// One warpgroup: A and B (64 × 64 each, K-major) copied as one box each onto one
// barrier; d = A·Bᵀ by four wgmma m64n64k16, written out row-major fp32.
__global__ void __launch_bounds__(128) wgmma_on_copies_kernel(const __grid_constant__ CUtensorMap a_map,
                                                              const __grid_constant__ CUtensorMap b_map, float* d_out,
                                                              int* gave_up) {
#if SPES_SM90A_DEVICE_CODE
  unsigned char* smem = dynamic_smem<unsigned char>;
  const uint32_t base = (smem_addr(smem) + 1023) & ~1023u, bar = base + 2 * kBoxBytes;
  if (threadIdx.x == 0) {
    mbarrier_init(bar, 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(bar, 2 * kBoxBytes);
    tma_load_2d(base, &a_map, 0, 0, bar);
    tma_load_2d(base + kBoxBytes, &b_map, 0, 0, bar);
  }
  if (!wait_or_give_up(bar, 0, gave_up)) return;
  float d[32] = {};  // the first wgmma overwrites it; zeroed so that it is never read undefined
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_ss<64, 0, 0>(d, sw128_descriptor(base + kk * 32, 16, 1024),
                       sw128_descriptor(base + kBoxBytes + kk * 32, 16, 1024), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulators(d);
  const int t = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int p = 0; p < 2; ++p)
        d_out[(16 * (t / 32) + (t % 32) / 4 + 8 * h) * 64 + 8 * j + 2 * (t % 4) + p] = d[4 * j + 2 * h + p];
#endif
}

// n bf16 bit patterns from a fixed linear congruential generator: values in [-1, 1),
// none zero (so a zero read back is a zero fill, not data).
std::vector<uint16_t> check_values(size_t n, uint32_t seed) {
  std::vector<uint16_t> v(n);
  uint32_t x = seed;
  for (uint16_t& e : v) {
    x = x * 1664525u + 1013904223u;
    const bf16 b = __float2bfloat16(float(x >> 8) / float(1u << 23) - 1.0f);
    std::memcpy(&e, &b, 2);
    if ((e & 0x7fff) == 0) e = 0x3f80;  // ±0 → 1
  }
  return v;
}

float bf16_value(uint16_t bits) {
  const uint32_t w = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

std::string check_ring() {
  const std::vector<uint16_t> values = check_values(size_t(kRows) * kCols, 11);
  const DeviceBuffer in = upload_buffer(values, "TMA check matrix"),
                     out = upload_buffer(std::vector<uint16_t>(values.size(), 0xFFFF), "TMA check copy"),  // NaN
                     outside = upload_buffer(std::vector<int>(1, 0), "TMA check outside count"),
                     gave_up = upload_buffer(std::vector<int>(1, 0), "TMA check timeout flag");
  const CUtensorMap map = bf16_matrix_map(in.get(), kRows, kCols, kCols, kBox, kBox, CU_TENSOR_MAP_SWIZZLE_128B);
  launch(ring_copy_kernel, dim3(2), dim3(kRingThreads), kRingSmem, nullptr, map, out.as<uint16_t>(),
         outside.as<int>(), gave_up.as<int>());
  cuda_check(cudaGetLastError());
  cuda_check(cudaDeviceSynchronize());
  if (download_buffer<int>(gave_up)[0] != 0) return "a wait in the ring of copies gave up: a phase never completed";
  const std::vector<uint16_t> back = download_buffer<uint16_t>(out);
  size_t wrong = 0, first = 0;
  for (size_t i = 0; i < values.size(); ++i)
    if (back[i] != values[i] && wrong++ == 0) first = i;
  const int nonzero_outside = download_buffer<int>(outside)[0];
  if (wrong == 0 && nonzero_outside == 0) return "";
  char line[200];
  std::snprintf(line, sizeof line,
                "the ring of copies gave %zu of %zu elements wrong (first at row %zu, column %zu) and %d elements "
                "outside the matrix not zero",
                wrong, values.size(), first / kCols, first % kCols, nonzero_outside);
  return line;
}

std::string check_wgmma_on_copies() {
  const std::vector<uint16_t> a = check_values(kBox * kBox, 12), b = check_values(kBox * kBox, 13);
  const DeviceBuffer a_dev = upload_buffer(a, "TMA check A"), b_dev = upload_buffer(b, "TMA check B"),
                     d_dev(kBox * kBox * sizeof(float), "TMA check D"),
                     gave_up = upload_buffer(std::vector<int>(1, 0), "TMA check timeout flag");
  const CUtensorMap a_map = bf16_matrix_map(a_dev.get(), kBox, kBox, kBox, kBox, kBox, CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap b_map = bf16_matrix_map(b_dev.get(), kBox, kBox, kBox, kBox, kBox, CU_TENSOR_MAP_SWIZZLE_128B);
  launch(wgmma_on_copies_kernel, dim3(1), dim3(128), kWgmmaSmem, nullptr, a_map, b_map, d_dev.as<float>(),
         gave_up.as<int>());
  cuda_check(cudaGetLastError());
  cuda_check(cudaDeviceSynchronize());
  if (download_buffer<int>(gave_up)[0] != 0) return "the wait for the wgmma's copied operands gave up";
  const std::vector<float> d = download_buffer<float>(d_dev);
  double worst = 0;
  for (int i = 0; i < kBox; ++i)
    for (int j = 0; j < kBox; ++j) {
      double ref = 0;
      for (int k = 0; k < kBox; ++k) ref += double(bf16_value(a[i * kBox + k])) * bf16_value(b[j * kBox + k]);
      const double err = std::abs(ref - d[i * kBox + j]) / (1 + std::abs(ref));
      if (!(err <= worst)) worst = std::isfinite(err) ? err : INFINITY;
    }
  constexpr double kTolerance = 1e-4;  // fp32 sums of 64 exact bf16 products, in some order
  if (worst <= kTolerance) return "";
  char line[160];
  std::snprintf(line, sizeof line, "a wgmma on copied boxes is off by %.3g (relative to 1 + |A·Bᵀ|) > %.0e", worst,
                kTolerance);
  return line;
}

struct Availability {
  std::string reason;
};
struct CheckResult {
  std::string failure;
};

CheckResult run_check(int dev) {
  CheckResult r;
  try {
    r.failure = check_ring();
    if (r.failure.empty()) r.failure = check_wgmma_on_copies();
  } catch (const Error& e) {
    throw Error("TMA: checking the bulk tensor copy on GPU " + std::to_string(dev) + " failed: " + e.what());
  }
  return r;
}

}  // namespace

std::string tma_unavailable_reason() {
  return per_device<Availability>([](int dev) {
           return Availability{sm90a_unavailable_reason(dev, kBuiltForSm90a, kRingSmem, ring_copy_kernel)};
         })
      .reason;
}

std::string tma_check_failure() {
  if (!tma_unavailable_reason().empty()) return "";
  return per_device<CheckResult>(run_check).failure;
}

}  // namespace spes::cuda
