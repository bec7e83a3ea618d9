// The GPU's shape limits (model/gpu/gpu_plan.cu, check_gpu_shape): the options of
// imported Qwen3 / OLMo-2 models that only the CPU model computes so far are refused in
// one line naming the [model] key, and the shape they leave alone is accepted.
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

TEST_CASE("gpu shape: per-head QK-norm, a head_dim apart from d_model / n_heads and post-norm are refused in one line") {
  CHECK(refusal(gpu_shape()).empty());
  ModelConfig m = gpu_shape();
  m.head_dim_key = 64;  // the same as d_model / n_heads: allowed
  CHECK(refusal(m).empty());
  m.qk_norm_per_head = true;
  CHECK(refusal(m).find("x.toml: [model] qk_norm_per_head = true") == 0);
  m = gpu_shape();
  m.head_dim_key = 128;
  CHECK(refusal(m).find("x.toml: [model] head_dim = 128") == 0);
  m = gpu_shape();
  m.post_norm = true;
  CHECK(refusal(m).find("x.toml: [model] post_norm = true") == 0);
  CHECK(refusal(m).find('\n') == std::string::npos);
}
