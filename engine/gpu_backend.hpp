// The GPU backend (engine/gpu_backend.cu): the GPU model (model/gpu) behind the
// training seam. Plain C++ so make_backend can ask for it without CUDA headers;
// built only with CUDA (SPES_HAVE_CUDA).
#pragma once
#include <memory>
#include <string>

#include "engine/backend.hpp"

namespace spes {

// Throws ConfigError when the config cannot run on this GPU (no device, a shape the
// kernels do not support, or not enough memory — naming a micro-batch that fits).
std::unique_ptr<TrainBackend> make_gpu_backend(const Config& cfg, const ParamLayout& layout, const Ownership& own);

}  // namespace spes
