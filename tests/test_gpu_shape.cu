// The GPU's shape limits (model/gpu/gpu_plan.cu, check_gpu_shape): the imported
// Qwen3 / OLMo-2 options (per-head QK-norm, a head_dim apart from d_model / n_heads,
// post-norm) are accepted; what the kernels cannot run is refused in one line naming
// the [model] key. (The memory plan's q width: test_backend.cpp.)
#include <doctest/doctest.h>

#include <string>

#include "model/gpu/gpu_plan.hpp"

using namespace spes;

namespace {

// A shape the GPU runs: head_dim 64, widths multiples of 8, QK-norm over the projection.
ModelConfig gpu_shape() {
  ModelConfig m;
  m.d_model = 256;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.expert_hidden = 128;
  return m;
}

std::string refusal(const ModelConfig& m) {
  try {
    check_gpu_shape(m, "x.toml");
  } catch (const GpuShapeError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("gpu shape: per-head QK-norm, a head_dim apart from d_model / n_heads and post-norm run; other head dims are refused in one line") {
  CHECK(refusal(gpu_shape()).empty());
  ModelConfig m = gpu_shape();
  m.head_dim_key = 128;  // Qwen3-like: q width 512 > d_model 256
  m.qk_norm_per_head = true;
  CHECK(refusal(m).empty());
  m.post_norm = true;
  CHECK(refusal(m).empty());
  m.head_dim_key = 96;
  CHECK(refusal(m).find("x.toml: [model] head_dim = 96: the GPU attention kernels support head dims 32, 64 and 128") ==
        0);
  CHECK(refusal(m).find('\n') == std::string::npos);
  m = gpu_shape();
  m.n_heads = 2;  // d_model / n_heads = 128 with no head_dim key: fine; 5 heads of 51 are not
  CHECK(refusal(m).empty());
  m.d_model = 255;
  m.n_heads = 5;
  m.n_kv_heads = 5;
  CHECK(refusal(m).find("x.toml: [model] d_model / n_heads = 51") == 0);
  // The whole-projection QK-norm keeps a q row in registers: 80 heads of 128 are too wide for it, not per head.
  m = gpu_shape();
  m.n_heads = 80;
  m.n_kv_heads = 8;
  m.head_dim_key = 128;
  CHECK(refusal(m).find("x.toml: [model] d_model, the q width and the kv width must be at most 8192") == 0);
  m.qk_norm_per_head = true;
  CHECK(refusal(m).empty());
}
