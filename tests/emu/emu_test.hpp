// Helpers of the emulated-kernel tests (tests/emu/test_emu_*.cpp): values in and out
// of emulated device buffers (fp32, or rounded to bf16 as the kernels store them),
// bit-for-bit comparisons, and the worst error of each output over a test case.
#pragma once
// First: cuda/common.cuh's device functions call CUDA built-ins.
#include "tests/emu/builtins.hpp"

#include <cuda_bf16.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "tests/bf16_values.hpp"
#include "tests/emu/emu.hpp"
#include "tests/gpu_test.hpp"

namespace spes::test {

using spes::cuda::bf16;

// Random normal values (rng(): seed it first), rounded to bf16: what a bf16 tensor
// holds and the reference must be fed.
inline std::vector<float> random_bf16_values(int64_t n, float scale = 1.0f) {
  return rounded_bf16(random_vector(n, scale));
}

// An emulated device buffer of n values of T.
template <class T>
emu::GlobalBuffer device_buffer(int64_t n) {
  return emu::GlobalBuffer(size_t(n) * sizeof(T));
}

inline void upload_bf16(const emu::GlobalBuffer& dst, const std::vector<float>& values) {
  for (size_t i = 0; i < values.size(); ++i) dst.as<bf16>()[i] = __float2bfloat16_rn(values[i]);
}
template <class T>
void upload(const emu::GlobalBuffer& dst, const std::vector<T>& values) {
  if (!values.empty()) std::memcpy(dst.as<T>(), values.data(), values.size() * sizeof(T));
}

inline std::vector<float> download_bf16(const emu::GlobalBuffer& src, int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = __bfloat162float(src.as<bf16>()[i]);
  return v;
}
template <class T = float>
std::vector<T> download(const emu::GlobalBuffer& src, int64_t n) {
  return {src.as<T>(), src.as<T>() + n};
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Runs `run` twice more on the same inputs, `outputs` poisoned first, with each warp
// running ahead of the others (emu::Schedule, ascending then descending warp order;
// in a cluster launch each CTA of a cluster, too), and checks that it writes the bits
// of the first run: this finds a missing barrier.
// The emulator's worker threads also take the CTAs in a different order each time,
// so it finds results that depend on CTA order (float atomics, a CTA reading what
// another wrote) as well as any poison left unwritten.
template <class Run>
void check_rerun_identical(const std::string& what, std::initializer_list<const emu::GlobalBuffer*> outputs,
                           Run&& run) {
  std::vector<std::vector<unsigned char>> first;
  for (const emu::GlobalBuffer* b : outputs)
    first.emplace_back(b->as<unsigned char>(), b->as<unsigned char>() + b->bytes());
  for (const auto& [schedule, name] : {std::pair{emu::Schedule::warps_ascending, "warps ascending"},
                                       std::pair{emu::Schedule::warps_descending, "warps descending"}}) {
    for (const emu::GlobalBuffer* b : outputs) b->poison();
    emu::set_schedule(schedule);
    run();
    emu::set_schedule(emu::Schedule::round_robin);
    size_t i = 0;
    for (const emu::GlobalBuffer* b : outputs)
      CHECK_MESSAGE(std::memcmp(first[i++].data(), b->as<unsigned char>(), b->bytes()) == 0,
                    what << ": a run with " << std::string(name) << " wrote different bits");
  }
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

// Runs `body` in a child process, for the checks where the emulator must abort
// (emu::fail: where a GPU would fault). Returns what the child wrote to stderr, then
// "[aborted]" if it aborted, "[returned]" if body returned, "[died]" otherwise.
inline std::string run_in_child(const std::function<void()>& body) {
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::signal(SIGABRT, SIG_DFL);  // not doctest's crash report
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    body();
    _exit(0);
  }
  close(fds[1]);
  std::string out;
  char buf[512];
  for (ssize_t r; (r = read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, size_t(r));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT) return out + "[aborted]";
  return out + (WIFEXITED(status) && WEXITSTATUS(status) == 0 ? "[returned]" : "[died]");
}
inline bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace spes::test
