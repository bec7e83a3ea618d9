// One node's training loop (README, Architecture: "Local training"): micro-batches with
// gradient accumulation, global-norm clipping, AdamW over owned parameters only,
// CSV metrics on stdout, checkpoints, validation and the sync hook. The math runs
// in a TrainBackend (engine/backend.hpp); the loop is the same on every device.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "data/sampler.hpp"
#include "engine/backend.hpp"
#include "engine/checkpoint.hpp"
#include "engine/config.hpp"
#include "engine/sync_hook.hpp"
#include "model/layout.hpp"

namespace spes {

struct CheckpointState;

struct EvalResult {
  double ce = 0;
  int64_t tokens = 0;
};

// Where this node's checkpoints go: [checkpoint] dir, or its node-N folder when
// n_nodes > 1 (nodes of one run may share a machine and a config).
std::string node_checkpoint_root(const Config& c);
// A new run (no --resume) over a node checkpoint folder that holds a checkpoint
// already: a later --resume would take the earlier run's newest, and pruning would
// drop the new run's. Throws a ConfigError naming the folder and `resume_command`.
void refuse_earlier_checkpoint(const Config& c, const std::string& resume_command);

class Trainer {
 public:
  // backend: null = the one [train] device asks for (make_backend). θ starts as
  // initial_theta (the seeded init, or [train] init's checkpoint), the same on every
  // node and the coordinator.
  explicit Trainer(const Config& config, std::unique_ptr<TrainBackend> backend = nullptr);
  ~Trainer();

  // Trains to train.steps (or max_steps_this_run more steps), writing the CSV
  // header and one row per step to `csv`. resume: continue from the newest
  // checkpoint in checkpoint.dir (a fresh start when there is none).
  void run(std::ostream& csv, bool resume);
  void set_sync_hook(std::unique_ptr<SyncHook> hook);
  // Ends run() early with a checkpoint once a signal's number lands in *signal_number
  // (a handler's store), checked before each step. Without sync rounds: after the
  // step under way. With them a node alone cannot know where the others would stop
  // (it would wait in a round for nodes that already stopped), so it asks the run to
  // stop in its next push, and every node of the run stops at the round whose result
  // says the run ends there (net/README.md, Stopping a run).
  void stop_on_signal(const std::atomic<int>* signal_number) { signal_ = signal_number; }
  // run() ended at a round that another node or the coordinator asked to end the run.
  bool stopped_by_run() const { return stopped_by_run_; }
  // Parameters and step from a checkpoint (eval, export); refuses another model.
  void load_params(const CheckpointState& s, const std::string& source);

  EvalResult evaluate(int64_t max_batches);  // mean CE on the validation data
  // The CSV's header line, and its columns as a markdown table (engine/README.md,
  // "CSV columns"; printed by `spes-engine reference csv`).
  static std::string csv_header();
  static std::string csv_reference_markdown();

  const Config& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  const Ownership& ownership() const { return own_; }
  // θ now (fp32, the whole layout) as a view of the backend's host copy ...
  std::span<const float> theta();
  // ... or as a copy; set_params replaces it (tools and tests).
  std::vector<float> params();
  void set_params(const std::vector<float>& params);
  int64_t step() const { return step_; }
  TrainBackend& backend() { return *backend_; }
  // Bytes of gradient + optimizer state: proportional to owned parameters only.
  int64_t optimizer_state_bytes() const { return backend_->optimizer_state_bytes(); }

 private:
  struct StepStats {
    double loss, tokens_per_s;
    std::string val_ce;  // empty when the step did not evaluate
  };
  StepStats train_step(std::ostream& csv);
  std::string node_prefix() const;
  SyncStats sync_if_due();
  void stop_after_bad_round(const std::string& what);
  SyncStats settle_round();  // applies an overlapped round in flight (overlap_steps after its push, before a checkpoint, at the end)
  bool saves_after_step() const;
  void save(bool final);
  void restore_latest();
  std::string checkpoint_root() const;

  Config cfg_;
  ParamLayout layout_;
  Ownership own_;
  uint64_t fingerprint_;
  std::unique_ptr<TrainBackend> backend_;
  std::unique_ptr<DataPipeline> data_;
  std::unique_ptr<SyncHook> sync_;
  std::vector<int32_t> inputs_, targets_;
  int64_t step_ = 0;
  int64_t stop_ = 0;  // the step this run() ends at (the last, or --max-steps-this-run's)
  const std::atomic<int>* signal_ = nullptr;  // stop_on_signal's
  bool stopping_ = false;                     // stop_ was moved to end the run early
  bool ask_stop_ = false;                     // a signal came: every push asks the run to stop
  bool stopped_by_run_ = false;
  bool signalled() const { return signal_ != nullptr && *signal_ != 0; }
  bool stop_requested();
  void stop_if_round_ends_run(const SyncStats& s);
  int64_t tokens_seen_ = 0;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();  // the CSV's elapsed_s
  std::string last_checkpoint_;
  net::TrainFigures figures_;  // reported with the next push: the last step, eval and sync round
  // A bad round never costs the run (net/README.md, A bad round): the node's state
  // just before the last round was applied, kept until the first step after it is
  // finite; a checkpoint of it when that step is not.
  CheckpointState pre_round_;
  int64_t check_round_ = 0;  // the round whose first step is next (0: none)
  bool owes_round_ = false;  // resumed from a checkpoint taken before its step's round
};

}  // namespace spes
