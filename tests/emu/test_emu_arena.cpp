// The arena's guards in the emulator (tests/emu/nvtx_emu.cpp): cuda::DeviceArena
// registers its buffers as an NVTX memory pool, as compute-sanitizer sees them on a
// GPU, and the emulator checks every launch against them — a kernel writing past its
// buffer stops at that launch with the buffer's name, and a kernel's or library's
// operand must lie inside one buffer, not across a guard.
#include "tests/emu/emu_test.hpp"

#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "cuda/launch.cuh"
#include "cuda/runtime.cuh"

namespace {

using spes::test::has;
using spes::test::run_in_child;

__global__ void write_at(float* buffer, int64_t i) {
  if (blockIdx.x == 0 && threadIdx.x == 0) buffer[i] = 1.0f;
}

struct Arena {
  static constexpr size_t kBytes[3] = {12, 2000, 30};
  cudaStream_t stream = nullptr;
  spes::cuda::DeviceArena arena;
  char* at[3];
  Arena() {
    REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
    size_t capacity = 0;
    for (size_t b : kBytes) capacity += spes::cuda::arena_slot_bytes(b);
    arena = spes::cuda::DeviceArena(capacity, "emulated arena");
    const char* names[3] = {"a", "b", "c"};
    for (int i = 0; i < 3; ++i) at[i] = static_cast<char*>(arena.alloc_bytes(names[i], kBytes[i]));
    arena.seal(stream);
  }
  ~Arena() { cudaStreamDestroy(stream); }
  void write(int buffer, int64_t float_index) const {
    spes::cuda::launch(write_at, dim3(1), dim3(32), 0, stream, reinterpret_cast<float*>(at[buffer]), float_index);
  }
};

}  // namespace

TEST_CASE("emulated arena: a kernel writing past its buffer stops at that launch, naming the buffer") {
  const std::string inside = run_in_child([] {
    Arena a;
    a.write(1, 2000 / 4 - 1);  // the last float of b
    a.arena.check_guards(a.stream);
  });
  CHECK(inside == "[returned]");
  const std::string past = run_in_child([] {
    Arena a;
    a.write(1, 2000 / 4);  // the first float after b
    std::fprintf(stderr, "not stopped\n");
  });
  MESSAGE(past);
  CHECK(has(past, "EMU: launch of write_at, grid (1,1,1) block (32,1,1): byte 0 of the arena's guard after buffer "
                  "'b' (2000 B) changed"));
  CHECK(has(past, "[aborted]"));
  CHECK(!has(past, "not stopped"));
  // check_guards registers the guards while it reads them, then takes them back.
  const std::string after_check = run_in_child([] {
    Arena a;
    a.arena.check_guards(a.stream);
    if (emu::in_device_buffer(a.at[1], 2004)) std::fprintf(stderr, "guard still registered\n");
    a.write(1, 2000 / 4);
  });
  CHECK(!has(after_check, "guard still registered"));
  CHECK(has(after_check, "of the arena's guard after buffer 'b' (2000 B) changed"));
}

TEST_CASE("emulated arena: a kernel's operand lies inside one buffer, never across a guard") {
  Arena a;
  CHECK(emu::in_device_buffer(a.at[0], 12));
  CHECK(emu::in_device_buffer(a.at[1] + 1000, 1000));
  CHECK_FALSE(emu::in_device_buffer(a.at[0], 13));          // into a's guard
  CHECK_FALSE(emu::in_device_buffer(a.at[0] + 12, 4));      // inside the guard
  CHECK_FALSE(emu::in_device_buffer(a.at[1], 2000 + 600));  // across the guard into c
  // The runtime API sees the allocation: the arena fills and reads its guards through it.
  CHECK(emu::in_global_buffer(a.at[0], 13));
  // Memory outside any arena is one buffer, as before.
  void* plain = nullptr;
  REQUIRE(cudaMalloc(&plain, 100) == cudaSuccess);
  CHECK(emu::in_device_buffer(plain, 100));
  CHECK_FALSE(emu::in_device_buffer(plain, 101));
  cudaFree(plain);
  const std::string out = run_in_child([] {
    Arena a;
    emu::require_device_buffer(a.at[2] - 8, 16, "ncclAllReduce, sendbuff");
  });
  CHECK(has(out, "EMU: ncclAllReduce, sendbuff: 16 bytes outside every device buffer"));
}
