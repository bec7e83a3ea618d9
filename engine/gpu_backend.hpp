// The GPU backend (engine/gpu_backend.cu): the GPU model (model/gpu) behind the
// training seam. Plain C++ so make_backend can ask for it without CUDA headers;
// built only with CUDA (SPES_HAVE_CUDA).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/backend.hpp"
#include "engine/base/error.hpp"
#include "model/gpu_memory.hpp"

namespace spes {

// The GPU cannot run this config at all: no usable device, or a model shape the
// kernels do not support. (device = "auto" then trains on the CPU.)
struct GpuShapeError : ConfigError {
  using ConfigError::ConfigError;
};

// Throws GpuShapeError as above, or ConfigError when the config does not fit in the
// GPU's memory (naming a micro-batch that fits).
std::unique_ptr<TrainBackend> make_gpu_backend(const Config& cfg, const ParamLayout& layout, const Ownership& own);
// The node's ranks on `devices` (CUDA ordinals, one thread each) under the
// data-parallel backend with NCCL: what make_gpu_backend builds for several GPUs,
// here also for one, so tests and benches run the NCCL path on a one-GPU machine.
// `ranks`, when given, receives the rank backends (owned by the returned one), for
// tests that compare the ranks' device state.
std::unique_ptr<TrainBackend> make_nccl_data_parallel_backend(const Config& cfg, const ParamLayout& layout,
                                                              const Ownership& own, const std::vector<int>& devices,
                                                              std::vector<TrainBackend*>* ranks = nullptr);

// The kernels' own scratch sizes on this device, as the backend plans them: its
// buffers are plan_gpu_memory(m, layout, own, micro_batch, gpu_kernel_scratch(...)).
KernelScratch gpu_kernel_scratch(const ModelConfig& m, int64_t micro_batch, int64_t owned);
// The same without a GPU (`spes-engine plan`): host-side sizes exact, the two that
// depend on the device (norm-backward partials, CUB's sort storage) as upper
// bounds for an H100/H200.
KernelScratch gpu_kernel_scratch_estimate(const ModelConfig& m, int64_t micro_batch, int64_t owned);

// A GpuBackend's device arena (tests, benches): the bytes of its one cudaMalloc and
// the bytes its buffers took. Throws Error when `backend` is not a GpuBackend.
struct GpuArenaUse {
  int64_t capacity = 0, used = 0;
};
GpuArenaUse gpu_arena_use(const TrainBackend& backend);

}  // namespace spes
