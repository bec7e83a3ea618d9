// Helpers of the kernel tests (tests/test_cuda_*.cu), which run on a GPU and, compiled
// as C++, on the emulated H100 of tests/emu/ alike: one Runtime for the process,
// device buffers filled from host vectors (fp32, or rounded to bf16), NaN poisoning
// of outputs, results read back as fp32 — all on the runtime's stream, the one every
// kernel under test is launched on — the worst error of each output, and the
// schedule hook (for_each_schedule) that reruns a kernel under every emulator
// schedule and is a plain double run on a GPU.
#pragma once
#include <cuda_bf16.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "cuda/check.cuh"
#include "cuda/common.cuh"
#include "cuda/runtime.cuh"
#include "tests/bf16_values.hpp"
#include "tests/gpu_test.hpp"

// SPES_EMULATOR: defined by the emulator's build alone (test_emu, CMakeLists.txt), so
// the GPU build of these files holds no emulator code.
#ifdef SPES_EMULATOR
#include "tests/emu/emu.hpp"
#endif

namespace spes::test {

using spes::cuda::bf16;
using spes::cuda::DeviceBuffer;

#ifdef SPES_EMULATOR
inline constexpr bool kEmulated = true;
#else
inline constexpr bool kEmulated = false;
#endif

inline spes::cuda::Runtime& runtime() {
  static spes::cuda::Runtime rt(0);
  return rt;
}
inline cudaStream_t stream() { return runtime().stream(); }

// Every helper below works on the runtime's stream. That stream is
// cudaStreamNonBlocking, so work on the legacy default stream (cudaMemset,
// cudaMemcpy, a <<<…>>> launch without a stream) is NOT ordered with the kernels
// under test: a poison could land after the kernel wrote its output.

// Host → device on the test stream, then synchronised: `h` is pageable and often a
// temporary that is gone as soon as the caller's statement ends.
template <class T>
inline void copy_to_device(T* d, const T* h, int64_t n) {
  if (n <= 0) return;
  cuda_check(cudaMemcpyAsync(d, h, size_t(n) * sizeof(T), cudaMemcpyHostToDevice, stream()));
  cuda_check(cudaStreamSynchronize(stream()));
}

// Device → host after everything queued on the test stream (so a kernel's errors
// surface here).
template <class T>
inline std::vector<T> copy_to_host(const T* d, int64_t n) {
  std::vector<T> h(size_t(n > 0 ? n : 0));
  if (n > 0) cuda_check(cudaMemcpyAsync(h.data(), d, size_t(n) * sizeof(T), cudaMemcpyDeviceToHost, stream()));
  cuda_check(cudaStreamSynchronize(stream()));
  return h;
}

// All bits set: NaN as fp32 and as bf16, so an element a kernel forgot stays NaN.
inline void poison(void* d, size_t bytes) { cuda_check(cudaMemsetAsync(d, 0xFF, bytes, stream())); }

// A device tensor of n elements of T (float, bf16, int32_t, …).
template <class T>
struct DevTensor {
  DeviceBuffer buf;
  int64_t n = 0;
  DevTensor() = default;
  explicit DevTensor(int64_t count) : buf(size_t(count > 0 ? count : 1) * sizeof(T), "test tensor"), n(count) {}
  T* get() const { return buf.as<T>(); }
  operator T*() const { return get(); }
  void poison() const { spes::test::poison(buf.get(), buf.bytes()); }
  void zero() const { cuda_check(cudaMemsetAsync(buf.get(), 0, buf.bytes(), stream())); }
  void upload(const std::vector<T>& h) const { copy_to_device(get(), h.data(), int64_t(h.size())); }
};

template <class T>
DevTensor<T> upload(const std::vector<T>& h) {
  DevTensor<T> d(int64_t(h.size()));
  d.upload(h);
  return d;
}
inline std::vector<bf16> to_bf16(const std::vector<float>& h) {
  std::vector<bf16> t(h.size());
  for (size_t i = 0; i < h.size(); ++i) t[i] = __float2bfloat16_rn(h[i]);
  return t;
}
inline DevTensor<bf16> upload_bf16(const std::vector<float>& h) { return upload(to_bf16(h)); }

inline std::vector<float> download(const float* d, int64_t n) { return copy_to_host(d, n); }
inline std::vector<float> download(const bf16* d, int64_t n) {
  const std::vector<bf16> t = copy_to_host(d, n);
  std::vector<float> h(t.size());
  for (size_t i = 0; i < t.size(); ++i) h[i] = __bfloat162float(t[i]);
  return h;
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Random normal values (rng(): seed it first), rounded to bf16: what a bf16 tensor
// holds and the reference must be fed.
inline std::vector<float> random_bf16_values(int64_t n, float scale = 1.0f) {
  return rounded_bf16(random_vector(n, scale));
}

inline std::vector<int32_t> random_tokens(int64_t n, int64_t V) {
  std::uniform_int_distribution<int32_t> d(0, int32_t(V - 1));
  std::vector<int32_t> t(n);
  for (auto& x : t) x = d(rng());
  return t;
}

// Checks relative errors ‖got − want‖/‖want‖ (rel_error, tests/gpu_test.hpp; NaN
// never passes) against their tolerances and keeps the worst of each named output;
// prints them, with the shape each came from, when it goes out of scope at the end
// of the test case.
class ErrorReport {
 public:
  void check(const std::string& name, const std::string& shape, const std::vector<float>& got,
             const std::vector<float>& want, double tolerance) {
    const double err = got.size() == want.size() ? rel_error(got.data(), want.data(), int64_t(want.size())) : INFINITY;
    CHECK_MESSAGE(err <= tolerance, name << " " << shape << ": rel err " << err << " > tol " << tolerance);
    Worst& w = worst_[name];
    if (err > w.error || w.shape.empty()) w = {err, tolerance, shape};
  }
  ~ErrorReport() {
    for (const auto& [name, w] : worst_)
      MESSAGE(name << ": worst rel err " << w.error << " (tol " << w.tolerance << ") at " << w.shape);
  }

 private:
  struct Worst {
    double error = 0, tolerance = 0;
    std::string shape;
  };
  std::map<std::string, Worst> worst_;
};

// ---- the schedule hook ----------------------------------------------------------------

// A device range a kernel under test writes: for_each_schedule poisons it before each
// run and compares its bytes after.
struct Output {
  void* data;
  size_t bytes;
  template <class T>
  Output(const DevTensor<T>& t) : data(t.buf.get()), bytes(t.buf.bytes()) {}
};

#ifdef SPES_EMULATOR
// The emulator's legal orders of execution (tests/emu/emu.hpp), the default first:
// warps in step, each warp as far ahead of the others as the barriers let it (both
// directions; a cluster's CTAs likewise), and cp.async bytes landing at issue rather
// than at wait_group. A race-free kernel writes the same bits under every one.
struct EmuSchedule {
  emu::Schedule warps;
  emu::Landing landing;
  const char* name;
};
inline constexpr EmuSchedule kEmuSchedules[] = {
    {emu::Schedule::round_robin, emu::Landing::at_wait, "the default schedule"},
    {emu::Schedule::warps_ascending, emu::Landing::at_wait, "warps ascending"},
    {emu::Schedule::warps_descending, emu::Landing::at_wait, "warps descending"},
    {emu::Schedule::round_robin, emu::Landing::at_issue, "cp.async landing at issue"},
};
// Selects one schedule until destroyed, then the default again (also when a failed
// REQUIRE unwinds through the run).
struct ScopedSchedule {
  explicit ScopedSchedule(const EmuSchedule& s) {
    emu::set_schedule(s.warps);
    emu::set_landing(s.landing);
  }
  ~ScopedSchedule() {
    emu::set_schedule(emu::Schedule::round_robin);
    emu::set_landing(emu::Landing::at_wait);
  }
};
#endif

// Runs `body` — launch the kernels under test, check what they wrote — several times,
// each after poisoning `outputs`, and requires every run to leave in `outputs` the bits
// of the first: on the emulator once under each of its schedules (kEmuSchedules; a
// missing barrier or wait gives other bits, and the emulator's worker threads take
// the CTAs in another order each run), on a GPU twice (determinism on the hardware,
// whose own schedule varies run to run). The body sets everything else the kernels
// read, an accumulator's prior value or an in-place operand included.
template <class Body>
void for_each_schedule(const std::string& what, std::initializer_list<Output> outputs, Body&& body) {
#ifdef SPES_EMULATOR
  std::vector<const char*> runs;
  for (const EmuSchedule& s : kEmuSchedules) runs.push_back(s.name);
#else
  const std::vector<const char*> runs = {"the first run", "a second run"};
#endif
  std::vector<std::vector<unsigned char>> first;
  for (size_t r = 0; r < runs.size(); ++r) {
    for (const Output& o : outputs) poison(o.data, o.bytes);
    {
#ifdef SPES_EMULATOR
      const ScopedSchedule schedule(kEmuSchedules[r]);
#endif
      body();
    }
    size_t i = 0;
    for (const Output& o : outputs) {
      std::vector<unsigned char> bytes = copy_to_host(static_cast<const unsigned char*>(o.data), int64_t(o.bytes));
      if (r == 0)
        first.push_back(std::move(bytes));
      else
        CHECK_MESSAGE(bytes == first[i], what << ": under " << std::string(runs[r]) << ", output " << i + 1
                                              << " holds other bits than under " << std::string(runs[0]));
      ++i;
    }
  }
}

}  // namespace spes::test
