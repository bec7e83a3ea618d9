// How a GPU node's buffers lie in its one device allocation, the arena: each starts
// on a 256-byte boundary (cudaMalloc's own alignment; enough for any vector access)
// and is followed by its padding and a guard of kArenaGuardBytes, where a kernel
// writing past it is caught (cuda/runtime.cuh). Plain C++ on the ground floor: the
// memory plan (model/gpu_memory) sizes the arena by the rule the arena (cuda/runtime)
// carves it by.
#pragma once
#include <cstddef>

namespace spes {

constexpr size_t kArenaAlign = 256;
constexpr size_t kArenaGuardBytes = 256;

// The bytes one buffer takes in an arena: itself, padding and guard.
constexpr size_t arena_slot_bytes(size_t bytes) {
  return (bytes + kArenaAlign - 1) / kArenaAlign * kArenaAlign + kArenaGuardBytes;
}

}  // namespace spes
