// make_backend: [train] device → the backend that runs the node's math.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/backend.hpp"
#include "engine/base/error.hpp"
#include "engine/config.hpp"
#include "engine/cpu_backend.hpp"
#ifdef SPES_HAVE_CUDA
#include "cuda/device_probe.hpp"
#include "engine/gpu_backend.hpp"
#endif

namespace spes {

#ifdef SPES_HAVE_CUDA
namespace {

// [train] gpus, or every visible GPU that divides the micro-batch (each rank takes an
// equal slice).
std::vector<int> node_gpus(const Config& cfg) {
  std::vector<int> devices;
  for (int64_t g : cfg.train.gpus) {
    if (g >= cuda::gpu_count())
      throw ConfigError(cfg.path + ": [train] gpus names GPU " + std::to_string(g) + " but " +
                        std::to_string(cuda::gpu_count()) + " are visible");
    if (std::find(devices.begin(), devices.end(), int(g)) != devices.end())
      throw ConfigError(cfg.path + ": [train] gpus names GPU " + std::to_string(g) + " twice");
    devices.push_back(int(g));
  }
  if (!devices.empty()) return devices;
  int use = cuda::gpu_count();
  while (use > 1 && cfg.train.micro_batch % use) --use;
  if (use < cuda::gpu_count())
    std::fprintf(stderr, "[node %lld] using %d of %d GPUs: [train] micro_batch = %lld must be a multiple\n",
                 (long long)cfg.spes.node_id, use, cuda::gpu_count(), (long long)cfg.train.micro_batch);
  for (int g = 0; g < use; ++g) devices.push_back(g);
  return devices;
}

std::unique_ptr<TrainBackend> make_node_gpu_backend(const Config& cfg, const ParamLayout& layout,
                                                    const Ownership& own) {
  std::string why;
  if (!cuda::gpu_available(&why)) throw GpuShapeError(cfg.path + ": there is no usable GPU (" + why + ")");
  check_gpu_shape(cfg.model, cfg.path);
  return make_gpu_backend(cfg, layout, own, node_gpus(cfg));
}

}  // namespace
#endif

std::unique_ptr<TrainBackend> make_backend(const Config& cfg, const ParamLayout& layout, const Ownership& own) {
  const Device device = cfg.train.device;
  const long long node = (long long)cfg.spes.node_id;
#ifdef SPES_HAVE_CUDA
  std::string why;
  if (device == Device::cuda) return make_node_gpu_backend(cfg, layout, own);
  if (device == Device::automatic && cuda::gpu_available(&why)) {
    try {
      auto gpu = make_node_gpu_backend(cfg, layout, own);
      std::fprintf(stderr, "[node %lld] device = \"auto\": training on the GPU\n", node);
      return gpu;
    } catch (const GpuShapeError& e) {  // not "does not fit": that one the user must see and fix
      why = e.what();
    }
  }
#else
  const std::string why = "this binary was built without CUDA";
  if (device == Device::cuda)
    throw ConfigError(cfg.path + ": [train] device = \"cuda\" but " + why + " (rebuild with nvcc on the PATH)");
#endif
  auto backend = std::make_unique<CpuBackend>(cfg.model, cfg.train.loss, layout, own, cfg.train.micro_batch,
                                              cfg.train.threads);
  if (device == Device::automatic)
    std::fprintf(stderr, "[node %lld] device = \"auto\": training on the CPU (no usable GPU: %s)\n", node, why.c_str());
  return backend;
}

}  // namespace spes
