// The CPU backend: the plain fp32 CPU model (model/cpu) behind the training seam.
// θ lives on the host and is the master copy; gradients and AdamW moments exist
// for the owned segments only (frozen experts have none).
#pragma once
#include <memory>
#include <vector>

#include "engine/backend.hpp"
#include "model/cpu/cpu_model.hpp"

namespace spes {

class CpuBackend final : public RankBackend {
 public:
  // threads: OpenMP threads (0 = every core).
  CpuBackend(const ModelConfig& model, const LossConfig& loss, const ParamLayout& layout, const Ownership& own,
             int64_t micro_batch, int64_t threads);

  std::string describe() const override;
  void zero_grads() override;
  LossParts forward_backward(const int32_t* inputs, const int32_t* targets, float aux_factor,
                             float grad_scale) override;
  double grad_sum_squares() override;
  void optimizer_step(const AdamWStep& s) override;
  LossParts forward(const int32_t* inputs, const int32_t* targets, int64_t rows) override;
  std::span<float> host_theta() override { return params_; }
  void pull_theta() override {}  // θ is trained in place
  void push_theta() override {}
  void read_moments(std::span<float> m, std::span<float> v) override;
  void write_moments(std::span<const float> m, std::span<const float> v) override;
  int64_t optimizer_state_bytes() const override;
  // Data-parallel rank (CPU ranks in one process: the tests of data parallelism).
  std::span<float> grad_buffer() override { return grads_; }
  std::vector<std::span<std::byte>> theta_buffers() override { return {std::as_writable_bytes(std::span(params_))}; }

 private:
  ModelConfig model_cfg_;
  LossConfig loss_;
  ParamLayout layout_;
  Ownership own_;
  int64_t micro_batch_;
  int threads_;
  std::vector<AdamWRun> runs_, runs_by_class_;  // every tensor decays / norms and embeddings apart
  std::vector<float> params_;         // full flat θ: on the CPU these are the master weights
  std::vector<float> grads_, m_, v_;  // owned space
  std::unique_ptr<CpuModel> model_;
  std::unique_ptr<CpuModel> tail_model_;  // evaluation's last, smaller batch
};

}  // namespace spes
