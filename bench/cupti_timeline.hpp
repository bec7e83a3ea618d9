// The device's own start and end time of every kernel, copy and memset that a stretch
// of host code runs, read through CUPTI's activity API (what NVIDIA's profilers build
// on), for bench/timeline.hpp's summary of a real training step.
//
// CUPTI is opened with dlopen rather than linked, so a bench runs (and says why it has
// no timeline) on a machine without it. The GPU check bundle ships the libcupti this
// build's header describes next to its binaries, and that copy is tried first: the
// records are read through this header's structs, so a library of another major
// version is refused.
#pragma once

#include <cupti.h>
#include <cxxabi.h>
#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "bench/timeline.hpp"

namespace spes::bench {

// A CUPTI call failed (the traced code's own errors pass through as they are).
struct CuptiError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class CuptiTimeline {
 public:
  // What the device ran while `step` ran, and CUPTI's clock just before and after it
  // (the records' clock, ns).
  struct Trace {
    std::vector<DeviceSpan> spans;
    uint64_t host_start_ns = 0, host_end_ns = 0;
    size_t dropped = 0;  // records CUPTI had no buffer space for
    size_t untimed = 0;  // records without timestamps (CUPTI may give a kernel none)
  };

  // The one timeline of this process (CUPTI's activity callbacks are process-wide), or
  // nullptr and *why when CUPTI cannot be loaded or refuses.
  static CuptiTimeline* open(std::string* why) {
    static std::unique_ptr<CuptiTimeline> the;
    static std::string failure;
    if (!the && failure.empty()) {
      auto t = std::unique_ptr<CuptiTimeline>(new CuptiTimeline());
      failure = t->load();
      if (failure.empty()) the = std::move(t);
    }
    if (!the && why) *why = failure;
    return the.get();
  }

  // Runs `step` (which must end with the device synchronised) with every kernel, copy
  // and memset recorded. The first traced work of a process also pays for CUPTI
  // setting up its buffers: trace a warm-up first.
  template <class Step>
  Trace trace(Step&& step) {
    {
      std::lock_guard<std::mutex> lock(records().mutex);
      records().spans.clear();
      records().untimed = 0;
    }
    Trace t;
    {
      Enabled on(*this);  // disabled again on every way out
      t.host_start_ns = now_ns();
      step();
      t.host_end_ns = now_ns();
    }
    check(api_.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
    check(api_.dropped(nullptr, 0, &t.dropped), "cuptiActivityGetNumDroppedRecords");
    std::lock_guard<std::mutex> lock(records().mutex);
    t.spans = std::move(records().spans);
    t.untimed = records().untimed;
    return t;
  }

  // Which library was opened, and its CUPTI API version.
  const std::string& describe() const { return description_; }

 private:
  struct Api {
    CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc) = nullptr;
    CUptiResult (*set_attribute)(CUpti_ActivityAttribute, size_t*, void*) = nullptr;
    CUptiResult (*enable)(CUpti_ActivityKind) = nullptr;
    CUptiResult (*disable)(CUpti_ActivityKind) = nullptr;
    CUptiResult (*flush_all)(uint32_t) = nullptr;
    CUptiResult (*dropped)(CUcontext, uint32_t, size_t*) = nullptr;
    CUptiResult (*next_record)(uint8_t*, size_t, CUpti_Activity**) = nullptr;
    CUptiResult (*timestamp)(uint64_t*) = nullptr;
    CUptiResult (*version)(uint32_t*) = nullptr;
    CUptiResult (*result_string)(CUptiResult, const char**) = nullptr;
  };
  // Filled by CUPTI's buffer callback, on whichever thread CUPTI calls it. Never
  // freed: CUPTI may deliver a last buffer while the process exits.
  struct Records {
    std::mutex mutex;
    std::vector<DeviceSpan> spans;
    size_t untimed = 0;
    CUptiResult (*next_record)(uint8_t*, size_t, CUpti_Activity**) = nullptr;
  };
  static Records& records() {
    static Records* r = new Records;
    return *r;
  }
  // Kernels as they run (CONCURRENT_KERNEL: tracing them does not serialise them).
  static constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                                  CUPTI_ACTIVITY_KIND_MEMSET};
  static constexpr size_t kBufferBytes = size_t(8) << 20;

  // The kinds above enabled for its lifetime; disabled before the flush, so that
  // nothing is recorded after the records are collected.
  struct Enabled {
    explicit Enabled(const CuptiTimeline& t) : t_(t) {
      for (const CUpti_ActivityKind k : kKinds) {
        const CUptiResult r = t_.api_.enable(k);
        if (r != CUPTI_SUCCESS) {
          off();  // no destructor runs for a constructor that throws
          t_.check(r, "cuptiActivityEnable");
        }
        ++on_;
      }
    }
    ~Enabled() { off(); }
    void off() {
      for (; on_ > 0; --on_) t_.api_.disable(kKinds[on_ - 1]);
    }
    const CuptiTimeline& t_;
    int on_ = 0;
  };

  CuptiTimeline() = default;

  uint64_t now_ns() const {
    uint64_t t = 0;
    check(api_.timestamp(&t), "cuptiGetTimestamp");
    return t;
  }

  void check(CUptiResult r, const char* what) const {
    if (r == CUPTI_SUCCESS) return;
    const char* s = nullptr;
    if (api_.result_string) api_.result_string(r, &s);
    throw CuptiError(std::string(what) + " failed: " + (s ? s : std::to_string(int(r))));
  }

  // The library's file name for this header's major version (libcupti.so.13 for 13.x).
  static std::string soname() { return "libcupti.so." + std::to_string(CUPTI_API_VERSION / 10000); }

  // "" when loaded; otherwise why not.
  std::string load() {
    std::vector<std::string> tried;
    if (const char* p = std::getenv("SPES_CUPTI")) tried.push_back(p);
    char exe[4096];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
      std::string dir(exe, size_t(n));
      tried.push_back(dir.substr(0, dir.rfind('/') + 1) + soname());  // the bundle's copy
    }
    tried.push_back(soname());  // the loader's search path
    for (const char* dir : {"/usr/local/cuda/extras/CUPTI/lib64/", "/usr/local/cuda/lib64/"})
      tried.push_back(dir + soname());
    void* lib = nullptr;
    std::string errors;
    for (const std::string& path : tried) {
      if ((lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL))) {
        description_ = path;
        break;
      }
      errors += (errors.empty() ? "" : "; ") + std::string(dlerror());
    }
    if (!lib) return "no " + soname() + " (" + errors + ")";
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      return fn != nullptr;
    };
    if (!sym(api_.register_callbacks, "cuptiActivityRegisterCallbacks") ||
        !sym(api_.set_attribute, "cuptiActivitySetAttribute") || !sym(api_.enable, "cuptiActivityEnable") ||
        !sym(api_.disable, "cuptiActivityDisable") || !sym(api_.flush_all, "cuptiActivityFlushAll") ||
        !sym(api_.dropped, "cuptiActivityGetNumDroppedRecords") ||
        !sym(api_.next_record, "cuptiActivityGetNextRecord") || !sym(api_.timestamp, "cuptiGetTimestamp") ||
        !sym(api_.version, "cuptiGetVersion") || !sym(api_.result_string, "cuptiGetResultString"))
      return description_ + " lacks a CUPTI function this bench calls";
    uint32_t version = 0;
    if (api_.version(&version) != CUPTI_SUCCESS || version / 10000 != CUPTI_API_VERSION / 10000)
      return description_ + " has CUPTI API version " + std::to_string(version) + "; this bench reads version " +
             std::to_string(CUPTI_API_VERSION) + "'s records";
    description_ += ", CUPTI API " + std::to_string(version);
    records().next_record = api_.next_record;
    try {
      check(api_.register_callbacks(&buffer_requested, &buffer_completed), "cuptiActivityRegisterCallbacks");
    } catch (const CuptiError& e) {
      return description_ + ": " + e.what();
    }
    // Our buffers come zeroed (calloc), so CUPTI need not zero them on the launching
    // thread, inside the traced step. Where it refuses, it zeroes them: the
    // description says so, the records are the same.
    uint8_t zeroed = 1;
    size_t bytes = sizeof zeroed;
    if (api_.set_attribute(CUPTI_ACTIVITY_ATTR_ZEROED_OUT_ACTIVITY_BUFFER, &bytes, &zeroed) != CUPTI_SUCCESS)
      description_ += ", buffers zeroed by CUPTI";
    return "";
  }

  static void buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *buffer = static_cast<uint8_t*>(std::calloc(1, kBufferBytes));  // 16-byte aligned; CUPTI needs 8
    *size = *buffer ? kBufferBytes : 0;
    *max_records = 0;  // as many as fit
  }

  static void buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
    Records& r = records();
    try {
      std::lock_guard<std::mutex> lock(r.mutex);
      CUpti_Activity* rec = nullptr;
      while (r.next_record(buffer, valid, &rec) == CUPTI_SUCCESS) {
        uint64_t start = 0, end = 0;
        std::string name;
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
          const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
          start = k->start, end = k->end, name = short_kernel_name(demangle(k->name));
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
          start = m->start, end = m->end, name = std::string("memcpy ") + copy_kind(m->copyKind);
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
          start = m->start, end = m->end, name = "memset";
        } else {
          continue;
        }
        if (start == 0 || end < start) r.untimed += 1;  // CUPTI_TIMESTAMP_UNKNOWN
        else r.spans.push_back({std::move(name), start, end});
      }
    } catch (...) {
      // An exception must not cross into CUPTI; what was read so far is kept.
    }
    std::free(buffer);
  }

  static std::string demangle(const char* name) {
    if (!name) return "(unnamed kernel)";
    int status = 0;
    char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
    std::string s = status == 0 && d ? d : name;
    std::free(d);
    return s;
  }

  static const char* copy_kind(uint8_t kind) {
    switch (kind) {
      case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "HtoD";
      case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "DtoH";
      case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "DtoD";
      case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "HtoH";
      case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "PtoP";
      default: return "other";
    }
  }

  Api api_;
  std::string description_;
};

}  // namespace spes::bench
