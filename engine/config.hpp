// The run configuration: one TOML file with sections [model] [train] [optim]
// [data] [spes] [checkpoint]; every key is validated (type, range, unknown keys)
// and can be overridden with --set section.key=value. The keys themselves (names,
// allowed values, docs) are listed once, in engine/config_keys.hpp.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/token_file.hpp"
#include "engine/base/enum_names.hpp"
#include "model/layout.hpp"
#include "model/model_config.hpp"
#include "net/codec.hpp"
#include "net/outer_optimizer.hpp"

namespace spes {

// [train] device: automatic = the GPU when one works and the model's shape runs
// there, else the CPU.
enum class Device { automatic, cuda, cpu };
inline constexpr EnumName<Device> kDeviceNames[] = {
    {Device::automatic, "auto"}, {Device::cuda, "cuda"}, {Device::cpu, "cpu"}};

struct TrainConfig {
  Device device = Device::automatic;
  uint64_t seed = 1234;
  int64_t steps = 1000;         // optimizer steps of the whole run
  int64_t micro_batch = 8;      // sequences per forward/backward
  int64_t global_batch = 16;    // sequences per optimizer step (gradient accumulation)
  int64_t threads = 0;          // CPU threads; 0 = all cores
  std::vector<int64_t> gpus;    // device = cuda: the GPUs of this node (data parallel); empty = every visible GPU
  int64_t eval_every = 0;       // steps between validation evals; 0 = only at the end
  int64_t eval_batches = 8;     // micro-batches per eval
  int64_t max_steps_this_run = 0;  // stop after this many steps (then checkpoint); 0 = no limit
  std::string init;             // checkpoint whose params start a fresh run (engine/init_theta.hpp); "" = seeded init
  LossConfig loss;
};

struct OptimConfig {
  double lr = 5e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  bool decay_norms_and_embeddings = true;  // SPES decays every parameter
  int64_t warmup_steps = 2000;
  int64_t decay_steps = 50000;  // cosine ends here; the lr stays at the floor after
  double lr_floor = 0.1;        // alpha_f: the floor as a fraction of lr
  double grad_clip = 1.0;       // global-norm clip; 0 = off
};

struct DataConfig {
  std::string train;            // manifest: one token file per line
  std::string validation;       // manifest; empty = hold out val_fraction of train
  double val_fraction = 0.0;
  TokenDtype token_dtype = TokenDtype::kUint16;
  // The tokenizer the data was made with: "bytes", a tokenizer.json path, or "" (not
  // declared: nothing to check beyond each token id < [model] vocab_size).
  std::string tokenizer;
};

struct SpesConfig {
  int64_t node_id = 0;
  int64_t n_nodes = 1;
  OwnershipMode ownership = OwnershipMode::partitioned;
  int64_t experts_per_node = 0;           // 0 = n_experts / n_nodes
  int64_t sync_steps = 0;                 // 0 = no sync (plain local training)
  // --- sync protocol (net/) ---
  std::string run_id = "spes-run";
  std::string coordinator = "127.0.0.1:29500";  // host:port the nodes dial / it binds
  std::string status_bind = "127.0.0.1:0";  // the coordinator's status page (net/status_server); "" = off
  net::Codec codec = net::Codec::fp32;
  bool overlap = false;                   // overlapped rounds: train on while a round is in flight
  int64_t overlap_steps = 0;              // overlap: steps from a push to applying its round (0 = at the next round)
  std::string secret_file;                // shared secret for HMAC auth (or env SPES_SECRET)
  bool allow_insecure = false;            // no secret, no TLS and a non-loopback address
  // TLS 1.3 with node certificates (`spes-engine certs`); "" = off. tls_cert and
  // tls_key default to coordinator.{crt,key} / node-<id>.{crt,key} beside tls_ca.
  std::string tls_ca, tls_cert, tls_key;
  double round_timeout_s = 600.0;         // close a round with >= min_nodes after this
  int64_t min_nodes = 1;
  std::string state_dir = "coordinator";  // coordinator persistence folder
  // --- expert-merging warm-up (README, Architecture: "Sync round") ---
  double merge_alpha = 0.0;               // α0; 0 = off
  int64_t merge_topk = 4;
  int64_t merge_interval = 0;             // steps; merge at rounds whose step is a multiple
  int64_t merge_decay_steps = 0;          // α decays linearly to 0 over these steps
  // --- outer optimizer (net/outer_optimizer): steps θ by the round's merged delta ---
  net::OuterKind outer_optimizer = net::OuterKind::average;
  double outer_lr = 1.0;                  // default 1 for average, 0.7 for nesterov (DiLoCo)
  double outer_momentum = 0.0;            // nesterov only; default 0.9
  // --- the insider bound (net/update_bound): each pushed chunk's size against its history ---
  double update_bound = 16.0;             // κ; 0 = off
  int64_t update_bound_rounds = 16;       // R
  double update_bound_first = 1.0;        // the first rounds: × RMS of θ
  int64_t keep_rounds = 2;                // published rounds the coordinator keeps (--rollback-to)
};

struct CheckpointConfig {
  std::string dir = "checkpoints";
  int64_t every = 0;            // steps between checkpoints; 0 = only at the end
  int64_t keep = 3;             // newest checkpoints kept
};

struct Config {
  std::string path;             // the TOML file it came from
  ModelConfig model;
  TrainConfig train;
  OptimConfig optim;
  DataConfig data;
  SpesConfig spes;
  CheckpointConfig checkpoint;
};

// Parses and validates; throws ConfigError with one line naming file, key, line
// (where known) and what was expected. Relative paths in [data] and [checkpoint]
// are resolved against the config file's folder.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// Same checks on TOML text (tests, and configs embedded in checkpoints).
Config parse_config_text(const std::string& text, const std::string& name,
                         const std::vector<std::string>& overrides = {});
// TOML text that parses back to the same Config (stored inside checkpoints).
std::string config_to_toml(const Config& c);
// The markdown table of every key (engine/README.md, "Configuration"; printed by
// `spes-engine reference config`).
std::string config_reference_markdown();

// Opens [data] tokenizer (when set) and checks it against the model: [model]
// vocab_size must be at least the tokenizer's vocabulary (larger is padding) and
// [data] token_dtype must hold its ids. Throws ConfigError, one line naming the
// config file, the tokenizer and both numbers. Separate from load_config because it
// reads the tokenizer file; `train` and `local` call it before they start.
void check_tokenizer(const Config& c);

}  // namespace spes
