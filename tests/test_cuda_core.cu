// Device runtime: handles, arena planning/alignment, clear memory errors.
#include <cublas_v2.h>

#include <string>

#include "cuda/matmul.cuh"
#include "tests/cuda_test.cuh"

using namespace spes::cuda;
using namespace spes::test;

GPU_TEST_CASE("cuda runtime: device, stream and handles") {
  Runtime& rt = runtime();
  MESSAGE("GPU " << rt.info().ordinal << ": " << rt.info().name << " sm_" << rt.info().cc_major
                 << rt.info().cc_minor << ", " << rt.info().sm_count << " SMs, " << format_bytes(rt.info().total_bytes));
  CHECK(rt.info().cc_major >= 8);
  CHECK(rt.stream() != nullptr);
  CHECK(rt.cublas() != nullptr);
  CHECK(rt.cublaslt() != nullptr);
  // The cuBLAS handle shares the GEMM workspace with gemm(): it must be bound to the
  // same (only) stream, and gemm() refuses any other.
  cudaStream_t bound = nullptr;
  cublas_check(cublasGetStream(rt.cublas(), &bound));
  CHECK(bound == rt.stream());
  // bf16-output GEMMs (the expert GEMMs' cublasGemmEx) reduce split-k partial sums in
  // fp32, as the CPU reference and the emulator do: the precision the step tests'
  // tolerances assume.
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
  cublas_check(cublasGetMathMode(rt.cublas(), &math));
  CHECK((math & CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION) != 0);
  cudaStream_t other = nullptr;
  cuda_check(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  DevTensor<float> out(16);
  DevTensor<bf16> in(16);
  CHECK_THROWS_WITH_AS(matmul_forward(rt.gemm(), out, DType::f32, in, in, 2, 8, 2, other), doctest::Contains("stream"),
                       spes::Error);
  cuda_check(cudaStreamDestroy(other));
  CHECK_THROWS_WITH_AS(Runtime(1 << 20), doctest::Contains("requested"), spes::Error);
}

GPU_TEST_CASE("cuda runtime: arena plan matches allocations, aligned, overflow is an error") {
  ArenaPlan plan;
  plan.reserve<float>(3);
  plan.reserve<bf16>(1001);
  plan.reserve<int32_t>(7, 16);
  plan.reserve_bytes(1);
  // The base is only as aligned as cudaMalloc makes it: more than that is refused.
  CHECK_THROWS_WITH_AS(plan.reserve_bytes(1, 1024), doctest::Contains("≤ 256"), spes::Error);
  CHECK_THROWS_WITH_AS(plan.reserve_bytes(1, 48), doctest::Contains("power of two"), spes::Error);
  DeviceArena arena(plan.bytes(), "test arena");
  float* a = arena.alloc<float>(3);
  bf16* b = arena.alloc<bf16>(1001);
  int32_t* c = arena.alloc<int32_t>(7, 16);
  void* d = arena.alloc_bytes(1);
  CHECK(arena.used() == plan.bytes());
  CHECK(aligned(a, kArenaAlign));
  CHECK(aligned(b, kArenaAlign));
  CHECK(aligned(c, 16));
  CHECK(reinterpret_cast<char*>(c) < reinterpret_cast<char*>(b) + 1001 * sizeof(bf16) + 16);  // packed at 16
  CHECK(aligned(d, kArenaAlign));
  CHECK_THROWS_WITH_AS(arena.alloc_bytes(1, 512), doctest::Contains("≤ 256"), spes::Error);
  CHECK(reinterpret_cast<char*>(b) >= reinterpret_cast<char*>(a) + 3 * sizeof(float));
  CHECK_THROWS_WITH_AS(arena.alloc<float>(1), doctest::Contains("ArenaPlan"), spes::Error);
  // rewinding reuses the same addresses: no allocation in the step loop
  arena.reset(0);
  CHECK(arena.alloc<float>(3) == a);
  // writable end to end
  cuda_check(cudaMemsetAsync(arena.base(), 0, arena.capacity(), stream()));
  cuda_check(cudaStreamSynchronize(stream()));
}

GPU_TEST_CASE("cuda runtime: too little memory says how much is needed and free") {
  const size_t huge = size_t(1) << 50;  // 1 PiB
  CHECK_THROWS_WITH_AS(require_device_memory(huge, "test model"), doctest::Contains("test model needs 1048576.00 GiB"),
                       spes::Error);
  CHECK_THROWS_WITH_AS(DeviceArena(huge, "big arena"), doctest::Contains("free (of"), spes::Error);
}
