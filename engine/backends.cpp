// make_backend: [train] device → the backend that runs the node's math.
#include <cstdio>

#include "engine/backend.hpp"
#include "engine/base/error.hpp"
#include "engine/config.hpp"
#include "engine/cpu_backend.hpp"
#ifdef SPES_HAVE_CUDA
#include "cuda/device_probe.hpp"
#include "engine/gpu_backend.hpp"
#endif

namespace spes {

std::unique_ptr<TrainBackend> make_backend(const Config& cfg, const ParamLayout& layout, const Ownership& own) {
  const std::string& device = cfg.train.device;
  const long long node = (long long)cfg.spes.node_id;
#ifdef SPES_HAVE_CUDA
  std::string why;
  if (device == "cuda") return make_gpu_backend(cfg, layout, own);
  if (device == "auto" && cuda::gpu_available(&why)) {
    try {
      auto gpu = make_gpu_backend(cfg, layout, own);
      std::fprintf(stderr, "[node %lld] device = \"auto\": training on the GPU\n", node);
      return gpu;
    } catch (const GpuShapeError& e) {  // not "does not fit": that one the user must see and fix
      why = e.what();
    }
  }
#else
  const std::string why = "this binary was built without CUDA";
  if (device == "cuda")
    throw ConfigError(cfg.path + ": [train] device = \"cuda\" but " + why + " (rebuild with nvcc on the PATH)");
#endif
  auto backend = std::make_unique<CpuBackend>(cfg.model, cfg.train.loss, layout, own, cfg.train.micro_batch,
                                              cfg.train.threads);
  if (device == "auto")
    std::fprintf(stderr, "[node %lld] device = \"auto\": training on the CPU (no usable GPU: %s)\n", node, why.c_str());
  return backend;
}

}  // namespace spes
