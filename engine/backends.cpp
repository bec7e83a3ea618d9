// make_backend: [train] device → the backend that runs the node's math.
#include <cstdio>

#include "engine/backend.hpp"
#include "engine/base/error.hpp"
#include "engine/config.hpp"
#include "engine/cpu_backend.hpp"

namespace spes {

std::unique_ptr<TrainBackend> make_backend(const Config& cfg, const ParamLayout& layout, const Ownership& own) {
  const std::string& device = cfg.train.device;
  if (device == "cuda")
    throw ConfigError(cfg.path + ": [train] device = \"cuda\": the CUDA training step is not built yet; use \"cpu\"");
  auto backend = std::make_unique<CpuBackend>(cfg.model, cfg.train.loss, layout, own, cfg.train.micro_batch,
                                              cfg.train.threads);
  if (device == "auto")
    std::fprintf(stderr, "[node %lld] device = \"auto\": training on the CPU\n", (long long)cfg.spes.node_id);
  return backend;
}

}  // namespace spes
