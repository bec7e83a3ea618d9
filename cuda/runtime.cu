#include "cuda/runtime.cuh"

#include <cstdio>

#include "cuda/common.cuh"
#include "cuda/device_probe.hpp"
#include "cuda/matmul.cuh"
#include "engine/base/error.hpp"

namespace spes::cuda {

std::string format_bytes(size_t bytes) {
  char buf[64];
  if (bytes >= (size_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / 1073741824.0);
  else if (bytes >= (size_t(1) << 20)) std::snprintf(buf, sizeof buf, "%.2f MiB", bytes / 1048576.0);
  else std::snprintf(buf, sizeof buf, "%zu B", bytes);
  return buf;
}

void require_device_memory(size_t bytes, const std::string& what) {
  size_t free_b = 0, total_b = 0;
  cuda_check(cudaMemGetInfo(&free_b, &total_b));
  if (bytes > free_b) {
    int dev = 0;
    cuda_check(cudaGetDevice(&dev));
    throw Error(what + " needs " + format_bytes(bytes) + " of GPU memory but GPU " + std::to_string(dev) +
                " has only " + format_bytes(free_b) + " free (of " + format_bytes(total_b) +
                "); use a smaller model/micro-batch or a larger GPU");
  }
}

// ---- DeviceBuffer ------------------------------------------------------------------

DeviceBuffer::DeviceBuffer(size_t bytes, const std::string& what) : bytes_(bytes) {
  if (bytes == 0) return;
  require_device_memory(bytes, what);
  cuda_check(cudaMalloc(&ptr_, bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);  // never throw from a destructor
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

// ---- DeviceArena -------------------------------------------------------------------

DeviceArena::DeviceArena(size_t capacity, const std::string& what) : buf_(capacity, what), what_(what) {}

void require_arena_align(size_t align) {
  if (align == 0 || align > kArenaAlign || (align & (align - 1)) != 0)
    throw Error("device arena: alignment " + std::to_string(align) + " is not a power of two ≤ " +
                std::to_string(kArenaAlign) + " (cudaMalloc aligns the arena's base to " +
                std::to_string(kArenaAlign) + " bytes only)");
}

void* DeviceArena::alloc_bytes(size_t bytes, size_t align) {
  require_arena_align(align);
  const size_t start = (used_ + align - 1) / align * align;
  if (start + bytes > buf_.bytes()) {
    throw Error(what_ + ": planned " + format_bytes(buf_.bytes()) + " but allocations reach " +
                format_bytes(start + bytes) + " (the ArenaPlan and the allocations disagree)");
  }
  used_ = start + bytes;
  return buf_.as<char>() + start;
}

// ---- Runtime -------------------------------------------------------------------------

Runtime::Runtime(int ordinal) {
  std::string why;
  if (!gpu_available(&why)) throw Error("no usable GPU: " + why);
  int count = 0;
  cuda_check(cudaGetDeviceCount(&count));
  if (ordinal < 0 || ordinal >= count) {
    throw Error("GPU " + std::to_string(ordinal) + " requested but " + std::to_string(count) +
                " visible (CUDA_VISIBLE_DEVICES?)");
  }
  cuda_check(cudaSetDevice(ordinal));
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, ordinal));
  info_.ordinal = ordinal;
  info_.name = prop.name;
  info_.cc_major = prop.major;
  info_.cc_minor = prop.minor;
  info_.sm_count = prop.multiProcessorCount;
  cuda_check(cudaMemGetInfo(&info_.free_bytes, &info_.total_bytes));
  if (prop.major < 8) {
    throw Error("GPU " + std::to_string(ordinal) + " (" + info_.name + ", sm_" + std::to_string(prop.major) +
                std::to_string(prop.minor) + ") is too old: bf16 kernels need sm_80 or newer");
  }

  cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  cublas_check(cublasCreate(&cublas_));
  cublas_check(cublasSetStream(cublas_, stream_));
  // Split-K partial sums in fp32, never in a bf16 output's type: the model promises
  // fp32 accumulation (the expert GEMMs run through this handle; cuBLASLt's GEMMs
  // get the same rule from their reduction-scheme mask in matmul.cu).
  cublas_check(cublasSetMathMode(cublas_, CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  cublas_check(cublasLtCreate(&cublaslt_));
  lt_workspace_ = DeviceBuffer(kLtWorkspaceBytes, "cuBLASLt workspace");
  if (!aligned(lt_workspace_.get(), 256)) throw Error("cuBLAS workspace is not 256-byte aligned");
  // cuBLAS (non-Lt) gets the same workspace so it never allocates on its own. After
  // cublasSetStream, which would reset it. Safe to share: one stream (runtime.cuh).
  cublas_check(cublasSetWorkspace(cublas_, lt_workspace_.get(), lt_workspace_.bytes()));
  gemm_ = std::make_unique<Gemm>(cublaslt_, lt_workspace_.get(), lt_workspace_.bytes(), stream_);
}

Runtime::~Runtime() {
  // Destruction order: plans, handles, stream; the workspace buffer last (member order).
  gemm_.reset();
  if (cublaslt_) cublasLtDestroy(cublaslt_);
  if (cublas_) cublasDestroy(cublas_);
  if (stream_) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

void Runtime::synchronize() const { cuda_check(cudaStreamSynchronize(stream_)); }

}  // namespace spes::cuda
