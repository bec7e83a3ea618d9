// Device runtime: handles, the arena (alignment, guards, poison), clear memory errors.
#include <string>

#include "cuda/launch.cuh"
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
  CHECK(rt.cublaslt() != nullptr);
  // Every GEMM plan shares one workspace: gemm() refuses any stream but the runtime's.
  cudaStream_t other = nullptr;
  cuda_check(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  DevTensor<float> out(16);
  DevTensor<bf16> in(16);
  CHECK_THROWS_WITH_AS(matmul_forward(rt.gemm(), out, DType::f32, in, in, 2, 8, 2, other), doctest::Contains("stream"),
                       spes::Error);
  cuda_check(cudaStreamDestroy(other));
  CHECK_THROWS_WITH_AS(Runtime(1 << 20), doctest::Contains("requested"), spes::Error);
}

namespace {

// Four buffers of odd sizes, carved and sealed: what the GPU backend does with the plan.
struct TestArena {
  static constexpr size_t kBytes[4] = {12, 2000, 30, 1};
  DeviceArena arena;
  char* at[4];
  TestArena() : arena(capacity(), "test arena") {
    const char* names[4] = {"a", "b", "c", "d"};
    for (int i = 0; i < 4; ++i) at[i] = static_cast<char*>(arena.alloc_bytes(names[i], kBytes[i]));
    arena.seal(stream());
  }
  static size_t capacity() {
    size_t c = 0;
    for (size_t b : kBytes) c += arena_slot_bytes(b);
    return c;
  }
};

// A kernel that writes one float just past the buffer it is given: the planted bug
// the guards are for.
__global__ void write_one_past(float* buffer, int64_t n) {
  if (blockIdx.x == 0 && threadIdx.x == 0) buffer[n] = 1.0f;
}

__global__ void add_one(float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] += 1.0f;
}

}  // namespace

GPU_TEST_CASE("cuda runtime: arena buffers aligned, each followed by its guard; overflow is an error") {
  TestArena t;
  DeviceArena& arena = t.arena;
  CHECK(arena.used() == arena.capacity());
  for (int i = 0; i < 4; ++i) {
    CHECK(aligned(t.at[i], kArenaAlign));
    if (i > 0) CHECK(size_t(t.at[i] - t.at[i - 1]) == arena_slot_bytes(TestArena::kBytes[i - 1]));
  }
  CHECK(arena_slot_bytes(1) == 512);
  CHECK(arena_slot_bytes(256) == 512);
  CHECK(arena_slot_bytes(257) == 768);  // at least kArenaGuardBytes after every buffer
  // Carved once, sealed once, checked only once sealed.
  CHECK_THROWS_WITH_AS(arena.alloc<float>("e", 1), doctest::Contains("after the arena was sealed"), spes::Error);
  CHECK_THROWS_WITH_AS(arena.seal(stream()), doctest::Contains("sealed twice"), spes::Error);
  DeviceArena small(arena_slot_bytes(8), "small arena");
  CHECK_THROWS_WITH_AS(small.check_guards(stream()), doctest::Contains("before seal"), spes::Error);
  CHECK(small.alloc<float>("x", 2) != nullptr);
  CHECK_THROWS_WITH_AS(small.alloc<float>("y", 1), doctest::Contains("buffer 'y' reaches"), spes::Error);
  // Sealed: every byte of a buffer NaN until written, every guard byte the guard's.
  const std::vector<unsigned char> bytes = copy_to_host(reinterpret_cast<unsigned char*>(arena.base()),
                                                        int64_t(arena.capacity()));
  size_t offset = 0, wrong = 0;
  for (size_t b : TestArena::kBytes) {
    for (size_t i = 0; i < arena_slot_bytes(b); ++i)
      wrong += bytes[offset + i] != (i < b ? kArenaPoisonByte : kArenaGuardByte);
    offset += arena_slot_bytes(b);
  }
  CHECK(wrong == 0);
  // Buffers written end to end leave the guards alone.
  for (int i = 0; i < 4; ++i) cuda_check(cudaMemsetAsync(t.at[i], 0, TestArena::kBytes[i], stream()));
  CHECK_NOTHROW(arena.check_guards(stream()));
}

GPU_TEST_CASE("cuda runtime: a write one byte past an arena buffer is named by check_guards") {
  for (int victim = 0; victim < 4; ++victim) {
    TestArena t;
    const size_t n = TestArena::kBytes[victim];
    CAPTURE(victim);
    // The last byte of the padding or guard too: any byte of it counts.
    const size_t past = victim == 2 ? arena_slot_bytes(n) - n - 1 : 0;
    cuda_check(cudaMemsetAsync(t.at[victim] + n + past, 0x00, 1, stream()));
    const std::string name(1, char('a' + victim));
    const std::string expected = "past the end of buffer '" + name + "' (" + std::to_string(n) + " B): byte " +
                                 std::to_string(past) + " after it holds 0x00";
    CHECK_THROWS_WITH_AS(t.arena.check_guards(stream()), doctest::Contains(expected.c_str()), spes::Error);
  }
}

// Skipped unless asked for (--no-skip): the GPU check runs it once plainly, where the
// guard must catch a kernel's stray write, and once under compute-sanitizer memcheck,
// which must report it (the arena's buffers reach memcheck through NVTX; without
// them the write would be inside the one cudaMalloc, invisible to it). The emulator
// stops at such a write by itself (tests/emu/test_emu_arena.cpp).
TEST_CASE("cuda runtime: planted out-of-bounds kernel write into an arena guard" * doctest::test_suite("gpu") *
          doctest::skip()) {
  TestArena t;
  spes::cuda::launch(write_one_past, dim3(1), dim3(32), 0, stream(), reinterpret_cast<float*>(t.at[1]),
                     int64_t(TestArena::kBytes[1] / sizeof(float)));
  cuda_check(cudaStreamSynchronize(stream()));
  CHECK_THROWS_WITH_AS(t.arena.check_guards(stream()), doctest::Contains("past the end of buffer 'b'"), spes::Error);
}

GPU_TEST_CASE("cuda runtime: too little memory says how much is needed and free") {
  const size_t huge = size_t(1) << 50;  // 1 PiB
  CHECK_THROWS_WITH_AS(require_device_memory(huge, "test model"), doctest::Contains("test model needs 1048576.00 GiB"),
                       spes::Error);
  CHECK_THROWS_WITH_AS(DeviceArena(huge, "big arena"), doctest::Contains("free (of"), spes::Error);
}

// A StreamGraph replays what it captured, in order, every run; a capture CUDA refuses
// (here a stream synchronization inside it) leaves nothing half done: the work runs
// launch by launch instead, exactly once a run.
GPU_TEST_CASE("cuda runtime: a StreamGraph captures once and replays in order; a refused capture runs launch by launch") {
  constexpr int64_t n = 1000, head = 10;
  DevTensor<float> x(n);
  x.zero();
  auto expect = [&](float head_value, float rest_value, const char* what) {
    const std::vector<float> h = download(x.get(), n);
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += h[size_t(i)] != (i < head ? head_value : rest_value);
    CHECK_MESSAGE(bad == 0, what << ": " << bad << " values differ from " << head_value << " / " << rest_value);
  };
  {
    StreamGraph graph(stream());
    auto record = [&] {  // the memset first, then the kernel: 1 at the head, +1 elsewhere
      cuda_check(cudaMemsetAsync(x.get(), 0, head * sizeof(float), stream()));
      spes::cuda::launch(add_one, dim3(4), dim3(128), 0, stream(), x.get(), n);
    };
    for (int run = 1; run <= 3; ++run) {
      graph.run(record);
      CHECK(graph.captured());
      expect(1.0f, float(run), "after a graph run");
    }
    graph.reset();
    CHECK_FALSE(graph.captured());
  }
  StreamGraph refused(stream());
  auto record_sync = [&] {
    spes::cuda::launch(add_one, dim3(4), dim3(128), 0, stream(), x.get(), n);
    cuda_check(cudaStreamSynchronize(stream()));
  };
  refused.run(record_sync);
  CHECK(refused.refused());
  CHECK_FALSE(refused.captured());
  expect(2.0f, 4.0f, "after the refused capture's run");  // once, not twice
  refused.run(record_sync);
  expect(3.0f, 5.0f, "after a run launch by launch");
}
