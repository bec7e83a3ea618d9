// One node's training loop (DESIGN §1 "Local training"): micro-batches with
// gradient accumulation, global-norm clipping, AdamW over owned parameters only,
// CSV metrics on stdout, checkpoints, validation, and the sync hook.
#pragma once
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "data/sampler.hpp"
#include "engine/config.hpp"
#include "model/layout.hpp"
#include "model/cpu/cpu_model.hpp"

namespace spes {

struct CheckpointState;

// Per-step sync columns (zero on steps without a round).
struct SyncStats {
  int64_t round = 0;
  double ms = 0;
  int64_t bytes_up = 0, bytes_down = 0;
  uint64_t state_hash = 0;  // hash of θ after the round: equal on every node and the coordinator
};

// What the trainer needs from the sync protocol (net/): called every sync_steps
// steps with the node's full parameter buffer, which it replaces by the round's
// global θ. Its state travels in checkpoints.
class SyncHook {
 public:
  virtual ~SyncHook() = default;
  virtual SyncStats sync_round(float* params, int64_t step) = 0;
  virtual void save_state(CheckpointState& s) const = 0;
  virtual void load_state(const CheckpointState& s, float* params) = 0;
};

struct EvalResult {
  double ce = 0;
  int64_t tokens = 0;
};

class Trainer {
 public:
  explicit Trainer(const Config& config);
  ~Trainer();

  // Trains to train.steps (or max_steps_this_run more steps), writing the CSV
  // header and one row per step to `csv`. resume: continue from the newest
  // checkpoint in checkpoint.dir (a fresh start when there is none).
  void run(std::ostream& csv, bool resume);
  void set_sync_hook(std::unique_ptr<SyncHook> hook);
  // Parameters and step from a checkpoint (eval, export); refuses another model.
  void load_params(const CheckpointState& s, const std::string& source);

  EvalResult evaluate(int64_t max_batches);  // mean CE on the validation data
  static const char* csv_header();

  const Config& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  const Ownership& ownership() const { return own_; }
  const std::vector<float>& params() const { return params_; }
  std::vector<float>& mutable_params() { return params_; }  // tools and tests
  int64_t step() const { return step_; }
  // Bytes of gradient + optimizer state: proportional to owned parameters only.
  int64_t optimizer_state_bytes() const;

 private:
  void train_step(std::ostream& csv);
  void save(bool final);
  void restore_latest();

  Config cfg_;
  ParamLayout layout_;
  Ownership own_;
  uint64_t fingerprint_;
  std::vector<float> params_;            // full flat θ (fp32: on CPU these are the master weights)
  std::vector<float> grads_, m_, v_;     // owned space
  std::unique_ptr<DataPipeline> data_;
  std::unique_ptr<CpuModel> model_;
  std::unique_ptr<SyncHook> sync_;
  std::vector<int32_t> inputs_, targets_;
  int64_t step_ = 0;
  int64_t tokens_seen_ = 0;
  std::string last_checkpoint_;
};

// `spes-engine train CONFIG [--set k=v]... [--node-id N] [--resume]`
int train_main(int argc, char** argv);
// `spes-engine eval CONFIG --checkpoint DIR [--data MANIFEST] [--set k=v]...`
int eval_main(int argc, char** argv);

}  // namespace spes
