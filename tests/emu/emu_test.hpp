// Helpers of the emulator-only tests (tests/emu/test_emu_*.cpp), on top of the kernel
// tests' tests/cuda_test.cuh: values in and out of emulated device buffers
// (emu::GlobalBuffer; fp32, or rounded to bf16 as the kernels store them), reruns
// under the other emulator schedules, and the checks that the emulator aborts where
// a GPU would fault.
#pragma once
// First: cuda/common.cuh's device functions call CUDA built-ins.
#include "tests/emu/builtins.hpp"

#include <cuda_bf16.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "tests/cuda_test.cuh"
#include "tests/emu/emu.hpp"

namespace spes::test {

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

// bitwise_equal, by the name test_emu_grouped_gemm.cpp calls it.
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return bitwise_equal(a, b);
}

// for_each_schedule (tests/cuda_test.cuh) for a run already made under the default
// schedule: runs `run` once more under each other schedule, `outputs` poisoned first,
// and checks that it writes the bits of the first run.
template <class Run>
void check_rerun_identical(const std::string& what, std::initializer_list<const emu::GlobalBuffer*> outputs,
                           Run&& run) {
  std::vector<std::vector<unsigned char>> first;
  for (const emu::GlobalBuffer* b : outputs)
    first.emplace_back(b->as<unsigned char>(), b->as<unsigned char>() + b->bytes());
  for (size_t s = 1; s < std::size(kEmuSchedules); ++s) {
    for (const emu::GlobalBuffer* b : outputs) b->poison();
    {
      const ScopedSchedule schedule(kEmuSchedules[s]);
      run();
    }
    size_t i = 0;
    for (const emu::GlobalBuffer* b : outputs)
      CHECK_MESSAGE(std::memcmp(first[i++].data(), b->as<unsigned char>(), b->bytes()) == 0,
                    what << ": under " << std::string(kEmuSchedules[s].name) << " a run wrote different bits");
  }
}

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
