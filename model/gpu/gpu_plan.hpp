// What a GPU node needs before anything is allocated: the shapes its kernels can
// run (one place for every limit), their own scratch sizes, and with them the memory
// plan (model/gpu_memory.hpp). Plain C++, so `spes-engine plan` and make_backend ask
// without including CUDA headers; built only with CUDA.
#pragma once
#include <cstdint>
#include <string>

#include "engine/base/error.hpp"
#include "model/gpu_memory.hpp"
#include "model/layout.hpp"
#include "model/model_config.hpp"

namespace spes {

// The GPU cannot run this config at all: no usable device, or a model shape the
// kernels do not support. ([train] device = "auto" then trains on the CPU.)
struct GpuShapeError : ConfigError {
  using ConfigError::ConfigError;
};

// Throws GpuShapeError naming `config_path`, the [model] key and the limit when the
// kernels cannot run `m`.
void check_gpu_shape(const ModelConfig& m, const std::string& config_path);

// What scratch sizes depend on besides the shapes. The norm backwards keep one
// partial row per resident block, so their scratch is sized for every block the
// device can hold at once; CUB's sort storage is asked of the device when there is
// one and bounded otherwise.
struct GpuDeviceLimits {
  int sm_count = 132;          // an H100 SXM or H200
  int max_blocks_per_sm = 32;  // sm_80 and sm_90
  bool on_device = false;      // sizes may be asked of the current device
};

// The current device's limits (needs a GPU).
GpuDeviceLimits current_gpu_limits();

KernelScratch gpu_kernel_scratch(const ModelConfig& m, int64_t micro_batch, int64_t owned,
                                 const GpuDeviceLimits& device);

// plan_gpu_memory with the kernels' scratch for `device`.
GpuMemoryPlan plan_gpu_node(const ModelConfig& m, const ParamLayout& layout, const Ownership& own,
                            int64_t micro_batch, const GpuDeviceLimits& device);

}  // namespace spes
