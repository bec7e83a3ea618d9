#include "cuda/runtime.cuh"

#include <nvtx3/nvToolsExtMem.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/device_probe.hpp"
#include "cuda/matmul.cuh"
#include "engine/base/error.hpp"
#include "engine/base/log.hpp"

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

namespace {

// One NVTX domain for the engine's memory annotations. Without a tool attached every
// NVTX call is a no-op (and the domain null).
nvtxDomainHandle_t nvtx_domain() {
  static const nvtxDomainHandle_t domain = nvtxDomainCreateA("spes-engine");
  return domain;
}

// The whole cudaMalloc as a sub-allocator's heap; its buffers become regions in it.
// Null when no tool listens (NVTX_MEM_HEAP_HANDLE_NO_TOOL, -1, in other NVTX versions).
void* nvtx_register_heap(void* base, size_t bytes) {
  const nvtxMemVirtualRangeDesc_t range{bytes, base};
  nvtxMemHeapDesc_t heap{};
  heap.extCompatID = NVTX_EXT_COMPATID_MEM;
  heap.structSize = sizeof heap;
  heap.usage = NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR;
  heap.type = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  heap.typeSpecificDescSize = sizeof range;
  heap.typeSpecificDesc = &range;
  void* handle = nvtxMemHeapRegister(nvtx_domain(), &heap);
  return reinterpret_cast<intptr_t>(handle) == -1 ? nullptr : handle;
}

using Ranges = std::vector<std::pair<char*, size_t>>;  // address, bytes

void nvtx_register_regions(void* heap, const Ranges& regions) {
  std::vector<nvtxMemVirtualRangeDesc_t> ranges;
  for (const auto& [at, bytes] : regions) ranges.push_back({bytes, at});
  nvtxMemRegionsRegisterBatch_t batch{};
  batch.extCompatID = NVTX_EXT_COMPATID_MEM;
  batch.structSize = sizeof batch;
  batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  batch.heap = static_cast<nvtxMemHeapHandle_t>(heap);
  batch.regionCount = ranges.size();
  batch.regionDescElementSize = sizeof(nvtxMemVirtualRangeDesc_t);
  batch.regionDescElements = ranges.data();
  nvtxMemRegionsRegister(nvtx_domain(), &batch);
}

void nvtx_unregister_regions(const Ranges& regions) {
  std::vector<nvtxMemRegionRef_t> refs(regions.size());
  for (size_t i = 0; i < regions.size(); ++i) refs[i].pointer = regions[i].first;
  nvtxMemRegionsUnregisterBatch_t batch{};
  batch.extCompatID = NVTX_EXT_COMPATID_MEM;
  batch.structSize = sizeof batch;
  batch.refType = NVTX_MEM_REGION_REF_TYPE_POINTER;
  batch.refCount = refs.size();
  batch.refElementSize = sizeof(nvtxMemRegionRef_t);
  batch.refElements = refs.data();
  nvtxMemRegionsUnregister(nvtx_domain(), &batch);
}

void nvtx_name_regions(const Ranges& regions, const std::vector<std::string>& names) {
  std::vector<nvtxMemRegionNameDesc_t> descs(regions.size());
  for (size_t i = 0; i < regions.size(); ++i) {
    descs[i].regionRefType = NVTX_MEM_REGION_REF_TYPE_POINTER;
    descs[i].nameType = NVTX_MESSAGE_TYPE_ASCII;
    descs[i].region.pointer = regions[i].first;
    descs[i].name.ascii = names[i].c_str();
  }
  nvtxMemRegionsNameBatch_t batch{};
  batch.extCompatID = NVTX_EXT_COMPATID_MEM;
  batch.structSize = sizeof batch;
  batch.regionCount = descs.size();
  batch.regionElementSize = sizeof(nvtxMemRegionNameDesc_t);
  batch.regionElements = descs.data();
  nvtxMemRegionsName(nvtx_domain(), &batch);
}

}  // namespace

DeviceArena::DeviceArena(size_t capacity, const std::string& what) : buf_(capacity, what), what_(what) {}

DeviceArena::~DeviceArena() { unregister_heap(); }

DeviceArena& DeviceArena::operator=(DeviceArena&& o) noexcept {
  if (this != &o) {
    unregister_heap();  // before buf_ frees the memory the heap describes
    buf_ = std::move(o.buf_);
    what_ = std::move(o.what_);
    used_ = o.used_;
    slots_ = std::move(o.slots_);
    sealed_ = o.sealed_;
    nvtx_heap_ = o.nvtx_heap_;
    o.used_ = 0;
    o.sealed_ = false;
    o.nvtx_heap_ = nullptr;
  }
  return *this;
}

void DeviceArena::unregister_heap() noexcept {
  if (nvtx_heap_) nvtxMemHeapUnregister(nvtx_domain(), static_cast<nvtxMemHeapHandle_t>(nvtx_heap_));
  nvtx_heap_ = nullptr;
}

Ranges DeviceArena::buffer_ranges() const {
  Ranges r;
  for (const Slot& s : slots_) r.emplace_back(base() + s.offset, s.bytes);
  return r;
}

Ranges DeviceArena::guard_ranges() const {
  Ranges r;
  for (const Slot& s : slots_) r.emplace_back(s.guard(base()), s.guard_bytes());
  return r;
}

void* DeviceArena::alloc_bytes(const std::string& name, size_t bytes) {
  if (sealed_) throw Error(what_ + ": buffer '" + name + "' asked for after the arena was sealed");
  // An empty buffer would share its address with its guard (the plan gives it none).
  if (bytes == 0) throw Error(what_ + ": buffer '" + name + "' of 0 bytes");
  const size_t start = used_;
  if (start + arena_slot_bytes(bytes) > buf_.bytes()) {
    throw Error(what_ + ": planned " + format_bytes(buf_.bytes()) + " but buffer '" + name + "' reaches " +
                format_bytes(start + arena_slot_bytes(bytes)) + " (the memory plan and the allocations disagree)");
  }
  used_ = start + arena_slot_bytes(bytes);
  slots_.push_back({name, start, bytes});
  return buf_.as<char>() + start;
}

void DeviceArena::seal(cudaStream_t stream) {
  if (sealed_) throw Error(what_ + ": sealed twice");
  sealed_ = true;
  if (!buf_.get()) return;
  cuda_check(cudaMemsetAsync(base(), kArenaPoisonByte, capacity(), stream));
  for (const Slot& s : slots_) cuda_check(cudaMemsetAsync(s.guard(base()), kArenaGuardByte, s.guard_bytes(), stream));
  cuda_check(cudaStreamSynchronize(stream));
  nvtx_heap_ = nvtx_register_heap(base(), capacity());
  if (!nvtx_heap_) return;
  const Ranges buffers = buffer_ranges();
  nvtx_register_regions(nvtx_heap_, buffers);
  std::vector<std::string> names;
  for (const Slot& s : slots_) names.push_back(s.name);
  nvtx_name_regions(buffers, names);
}

void DeviceArena::check_guards(cudaStream_t stream) const {
  if (!sealed_) throw Error(what_ + ": check_guards before seal (the guards hold nothing yet)");
  std::vector<std::vector<unsigned char>> guards;
  {
    // Under compute-sanitizer the guards lie outside every registered buffer, where
    // memcheck may report the copies below too: registered while they are read.
    const Ranges guards_at = guard_ranges();
    if (nvtx_heap_) nvtx_register_regions(nvtx_heap_, guards_at);
    struct Unregister {  // also when a copy throws
      const Ranges* regions;
      ~Unregister() {
        if (regions) nvtx_unregister_regions(*regions);
      }
    } unregister{nvtx_heap_ ? &guards_at : nullptr};
    for (const Slot& s : slots_) {  // into pageable memory: each copy is done when the call returns
      std::vector<unsigned char>& g = guards.emplace_back(s.guard_bytes());
      cuda_check(cudaMemcpyAsync(g.data(), s.guard(base()), g.size(), cudaMemcpyDeviceToHost, stream));
    }
    cuda_check(cudaStreamSynchronize(stream));
  }
  for (size_t k = 0; k < slots_.size(); ++k) {
    const auto bad =
        std::find_if(guards[k].begin(), guards[k].end(), [](unsigned char b) { return b != kArenaGuardByte; });
    if (bad == guards[k].end()) continue;
    char bytes[64];
    std::snprintf(bytes, sizeof bytes, "0x%02X, not the guard's 0x%02X", *bad, kArenaGuardByte);
    throw Error(what_ + ": something wrote past the end of buffer '" + slots_[k].name + "' (" +
                std::to_string(slots_[k].bytes) + " B): byte " + std::to_string(bad - guards[k].begin()) +
                " after it holds " + bytes +
                " — an out-of-bounds write on the GPU, a bug in spes-engine; please report it with the config");
  }
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
  cublas_check(cublasLtCreate(&cublaslt_));
  lt_workspace_ = DeviceBuffer(kLtWorkspaceBytes, "cuBLASLt workspace");
  if (!aligned(lt_workspace_.get(), 256)) throw Error("cuBLASLt workspace is not 256-byte aligned");
  gemm_ = std::make_unique<Gemm>(cublaslt_, lt_workspace_.get(), lt_workspace_.bytes(), stream_);
}

Runtime::~Runtime() {
  // Destruction order: plans, handles, stream; the workspace buffer last (member order).
  gemm_.reset();
  if (cublaslt_) cublasLtDestroy(cublaslt_);
  if (stream_) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

void Runtime::synchronize() const { cuda_check(cudaStreamSynchronize(stream_)); }

// SPES_CUDA_GRAPH=off runs every StreamGraph launch by launch (read once): a way
// around graphs on a machine where they misbehave, and a way to time the step without them.
static bool graphs_off() {
  static const char* const value = std::getenv("SPES_CUDA_GRAPH");
  if (value != nullptr && *value != '\0' && std::string(value) != "off")
    throw Error(std::string("SPES_CUDA_GRAPH is \"") + value + "\"; it may only be \"off\" or unset");
  return value != nullptr && *value != '\0';
}

void StreamGraph::run(const std::function<void()>& record) {
  if (graphs_off()) return record();
  if (!exec_ && !refused_) capture(record);
  if (exec_)
    cuda_check(cudaGraphLaunch(exec_, stream_));
  else
    record();
}

void StreamGraph::reset() {
  if (exec_) cudaGraphExecDestroy(exec_);  // also the destructor's path: nothing useful to do on error
  exec_ = nullptr;
  refused_ = false;
}

// Thread-local capture: a data-parallel node's rank threads capture on their own
// streams at the same time, and another thread's calls must not break this capture.
void StreamGraph::capture(const std::function<void()>& record) {
  cuda_check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  std::string why;
  try {
    record();
  } catch (const std::exception& e) {
    why = e.what();
  } catch (...) {
    why = "an exception that is not a std::exception";
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
  if (why.empty() && ended != cudaSuccess) why = std::string("cudaStreamEndCapture: ") + cudaGetErrorString(ended);
  if (why.empty()) {
    const cudaError_t made = cudaGraphInstantiate(&exec_, graph, 0);
    if (made != cudaSuccess) {
      why = std::string("cudaGraphInstantiate: ") + cudaGetErrorString(made);
      exec_ = nullptr;
    }
  }
  if (graph) cudaGraphDestroy(graph);
  if (why.empty()) return;
  cudaGetLastError();  // the refused call's error: not the next launch's
  refused_ = true;
  log_line("gpu:", "warning: capturing the work as a CUDA graph failed (%s); it runs launch by launch", why.c_str());
}

}  // namespace spes::cuda
