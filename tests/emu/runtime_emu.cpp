// The CUDA runtime calls of the GPU model and backend (cuda/runtime.cu, model/gpu/,
// engine/gpu_backend.cu), on the host, for the emulated whole-step tests: emu::kDevices
// emulated H100s, the current one per host thread as in CUDA; device memory as
// emu::GlobalBuffer (bounds-checked, canary past the end, NaN at allocation) and
// counted per device; every call completes before it returns — except the one
// asynchrony a correct program must wait for:
//
//   A cudaMemcpyAsync from device memory into pinned host memory (cudaMallocHost) may
//   still be in flight when the call returns; the host sees the bytes only after it
//   synchronizes (cudaStreamSynchronize, cudaEventSynchronize on a later event,
//   cudaDeviceSynchronize). Here the destination holds NaN bytes until then, so a
//   read before the wait shows as a NaN instead of passing by luck. (Into pageable
//   memory the call returns after the copy, as the runtime documents.)
//
//   The other way, a cudaMemcpyAsync from pinned memory into device memory may read
//   its source after the call returns, until the host synchronizes as above. Here the
//   copy lands at once, and the source bytes it read are kept until then: if the host
//   changed them before the wait (a staging buffer refilled too early), the bytes a
//   GPU would have copied are unknown, and that is an emu::fail. (From pageable
//   memory the runtime stages the bytes before returning: free to change.)
//
// Graph capture (cudaStreamBeginCapture … cudaStreamEndCapture, cudaGraphInstantiate,
// cudaGraphLaunch): while a stream captures, the launches, library calls, memsets and
// device-to-device copies enqueued on it are kept, not done, and every launch of the
// instantiated graph does them in order; a call a capture cannot hold (a
// synchronization, a copy to or from host memory, an event, an allocation or a free
// made by the capturing thread) returns cudaErrorStreamCaptureUnsupported and
// invalidates the capture, as CUDA's thread-local capture mode does.
//
// Anything outside that model fails loudly (emu::fail): a copy from or to bytes
// outside every allocation, a free of a pointer never allocated. (All devices' memory
// is one host address space: a kernel reading another device's buffer is not caught.)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tests/emu/emu.hpp"

namespace emu {
namespace {

constexpr size_t kDeviceBytes = size_t(80) << 30;  // an H100 80GB, as cudaMemGetInfo reports
constexpr unsigned char kInFlight = 0xFF;          // NaN as fp32 and as bf16

std::mutex g_mutex;  // the maps below; data-parallel backends call from several threads
struct Allocation {
  std::unique_ptr<GlobalBuffer> buffer;
  int device;
};
std::map<const void*, Allocation> g_device;  // cudaMalloc
std::map<const void*, size_t> g_pinned;      // cudaMallocHost
size_t g_device_used[kDevices] = {};
thread_local int t_device = 0;  // cudaSetDevice

// A device→pinned copy not yet visible to the host: its bytes as the stream read them.
struct InFlight {
  uint64_t seq;
  cudaStream_t stream;
  void* dst;
  std::vector<unsigned char> bytes;
};
std::vector<InFlight> g_in_flight;
// A pinned→device copy the host has not waited for: its source as the copy read it.
struct PinnedRead {
  uint64_t seq;
  cudaStream_t stream;
  const void* src;
  std::vector<unsigned char> bytes;
};
std::vector<PinnedRead> g_pinned_reads;
uint64_t g_seq = 0;  // stream position: one per call that enqueues work

bool is_pinned(const void* p, size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return std::any_of(g_pinned.begin(), g_pinned.end(), [&](const auto& kv) {
    const auto b = reinterpret_cast<uintptr_t>(kv.first);
    return a >= b && a + bytes <= b + kv.second;
  });
}

// The host sees every device→pinned copy enqueued on `stream` (nullptr: any) before
// position `seq`, and every pinned→device copy there is done reading its source
// (which must still hold the bytes it read).
void land_before(cudaStream_t stream, uint64_t seq) {
  auto waited_for = [&](uint64_t at, cudaStream_t on) { return at < seq && (stream == nullptr || on == stream); };
  std::erase_if(g_in_flight, [&](InFlight& f) {
    if (!waited_for(f.seq, f.stream)) return false;
    std::memcpy(f.dst, f.bytes.data(), f.bytes.size());
    return true;
  });
  std::erase_if(g_pinned_reads, [&](const PinnedRead& r) {
    if (!waited_for(r.seq, r.stream)) return false;
    if (std::memcmp(r.src, r.bytes.data(), r.bytes.size()) != 0)
      fail("the pinned source of a host-to-device cudaMemcpyAsync (" + std::to_string(r.bytes.size()) +
           " bytes) changed before the host waited for the copy: a GPU may have copied the new bytes");
    return true;
  });
}

struct Event {
  uint64_t seq = 0;  // position at cudaEventRecord
  cudaStream_t stream = nullptr;
  bool recorded = false;
};

// A stream: its device first (require_current_device reads it), then its capture.
struct Stream {
  int device = 0;
  bool capturing = false;
  bool invalidated = false;  // a call the capture cannot hold was made during it
  std::vector<std::function<void()>> captured;
};
Stream* stream_of(cudaStream_t stream) { return reinterpret_cast<Stream*>(stream); }

// A captured graph, and its instantiation: the work in stream order.
struct Graph {
  std::vector<std::function<void()>> work;
};

// The stream this thread captures on, if any: in CUDA's thread-local capture mode
// the capturing thread may not allocate, free or synchronize while it lasts.
thread_local Stream* t_capture = nullptr;

// A call a capture cannot hold: refused, and the capture can no longer end well.
// `stream`: an operation on that stream (nullptr: a call of the thread's, such as an
// allocation or a device synchronization).
bool refuse_in_capture(cudaStream_t stream) {
  Stream* s = stream != nullptr && stream_of(stream)->capturing ? stream_of(stream) : t_capture;
  if (s == nullptr) return false;
  s->invalidated = true;
  return true;
}

}  // namespace

bool device_reachable(const void* p) {
  if (in_device_buffer(p, 0)) return true;  // a device allocation, inside or just past an arena buffer
  std::lock_guard lock(g_mutex);
  return is_pinned(p, 0);
}

bool capturing(cudaStream_t stream) { return stream != nullptr && stream_of(stream)->capturing; }

void on_stream(cudaStream_t stream, std::function<void()> work) {
  if (capturing(stream))
    stream_of(stream)->captured.push_back(std::move(work));
  else
    work();
}

}  // namespace emu

using emu::g_mutex;

// ---- device ------------------------------------------------------------------------

cudaError_t cudaGetDeviceCount(int* count) {
  *count = emu::kDevices;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= emu::kDevices) return cudaErrorInvalidDevice;
  emu::t_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = emu::t_device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device < 0 || device >= emu::kDevices) return cudaErrorInvalidDevice;
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "NVIDIA H100 80GB HBM3 (emulated)");
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = emu::kSms;
  prop->totalGlobalMem = emu::kDeviceBytes;
  prop->sharedMemPerBlockOptin = emu::kSmemOptinLimit;
  prop->l2CacheSize = 50 << 20;
  prop->memoryBusWidth = 5120;
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  std::lock_guard lock(g_mutex);
  *total_bytes = emu::kDeviceBytes;
  *free_bytes = emu::kDeviceBytes - emu::g_device_used[emu::t_device];
  return cudaSuccess;
}

// Every stream's copies, every device's: more than CUDA promises for one device.
cudaError_t cudaDeviceSynchronize() {
  if (emu::refuse_in_capture(nullptr)) return cudaErrorStreamCaptureUnsupported;
  std::lock_guard lock(g_mutex);
  emu::land_before(nullptr, UINT64_MAX);
  return cudaSuccess;
}

// ---- memory --------------------------------------------------------------------------

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  if (emu::refuse_in_capture(nullptr)) return cudaErrorStreamCaptureUnsupported;
  std::lock_guard lock(g_mutex);
  const int device = emu::t_device;
  if (bytes > emu::kDeviceBytes - emu::g_device_used[device]) return cudaErrorMemoryAllocation;
  auto buffer = std::make_unique<emu::GlobalBuffer>(bytes);
  buffer->poison();  // cudaMalloc'd memory holds garbage: NaN here, so a read before a write shows
  *ptr = buffer->as<void>();
  emu::g_device_used[device] += bytes;
  emu::g_device.emplace(*ptr, emu::Allocation{std::move(buffer), device});
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  if (emu::refuse_in_capture(nullptr)) return cudaErrorStreamCaptureUnsupported;
  std::lock_guard lock(g_mutex);
  const auto it = emu::g_device.find(ptr);
  if (it == emu::g_device.end()) emu::fail("cudaFree of a pointer cudaMalloc never returned");
  emu::require_no_pool_in(ptr, it->second.buffer->bytes());
  emu::g_device_used[it->second.device] -= it->second.buffer->bytes();
  emu::g_device.erase(it);  // checks the canary past the end
  return cudaSuccess;
}

// Pinned host memory (the typed cudaMallocHost of cuda_runtime.h calls this).
cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned) {
  if (emu::refuse_in_capture(nullptr)) return cudaErrorStreamCaptureUnsupported;
  std::lock_guard lock(g_mutex);
  *ptr = std::aligned_alloc(256, std::max<size_t>(256, (bytes + 255) / 256 * 256));
  if (*ptr == nullptr) return cudaErrorMemoryAllocation;
  emu::g_pinned.emplace(*ptr, bytes);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t bytes) { return cudaHostAlloc(ptr, bytes, 0); }

cudaError_t cudaFreeHost(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  if (emu::refuse_in_capture(nullptr)) return cudaErrorStreamCaptureUnsupported;
  std::lock_guard lock(g_mutex);
  const auto it = emu::g_pinned.find(ptr);
  if (it == emu::g_pinned.end()) emu::fail("cudaFreeHost of a pointer cudaMallocHost never returned");
  // cudaFreeHost synchronizes the device first, so copies still reading it finish first.
  emu::land_before(nullptr, UINT64_MAX);
  emu::g_pinned.erase(it);
  std::free(ptr);
  return cudaSuccess;
}

// Checks both ends against the direction, copies (or, device→pinned, defers).
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  const bool src_device = emu::in_global_buffer(src, bytes), dst_device = emu::in_global_buffer(dst, bytes);
  if (emu::capturing(stream)) {  // device to device only: host memory would be read at each replay
    if (!src_device || !dst_device) return emu::refuse_in_capture(stream), cudaErrorStreamCaptureUnsupported;
    emu::on_stream(stream, [=] { cudaMemcpyAsync(dst, src, bytes, kind, nullptr); });
    return cudaSuccess;
  }
  std::lock_guard lock(g_mutex);
  ++emu::g_seq;
  if (bytes == 0) return cudaSuccess;
  switch (kind) {
    case cudaMemcpyHostToDevice: emu::require_device(dst, bytes, "cudaMemcpyAsync HostToDevice, dst"); break;
    case cudaMemcpyDeviceToHost: emu::require_device(src, bytes, "cudaMemcpyAsync DeviceToHost, src"); break;
    case cudaMemcpyDeviceToDevice:
      emu::require_device(src, bytes, "cudaMemcpyAsync DeviceToDevice, src");
      emu::require_device(dst, bytes, "cudaMemcpyAsync DeviceToDevice, dst");
      break;
    case cudaMemcpyDefault: break;  // unified addressing: either side may be either
    default: emu::fail("cudaMemcpyAsync: kind " + std::to_string(int(kind)) + " is not emulated");
  }
  if (src_device && !dst_device && emu::is_pinned(dst, bytes)) {
    const auto* s = static_cast<const unsigned char*>(src);
    emu::g_in_flight.push_back({emu::g_seq, stream, dst, {s, s + bytes}});
    std::memset(dst, emu::kInFlight, bytes);
    return cudaSuccess;
  }
  if (dst_device && !src_device && emu::is_pinned(src, bytes)) {
    const auto* s = static_cast<const unsigned char*>(src);
    emu::g_pinned_reads.push_back({emu::g_seq, stream, src, {s, s + bytes}});
  }
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (emu::refuse_in_capture(nullptr)) return cudaErrorStreamCaptureUnsupported;
  const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
  cudaDeviceSynchronize();  // the legacy stream: returns after the copy, and after all earlier work
  return e;
}

// The launchers' memsets: call order is stream order (see the file comment).
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream) {
  emu::require_device(ptr, count, "cudaMemsetAsync");
  emu::on_stream(stream, [=] {
    std::lock_guard lock(g_mutex);
    ++emu::g_seq;
    std::memset(ptr, value, count);
  });
  return cudaSuccess;
}

cudaError_t cudaMemset2DAsync(void* ptr, size_t pitch, int value, size_t width, size_t height, cudaStream_t stream) {
  if (width > pitch) return cudaErrorInvalidValue;
  if (width == 0 || height == 0) return cudaSuccess;
  auto* p = static_cast<unsigned char*>(ptr);
  emu::require_device(p, (height - 1) * pitch + width, "cudaMemset2DAsync");
  emu::on_stream(stream, [=] {
    std::lock_guard lock(g_mutex);
    ++emu::g_seq;
    for (size_t row = 0; row < height; ++row) std::memset(p + row * pitch, value, width);
  });
  return cudaSuccess;
}

// ---- streams and events ------------------------------------------------------------------

// A stream belongs to the device current at its creation.
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  auto* s = new emu::Stream;
  s->device = emu::t_device;
  *stream = reinterpret_cast<cudaStream_t>(s);
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete emu::stream_of(stream);
  return cudaSuccess;
}

namespace emu {

int current_device() { return t_device; }

// A kernel launch or a library call on a stream of another device than the calling
// thread's current one: CUDA refuses the launch (invalid resource handle); in a
// data-parallel node it means a rank thread forgot its cudaSetDevice.
void require_current_device(cudaStream_t stream, const char* what) {
  if (stream == nullptr) return;  // the legacy stream: the current device's
  const int device = *reinterpret_cast<const int*>(stream);
  if (device != t_device)
    fail(std::string(what) + " on a stream of device " + std::to_string(device) + " while device " +
         std::to_string(t_device) + " is current (cudaSetDevice missing on this thread?)");
}

}  // namespace emu

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (emu::refuse_in_capture(stream)) return cudaErrorStreamCaptureUnsupported;  // this stream's, or the thread's
  std::lock_guard lock(g_mutex);
  emu::land_before(stream, UINT64_MAX);  // the legacy stream (nullptr) waits for all
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) {
  *event = reinterpret_cast<cudaEvent_t>(new emu::Event);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<emu::Event*>(event);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (emu::refuse_in_capture(stream)) return cudaErrorStreamCaptureUnsupported;  // not emulated in a graph
  std::lock_guard lock(g_mutex);
  auto* e = reinterpret_cast<emu::Event*>(event);
  e->seq = ++emu::g_seq;
  e->stream = stream;
  e->recorded = true;
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (emu::refuse_in_capture(nullptr)) return cudaErrorStreamCaptureUnsupported;
  std::lock_guard lock(g_mutex);
  const auto* e = reinterpret_cast<emu::Event*>(event);
  emu::land_before(e->stream, e->seq);
  return cudaSuccess;
}

// No clock on the emulated device: every interval is zero.
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!reinterpret_cast<emu::Event*>(start)->recorded || !reinterpret_cast<emu::Event*>(end)->recorded)
    return cudaErrorInvalidResourceHandle;
  *ms = 0.0f;
  return cudaSuccess;
}

// ---- graphs ------------------------------------------------------------------------

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode) {
  if (stream == nullptr) return cudaErrorStreamCaptureUnsupported;  // the legacy stream cannot capture
  emu::require_current_device(stream, "cudaStreamBeginCapture");
  emu::Stream& s = *emu::stream_of(stream);
  if (s.capturing || emu::t_capture != nullptr) return cudaErrorIllegalState;  // one capture a thread here
  s.capturing = true;
  emu::t_capture = &s;
  s.invalidated = false;
  s.captured.clear();
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (stream == nullptr || !emu::stream_of(stream)->capturing) return cudaErrorIllegalState;
  emu::Stream& s = *emu::stream_of(stream);
  s.capturing = false;
  if (emu::t_capture == &s) emu::t_capture = nullptr;
  std::vector<std::function<void()>> work = std::move(s.captured);
  s.captured.clear();
  if (s.invalidated) {
    *graph = nullptr;
    return cudaErrorStreamCaptureInvalidated;
  }
  *graph = reinterpret_cast<cudaGraph_t>(new emu::Graph{std::move(work)});
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  if (graph == nullptr) return cudaErrorInvalidValue;
  *exec = reinterpret_cast<cudaGraphExec_t>(new emu::Graph(*reinterpret_cast<emu::Graph*>(graph)));
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (exec == nullptr) return cudaErrorInvalidValue;
  emu::require_current_device(stream, "cudaGraphLaunch");
  for (const auto& work : reinterpret_cast<emu::Graph*>(exec)->work) emu::on_stream(stream, work);
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete reinterpret_cast<emu::Graph*>(graph);
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete reinterpret_cast<emu::Graph*>(exec);
  return cudaSuccess;
}

// The driver entry points the kernels' host code looks up: cuTensorMapEncodeTiled
// (cuda/tma.cu), as the emulator's encoder (tests/emu/emu.cpp); any other is not found.
cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** funcPtr, unsigned int, unsigned long long,
                                             cudaDriverEntryPointQueryResult* driverStatus) {
  const bool known = std::strcmp(symbol, "cuTensorMapEncodeTiled") == 0;
  *funcPtr = known ? reinterpret_cast<void*>(&emu::encode_tensor_map_tiled) : nullptr;
  if (driverStatus != nullptr) *driverStatus = known ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}
