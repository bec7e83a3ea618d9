// Device runtime (one per GPU): device selection, one stream, the cuBLASLt handle
// and workspace created once, and RAII owners for device and pinned host memory.
// Buffers are planned up front from the config (model/gpu_memory) and carved out of
// one cudaMalloc (DeviceArena): the step loop never allocates (README, Architecture:
// "Memory plan").
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda/check.cuh"
#include "engine/base/arena_layout.hpp"

namespace spes::cuda {

class Gemm;  // cuda/matmul.cuh

using spes::kArenaAlign;  // engine/base/arena_layout.hpp
// The GEMM workspace of every cuBLASLt plan (Hopper recommends 32 MiB), 256-byte
// aligned (cudaMalloc gives that); a multiple of 256 bytes keeps any split aligned.
constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;
static_assert(kLtWorkspaceBytes % 256 == 0 && kLtWorkspaceBytes >= (size_t(16) << 10));

std::string format_bytes(size_t bytes);  // "1.50 GiB"

// Throws spes::Error unless `bytes` fit in the current device's free memory, with a
// message saying what needs how much, and how much is free of the total.
void require_device_memory(size_t bytes, const std::string& what);

// Owns one cudaMalloc. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes, const std::string& what = "device buffer");
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A device buffer holding `values`, and a buffer's whole contents read back: blocking
// copies (cudaMemcpy), for the once-per-device checks of kernel families, off the
// step's path.
template <class T>
DeviceBuffer upload_buffer(const std::vector<T>& values, const std::string& what) {
  DeviceBuffer b(values.size() * sizeof(T), what);
  cuda_check(cudaMemcpy(b.get(), values.data(), b.bytes(), cudaMemcpyHostToDevice));
  return b;
}
template <class T>
std::vector<T> download_buffer(const DeviceBuffer& b) {
  std::vector<T> h(b.bytes() / sizeof(T));
  cuda_check(cudaMemcpy(h.data(), b.get(), b.bytes(), cudaMemcpyDeviceToHost));
  return h;
}

// Owns `count` T of pinned (page-locked) host memory, cudaMallocHost: the host side of
// every asynchronous copy (a pageable source would make cudaMemcpyAsync wait, and the
// host must not change a pinned source before the copy has run). Move-only.
template <class T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t count) : count_(count) {
    void* p = nullptr;
    cuda_check(cudaMallocHost(&p, std::max<size_t>(count, 1) * sizeof(T)));
    ptr_ = static_cast<T*>(p);
  }
  ~PinnedBuffer() {
    if (ptr_) cudaFreeHost(ptr_);  // destructor path: nothing useful to do on error
  }
  PinnedBuffer(PinnedBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(count_, o.count_);
    return *this;
  }

  T* data() const { return ptr_; }
  size_t size() const { return count_; }
  T& operator[](size_t i) const { return ptr_[i]; }
  explicit operator bool() const { return ptr_ != nullptr; }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// Every buffer of an arena starts on a kArenaAlign boundary and is followed by a
// guard of at least kArenaGuardBytes (its padding to the alignment, plus that much;
// engine/base/arena_layout.hpp): a kernel that writes past its buffer lands in a
// guard instead of silently in the next buffer, where no test of values need see it.
// seal() fills the guards with kArenaGuardByte and check_guards() reads them back. seal() also registers the
// buffers with NVTX (a memory pool and its regions): compute-sanitizer's memcheck,
// which cannot see inside one cudaMalloc otherwise, then reports a kernel's access
// outside them, reads included (the host emulator checks the guards after every
// launch: writes).
using spes::arena_slot_bytes;
using spes::kArenaGuardBytes;
constexpr unsigned char kArenaGuardByte = 0xA5;
constexpr unsigned char kArenaPoisonByte = 0xFF;  // NaN as fp32 and as bf16

// A bump allocator over one cudaMalloc of the planned size (Σ arena_slot_bytes of
// the buffers), carved once at start-up and then sealed; the buffers live as long as
// the arena. Running out is a bug in the plan: it throws.
class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(size_t capacity, const std::string& what = "device arena");
  ~DeviceArena();
  DeviceArena(DeviceArena&& o) noexcept { *this = std::move(o); }
  DeviceArena& operator=(DeviceArena&& o) noexcept;

  template <class T>
  T* alloc(const std::string& name, size_t count) {
    return static_cast<T*>(alloc_bytes(name, count * sizeof(T)));
  }
  void* alloc_bytes(const std::string& name, size_t bytes);

  // After the last alloc: every byte set to kArenaPoisonByte (a read before the
  // first write shows as NaN, on any GPU), the guards to kArenaGuardByte, and the
  // buffers registered with NVTX under their names. Waits for `stream`.
  void seal(cudaStream_t stream);
  // Throws spes::Error naming the first buffer whose guard was overwritten (an
  // out-of-bounds write by a kernel: a bug in spes-engine, not in the run).
  void check_guards(cudaStream_t stream) const;

  size_t used() const { return used_; }
  size_t capacity() const { return buf_.bytes(); }
  char* base() const { return buf_.as<char>(); }

 private:
  struct Slot {
    std::string name;
    size_t offset, bytes;
    size_t guard_bytes() const { return arena_slot_bytes(bytes) - bytes; }  // padding and guard
    char* guard(char* base) const { return base + offset + bytes; }
  };
  void unregister_heap() noexcept;
  std::vector<std::pair<char*, size_t>> buffer_ranges() const;  // address, bytes
  std::vector<std::pair<char*, size_t>> guard_ranges() const;   // each buffer's padding and guard

  DeviceBuffer buf_;
  std::string what_;
  size_t used_ = 0;
  std::vector<Slot> slots_;
  bool sealed_ = false;
  void* nvtx_heap_ = nullptr;  // the NVTX heap handle while a tool (compute-sanitizer) listens
};

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t total_bytes = 0;
  size_t free_bytes = 0;  // at Runtime construction
};

// One per GPU the process drives. Selects the device, creates a non-blocking
// stream, the cuBLASLt handle, its workspace and the GEMM plan cache. Not copyable;
// create it once at start-up.
//
// One workspace, one stream: every cuBLASLt GEMM of gemm() uses the same 32 MiB,
// which is safe because they all run on stream(), one after another. Two GEMMs on
// different streams would overwrite each other's workspace, so gemm() refuses any
// other stream.
class Runtime {
 public:
  // Throws spes::Error with the reason when there is no usable GPU or `ordinal`
  // does not exist.
  explicit Runtime(int ordinal = 0);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  const DeviceInfo& info() const { return info_; }
  cudaStream_t stream() const { return stream_; }
  cublasLtHandle_t cublaslt() const { return cublaslt_; }
  Gemm& gemm() const { return *gemm_; }
  void synchronize() const;

 private:
  DeviceInfo info_;
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t cublaslt_ = nullptr;
  DeviceBuffer lt_workspace_;
  std::unique_ptr<Gemm> gemm_;
};

// Work the host enqueues the same way over and over (a micro-batch's forward and
// backward: hundreds of launches), captured once on `stream` as a CUDA graph
// and then launched as one, so that the kernels run back to back instead of each
// waiting for the host to issue it. run(record) captures what `record` enqueues on its
// first call and launches the graph on every call after; reset() drops the graph (the
// next run captures anew). A graph freezes every pointer and scalar argument as
// captured, and every choice a launcher made then (an environment variable it read):
// the caller resets it when one changes. What `record` enqueues must also not
// need a host call that a capture cannot hold (a stream synchronization, a first-use
// setup such as a GEMM plan query that synchronizes): run it once outside the graph
// first. Should the capture fail anyway (CUDA refuses a call, or `record` throws), the
// reason is logged once and `record` runs launch by launch from then on: slower, never
// wrong (an error of `record`'s own is thrown again there). SPES_CUDA_GRAPH=off makes
// every run launch by launch.
class StreamGraph {
 public:
  explicit StreamGraph(cudaStream_t stream) : stream_(stream) {}
  ~StreamGraph() { reset(); }
  StreamGraph(const StreamGraph&) = delete;
  StreamGraph& operator=(const StreamGraph&) = delete;

  void run(const std::function<void()>& record);
  void reset();
  bool captured() const { return exec_ != nullptr; }
  bool refused() const { return refused_; }

 private:
  void capture(const std::function<void()>& record);

  cudaStream_t stream_;
  cudaGraphExec_t exec_ = nullptr;
  bool refused_ = false;
};

}  // namespace spes::cuda
