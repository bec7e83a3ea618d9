// The emulated CUDA runtime's one asynchrony (tests/emu/runtime_emu.cpp): copies
// between device memory and pinned host memory are not done, as far as the host may
// rely on, until it waits for them. Device → pinned: the bytes arrive at the wait
// (NaN before it). Pinned → device: the source must hold still until the wait; a
// staging buffer refilled too early is an abort, as on a GPU it would copy whichever
// bytes were there when the DMA ran. Pageable memory is synchronous both ways. And a
// kernel reads device or pinned memory only: a pageable pointer argument aborts.
#include "tests/emu/emu_test.hpp"

#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/launch.cuh"

namespace {

using spes::test::has;
using spes::test::run_in_child;

__global__ void add_one(float* out, const float* in) {
  if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = in[0] + 1.0f;
}

struct Fixture {
  static constexpr int kN = 64;
  cudaStream_t stream = nullptr;
  float* device = nullptr;
  float* pinned = nullptr;
  Fixture() {
    REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&device), kN * sizeof(float)) == cudaSuccess);
    REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&pinned), kN * sizeof(float)) == cudaSuccess);
    for (int i = 0; i < kN; ++i) pinned[i] = float(i);
  }
  ~Fixture() {
    cudaFreeHost(pinned);
    cudaFree(device);
    cudaStreamDestroy(stream);
  }
  void to_device() const {
    REQUIRE(cudaMemcpyAsync(device, pinned, kN * sizeof(float), cudaMemcpyHostToDevice, stream) == cudaSuccess);
  }
  void to_pinned() const {
    REQUIRE(cudaMemcpyAsync(pinned, device, kN * sizeof(float), cudaMemcpyDeviceToHost, stream) == cudaSuccess);
  }
};

}  // namespace

TEST_CASE("emulated runtime: a device-to-pinned copy reaches the host at the wait, not before") {
  Fixture f;
  f.to_device();
  REQUIRE(cudaStreamSynchronize(f.stream) == cudaSuccess);
  std::memset(f.pinned, 0, Fixture::kN * sizeof(float));
  f.to_pinned();
  CHECK(std::isnan(f.pinned[5]));  // in flight
  cudaEvent_t done = nullptr;
  REQUIRE(cudaEventCreate(&done) == cudaSuccess);
  REQUIRE(cudaEventRecord(done, f.stream) == cudaSuccess);
  REQUIRE(cudaEventSynchronize(done) == cudaSuccess);
  CHECK(f.pinned[5] == 5.0f);
  cudaEventDestroy(done);
}

// Refilled after the wait (for the copy's stream or an event after it): fine; before
// it: an abort; waiting on another stream does not wait for this copy. Pageable
// memory: the runtime stages it before returning, so it may change at once.
TEST_CASE("emulated runtime: a pinned source must hold still until the host waited for its copy") {
  const std::string waited = run_in_child([] {
    Fixture f;
    f.to_device();
    cudaStreamSynchronize(f.stream);
    f.pinned[3] = -1.0f;
    f.to_device();
    cudaEvent_t done = nullptr;
    cudaEventCreate(&done);
    cudaEventRecord(done, f.stream);
    cudaEventSynchronize(done);
    f.pinned[3] = -2.0f;
    std::vector<float> pageable(Fixture::kN, 1.0f);
    cudaMemcpyAsync(f.device, pageable.data(), Fixture::kN * sizeof(float), cudaMemcpyHostToDevice, f.stream);
    pageable[0] = 7.0f;
    cudaStreamSynchronize(f.stream);
    cudaEventDestroy(done);
  });
  CHECK_MESSAGE(waited == "[returned]", waited);
  const std::string early = run_in_child([] {
    Fixture f;
    f.to_device();
    f.pinned[3] = -1.0f;  // the next micro-batch's tokens, before the copy was waited for
    cudaStreamSynchronize(f.stream);
  });
  CHECK(has(early, "[aborted]"));
  CHECK(has(early, "changed before the host waited for the copy"));
  const std::string other = run_in_child([] {
    Fixture f;
    cudaStream_t s2 = nullptr;
    cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking);
    f.to_device();
    cudaStreamSynchronize(s2);
    f.pinned[3] = -1.0f;
    cudaStreamSynchronize(f.stream);
  });
  CHECK(has(other, "[aborted]"));
}

TEST_CASE("emulated runtime: a kernel's pointer arguments must be device or pinned memory, never pageable") {
  Fixture f;
  auto run = [&](float* out, const float* in) {
    spes::cuda::launch(add_one, dim3(1), dim3(32), 0, f.stream, out, in);
  };
  run(f.device, f.device + 1);
  run(f.pinned, f.pinned + 1);  // pinned host memory: a GPU reaches it over the bus
  REQUIRE(cudaStreamSynchronize(f.stream) == cudaSuccess);
  CHECK(f.pinned[0] == 2.0f);
  CHECK(emu::device_reachable(f.device + Fixture::kN));  // one past the end is a pointer a kernel may hold
  const std::string msg = run_in_child([&] {
    std::vector<float> pageable(4, 1.0f);
    run(f.device, pageable.data());
  });
  CHECK(has(msg, "EMU: launch of add_one: argument 2 ("));
  CHECK(has(msg, "points neither into device memory nor into pinned host memory"));
  CHECK(has(msg, "[aborted]"));
}
