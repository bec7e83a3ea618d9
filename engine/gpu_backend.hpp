// The GPU backend (engine/gpu_backend.cu): the GPU model (model/gpu) behind the
// training seam. Plain C++ so make_backend can ask for it without CUDA headers;
// built only with CUDA (SPES_HAVE_CUDA).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/backend.hpp"
#include "model/gpu/gpu_plan.hpp"
#include "model/gpu_memory.hpp"

namespace spes {

// The node's backend on `devices` (CUDA ordinals): one GpuBackend for one GPU; for
// several, one rank each under the data-parallel backend with NCCL. Throws
// GpuShapeError (model/gpu/gpu_plan.hpp) for a model shape the kernels cannot run,
// ConfigError when the config does not fit in a GPU's memory (naming a micro-batch
// that fits).
std::unique_ptr<TrainBackend> make_gpu_backend(const Config& cfg, const ParamLayout& layout, const Ownership& own,
                                               const std::vector<int>& devices);
// The node's ranks on `devices` (CUDA ordinals, one thread each) under the
// data-parallel backend with NCCL: what make_gpu_backend builds for several GPUs,
// here also for one, so tests and benches run the NCCL path on a one-GPU machine.
// `ranks`, when given, receives the rank backends (owned by the returned one), for
// tests that compare the ranks' device state.
std::unique_ptr<TrainBackend> make_nccl_data_parallel_backend(const Config& cfg, const ParamLayout& layout,
                                                              const Ownership& own, const std::vector<int>& devices,
                                                              std::vector<RankBackend*>* ranks = nullptr);
// One GpuBackend on GPU `ordinal`, as a rank (its theta_buffers are the device's fp32
// master weights and bf16 compute weights): for tests that read the device's θ.
std::unique_ptr<RankBackend> make_gpu_rank(const Config& cfg, const ParamLayout& layout, const Ownership& own,
                                           int ordinal = 0);

// A GpuBackend's memory (tests, benches): its plan, and the bytes of its arena's one
// cudaMalloc and of the buffers carved from it. Throws Error when `backend` is not a
// GpuBackend.
struct GpuMemoryUse {
  GpuMemoryPlan plan;
  int64_t arena_capacity = 0, arena_used = 0;
};
GpuMemoryUse gpu_memory_use(const TrainBackend& backend);

}  // namespace spes
