// Device runtime (one per GPU): device selection, one stream, cuBLAS + cuBLASLt
// handles and the cuBLASLt workspace created once, and RAII owners for device
// memory. Buffers are planned up front from the config (ArenaPlan) and carved out
// of one cudaMalloc (DeviceArena): the step loop never allocates (DESIGN §2).
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "cuda/check.cuh"

namespace spes::cuda {

class Gemm;  // cuda/matmul.cuh

constexpr size_t kArenaAlign = 256;  // cudaMalloc's own alignment; enough for any vector access
// The GEMM workspace, shared by the cuBLASLt plans and the cuBLAS handle (Hopper
// recommends 32 MiB). cublasSetWorkspace wants a 256-byte aligned pointer (cudaMalloc
// gives that) and at least 16 KiB; a multiple of 256 bytes keeps any split aligned.
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

// Arena alignments are offsets from the arena's base, which cudaMalloc aligns to
// kArenaAlign only: an alignment above that (or not a power of two) would hold for
// offsets but not for addresses, so it is refused (spes::Error).
void require_arena_align(size_t align);

// Sizes a DeviceArena: call reserve() in the same order, with the same counts, as
// the alloc() calls that will follow; bytes() is then exactly the arena size needed.
class ArenaPlan {
 public:
  template <class T>
  void reserve(size_t count, size_t align = kArenaAlign) { reserve_bytes(count * sizeof(T), align); }
  void reserve_bytes(size_t bytes, size_t align = kArenaAlign) {
    require_arena_align(align);
    used_ = (used_ + align - 1) / align * align + bytes;
  }
  size_t bytes() const { return used_; }

 private:
  size_t used_ = 0;
};

// A bump allocator over one cudaMalloc of the planned size. Sub-allocations are
// aligned (default and at most 256 B) and live as long as the arena; reset() rewinds to a
// mark (e.g. per-step scratch). Running out is a bug in the plan: it throws.
class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(size_t capacity, const std::string& what = "device arena");

  template <class T>
  T* alloc(size_t count, size_t align = kArenaAlign) {
    return static_cast<T*>(alloc_bytes(count * sizeof(T), align));
  }
  void* alloc_bytes(size_t bytes, size_t align = kArenaAlign);

  size_t used() const { return used_; }
  size_t capacity() const { return buf_.bytes(); }
  size_t mark() const { return used_; }
  void reset(size_t mark = 0) { used_ = mark; }
  char* base() const { return buf_.as<char>(); }

 private:
  DeviceBuffer buf_;
  std::string what_;
  size_t used_ = 0;
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
// stream, cuBLAS and cuBLASLt handles (bound to that stream), the cuBLASLt
// workspace and the GEMM plan cache. Not copyable; create it once at start-up.
//
// One workspace, one stream: the cuBLAS handle (cublasSetWorkspace) and every
// cuBLASLt GEMM of gemm() use the same 32 MiB, which is safe because they all run
// on stream(), one after another. Two GEMMs on different streams would overwrite
// each other's workspace, so gemm() refuses any other stream, and a caller that
// rebinds cublas() to another stream (cublasSetStream) puts the handle back on
// cuBLAS's own workspace pool (cublasSetStream resets it), which is safe too.
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
  cublasHandle_t cublas() const { return cublas_; }
  cublasLtHandle_t cublaslt() const { return cublaslt_; }
  Gemm& gemm() const { return *gemm_; }
  void synchronize() const;

 private:
  DeviceInfo info_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  cublasLtHandle_t cublaslt_ = nullptr;
  DeviceBuffer lt_workspace_;
  std::unique_ptr<Gemm> gemm_;
};

}  // namespace spes::cuda
