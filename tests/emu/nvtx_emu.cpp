// NVTX memory pools, emulated. cuda/runtime.cu tells tools which parts of the
// arena's one cudaMalloc are buffers (nvtxMemHeapRegister, nvtxMemRegionsRegister,
// nvtxMemRegionsName); on a GPU, compute-sanitizer's memcheck listens and reports any
// access outside them. This file is a static NVTX injection — the way a tool hooks
// NVTX, linked in rather than loaded — so the emulator listens too and checks:
//   - a kernel's cp.async sources, cuBLAS operands and NCCL buffers that lie in a
//     pool lie inside one of its regions (in_device_buffer);
//   - after every kernel launch, the bytes of every pool outside its regions (the
//     arena's guards) still hold what they held when the regions were registered:
//     a kernel that wrote past its buffer stops the test there, naming the buffer.
// The runtime API's copies and memsets are checked against the allocation only: the
// arena fills and reads its own guards through them.
#include <nvtx3/nvToolsExtMem.h>

#include <algorithm>
#include <functional>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <vector>

#include "tests/emu/emu.hpp"

namespace emu {
namespace {

struct Region {
  uintptr_t begin;
  size_t bytes;
  std::string name;
};
// Bytes of a pool outside every region, as they were at the last registration.
struct Gap {
  uintptr_t begin;
  std::vector<unsigned char> bytes;
  int after;  // the region it follows, -1 before the first
};
struct Pool {
  int device;  // whose launches may write it: each checks only its own device's pools
  uintptr_t begin;
  size_t bytes;
  std::vector<Region> regions;  // sorted by address
  std::vector<Gap> gaps;
};

// Data-parallel ranks register and launch from their own threads; every cp.async
// reads the pools (shared), registrations change them (exclusive).
std::shared_mutex g_mutex;
std::map<uintptr_t, Pool> g_pools;

std::string describe(const Region& r) { return "buffer '" + r.name + "' (" + std::to_string(r.bytes) + " B)"; }

void snapshot_gaps(Pool& p) {
  p.gaps.clear();
  uintptr_t at = p.begin;
  int after = -1;
  auto add = [&](uintptr_t end) {
    if (end > at) {
      const auto* b = reinterpret_cast<const unsigned char*>(at);
      p.gaps.push_back({at, {b, b + (end - at)}, after});
    }
  };
  for (const Region& r : p.regions) {
    add(r.begin);
    at = r.begin + r.bytes;
    ++after;
  }
  add(p.begin + p.bytes);
}

nvtxMemHeapHandle_t heap_register(nvtxDomainHandle_t, const nvtxMemHeapDesc_t* desc) {
  if (desc->type != NVTX_MEM_TYPE_VIRTUAL_ADDRESS || desc->usage != NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR)
    fail("nvtxMemHeapRegister: only sub-allocator heaps of virtual addresses are emulated");
  const auto* range = static_cast<const nvtxMemVirtualRangeDesc_t*>(desc->typeSpecificDesc);
  require_device(range->ptr, range->size, "nvtxMemHeapRegister");
  const auto begin = reinterpret_cast<uintptr_t>(range->ptr);
  std::lock_guard lock(g_mutex);
  if (!g_pools.emplace(begin, Pool{current_device(), begin, range->size, {}, {}}).second)
    fail("nvtxMemHeapRegister: a heap is registered twice");
  return reinterpret_cast<nvtxMemHeapHandle_t>(const_cast<void*>(range->ptr));
}

Pool& pool_of(nvtxMemHeapHandle_t heap, const char* api) {
  const auto it = g_pools.find(reinterpret_cast<uintptr_t>(heap));
  if (it == g_pools.end()) fail(std::string(api) + ": a heap never registered");
  return it->second;
}

// No check here: the launches were checked, and a guard a test overwrote on purpose
// through the runtime API (test_cuda_core) goes with its arena.
void heap_unregister(nvtxDomainHandle_t, nvtxMemHeapHandle_t heap) {
  std::lock_guard lock(g_mutex);
  g_pools.erase(pool_of(heap, "nvtxMemHeapUnregister").begin);
}

void regions_register(nvtxDomainHandle_t, const nvtxMemRegionsRegisterBatch_t* batch) {
  if (batch->regionType != NVTX_MEM_TYPE_VIRTUAL_ADDRESS)
    fail("nvtxMemRegionsRegister: only regions of virtual addresses are emulated");
  std::lock_guard lock(g_mutex);
  Pool& p = pool_of(batch->heap, "nvtxMemRegionsRegister");
  const auto* desc = static_cast<const unsigned char*>(batch->regionDescElements);
  for (size_t i = 0; i < batch->regionCount; ++i) {
    const auto* r = reinterpret_cast<const nvtxMemVirtualRangeDesc_t*>(desc + i * batch->regionDescElementSize);
    const auto begin = reinterpret_cast<uintptr_t>(r->ptr);
    if (begin < p.begin || begin + r->size > p.begin + p.bytes)
      fail("nvtxMemRegionsRegister: region " + std::to_string(i) + " lies outside its heap");
    p.regions.push_back({begin, r->size, std::string("#").append(std::to_string(p.regions.size()))});
  }
  std::sort(p.regions.begin(), p.regions.end(), [](const Region& a, const Region& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < p.regions.size(); ++i)
    if (p.regions[i - 1].begin + p.regions[i - 1].bytes > p.regions[i].begin)
      fail("nvtxMemRegionsRegister: regions " + describe(p.regions[i - 1]) + " and " + describe(p.regions[i]) +
           " overlap");
  snapshot_gaps(p);
}

// The arena registers its guards for the time it reads them (check_guards): the gaps
// are taken again when they are unregistered.
void regions_unregister(nvtxDomainHandle_t, const nvtxMemRegionsUnregisterBatch_t* batch) {
  if (batch->refType != NVTX_MEM_REGION_REF_TYPE_POINTER)
    fail("nvtxMemRegionsUnregister: only regions by pointer are emulated");
  std::lock_guard lock(g_mutex);
  std::set<Pool*> changed;
  const auto* refs = reinterpret_cast<const unsigned char*>(batch->refElements);
  for (size_t i = 0; i < batch->refCount; ++i) {
    const auto* ref = reinterpret_cast<const nvtxMemRegionRef_t*>(refs + i * batch->refElementSize);
    const auto at = reinterpret_cast<uintptr_t>(ref->pointer);
    Pool* found = nullptr;
    for (auto& [begin, p] : g_pools)
      if (std::erase_if(p.regions, [&](const Region& r) { return r.begin == at; }) > 0) found = &p;
    if (!found) fail("nvtxMemRegionsUnregister: no region starts at that pointer");
    changed.insert(found);
  }
  // Once per pool whose regions changed, after the whole batch (check_guards
  // unregisters every guard of an arena at once), and only those: another device's
  // kernels may be writing theirs.
  for (Pool* p : changed) snapshot_gaps(*p);
}

void regions_name(nvtxDomainHandle_t, const nvtxMemRegionsNameBatch_t* batch) {
  std::lock_guard lock(g_mutex);
  const auto* desc = reinterpret_cast<const unsigned char*>(batch->regionElements);
  for (size_t i = 0; i < batch->regionCount; ++i) {
    const auto* n = reinterpret_cast<const nvtxMemRegionNameDesc_t*>(desc + i * batch->regionElementSize);
    if (n->regionRefType != NVTX_MEM_REGION_REF_TYPE_POINTER || n->nameType != NVTX_MESSAGE_TYPE_ASCII)
      fail("nvtxMemRegionsName: only ASCII names of regions by pointer are emulated");
    const auto at = reinterpret_cast<uintptr_t>(n->region.pointer);
    bool found = false;
    for (auto& [begin, p] : g_pools)
      for (Region& r : p.regions)
        if (r.begin == at) r.name = n->name.ascii, found = true;
    if (!found) fail("nvtxMemRegionsName: no region starts at that pointer");
  }
}

}  // namespace
}  // namespace emu

// The NVTX injection's entry point (nvtx_injection_emu.cpp points NVTX at it): fills
// the memory module's slots with the functions above.
extern "C" int spes_emu_nvtx_initialize(nvtxExtModuleInfo_t* module) {
  using namespace emu;
  // Other modules stay no-ops; so would a memory module of another layout.
  if (module->moduleId != NVTX_EXT_MODULEID_MEM || module->compatId != NVTX_EXT_COMPATID_MEM) return 1;
  for (size_t s = 0; s < module->segmentsCount; ++s) {
    intptr_t* slots = module->segments[s].functionSlots;
    const size_t n = module->segments[s].slotCount;
    auto set = [&](size_t id, auto* fn) {
      if (id < n) slots[id] = reinterpret_cast<intptr_t>(fn);
    };
    set(NVTX3EXT_CBID_nvtxMemHeapRegister, &heap_register);
    set(NVTX3EXT_CBID_nvtxMemHeapUnregister, &heap_unregister);
    set(NVTX3EXT_CBID_nvtxMemRegionsRegister, &regions_register);
    set(NVTX3EXT_CBID_nvtxMemRegionsUnregister, &regions_unregister);
    set(NVTX3EXT_CBID_nvtxMemRegionsName, &regions_name);
  }
  return 1;
}

namespace emu {

bool in_device_buffer(const void* ptr, size_t bytes) {
  if (!in_global_buffer(ptr, bytes)) return false;
  const auto a = reinterpret_cast<uintptr_t>(ptr);
  std::shared_lock lock(g_mutex);
  for (const auto& [begin, p] : g_pools) {
    if (a + bytes <= p.begin || a >= p.begin + p.bytes || p.regions.empty()) continue;
    return std::any_of(p.regions.begin(), p.regions.end(),
                       [&](const Region& r) { return a >= r.begin && a + bytes <= r.begin + r.bytes; });
  }
  return true;
}

void require_device_buffer(const void* ptr, size_t bytes, const std::string& what) {
  if (bytes != 0 && !in_device_buffer(ptr, bytes))
    fail(what + ": " + std::to_string(bytes) + " bytes outside every device buffer (an allocation, or a region of "
                "an arena registered through NVTX)");
}

void require_no_pool_in(const void* ptr, size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(ptr);
  std::shared_lock lock(g_mutex);
  for (const auto& [begin, p] : g_pools)
    if (begin >= a && begin < a + bytes)
      fail("cudaFree of memory still registered as an NVTX heap (nvtxMemHeapUnregister first)");
}

void check_pool_guards(const std::function<std::string()>& after) {
  const int device = current_device();  // the launching thread's: its launch wrote only there
  std::shared_lock lock(g_mutex);
  for (const auto& [begin, p] : g_pools) {
    if (p.device != device) continue;
    for (const Gap& g : p.gaps) {
      const auto* now = reinterpret_cast<const unsigned char*>(g.begin);
      const auto diff = std::mismatch(g.bytes.begin(), g.bytes.end(), now).first;
      if (diff == g.bytes.end()) continue;
      fail(after() + ": byte " + std::to_string(diff - g.bytes.begin()) + " of the arena's guard " +
           (g.after < 0 ? "before the first buffer" : "after " + describe(p.regions[size_t(g.after)])) +
           " changed (an out-of-bounds write)");
    }
  }
}

}  // namespace emu
