// The training-backend seam (README, Architecture: "Local training"). The trainer
// keeps the loop — LR schedule, gradient accumulation, clipping policy, NaN stop,
// metrics CSV, checkpoint and sync cadence — and asks a backend for the math of one
// node: forward+backward of a micro-batch, the gradient norm, AdamW over the owned
// segments, evaluation, and θ on the host for sync rounds and checkpoints.
//
// CpuBackend (engine/cpu_backend) runs the plain fp32 CPU model, the oracle;
// GpuBackend runs its CUDA twin. Nothing here names either: the trainer compiles
// against this header alone.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/layout.hpp"
#include "model/loss.hpp"

namespace spes {

struct Config;

// One AdamW update over every owned tensor (PyTorch AdamW).
struct AdamWStep {
  double lr = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
  bool decay_norms_and_embeddings = true;  // false: norms and embeddings get no decay
  int64_t t = 1;                           // 1-based, for the bias corrections
  float grad_scale = 1.0f;                 // the clipping factor the trainer chose (1 = none)
};

// The device's dense bf16 peak in FLOP/s, MFU's denominator (0 = none: the CPU), and
// where the number comes from (a datasheet, or a GEMM measured at start-up).
struct PeakFlops {
  double flops = 0;
  std::string source;
};

// What the trainer calls.
class TrainBackend {
 public:
  virtual ~TrainBackend() = default;

  // "cpu (2 threads)", "cuda: NVIDIA H100 80GB HBM3": said on stderr at start-up.
  virtual std::string describe() const = 0;
  virtual PeakFlops peak_flops() const { return {}; }
  // Bytes of gradients + optimizer state: proportional to the owned parameters.
  virtual int64_t optimizer_state_bytes() const = 0;

  // ---- one optimizer step -------------------------------------------------------
  virtual void zero_grads() = 0;
  // Forward, then backward of grad_scale · total loss on one micro-batch of
  // [train.micro_batch, seq_len] tokens; owned gradients accumulate (+=).
  virtual LossParts forward_backward(const int32_t* inputs, const int32_t* targets, float aux_factor,
                                     float grad_scale) = 0;
  // Σ g² over every owned gradient, deterministic (the same value on every run).
  virtual double grad_sum_squares() = 0;
  // AdamW over the owned segments with the gradients scaled by s.grad_scale.
  virtual void optimizer_step(const AdamWStep& s) = 0;

  // ---- evaluation ------------------------------------------------------------------
  // Forward only on `rows` ≤ micro_batch sequences: the loss parts (no gradients).
  virtual LossParts forward(const int32_t* inputs, const int32_t* targets, int64_t rows) = 0;

  // ---- θ on the host ------------------------------------------------------------
  // The whole flat θ in fp32 on the host (what sync rounds and checkpoints read and
  // write). pull_theta() makes it current (a GPU copies its owned master weights
  // back); after changing it, push_theta() makes the backend train on it.
  virtual std::span<float> host_theta() = 0;
  virtual void pull_theta() = 0;
  virtual void push_theta() = 0;

  // AdamW moments, packed in owned space (model/owned_space.hpp).
  virtual void read_moments(std::span<float> m, std::span<float> v) = 0;
  virtual void write_moments(std::span<const float> m, std::span<const float> v) = 0;
};

// One rank of a data-parallel node (engine/data_parallel): a backend whose owned
// gradients and trained θ its node's Communicator reaches, where the backend keeps
// them (host memory on the CPU, device memory on a GPU). Called from the thread that
// runs this rank.
class RankBackend : public TrainBackend {
 public:
  virtual std::span<float> grad_buffer() = 0;
  virtual std::vector<std::span<std::byte>> theta_buffers() = 0;
};

// The backend [train] device asks for: "cpu", "cuda", or "auto" (the GPU when one
// works, else the CPU, saying which on stderr). Throws ConfigError when "cuda" is
// asked for and there is none, naming the reason.
std::unique_ptr<TrainBackend> make_backend(const Config& cfg, const ParamLayout& layout, const Ownership& own);

}  // namespace spes
