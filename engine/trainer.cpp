#include "engine/trainer.hpp"

#include <cblas.h>
#include <omp.h>

#include <boost/program_options.hpp>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <cstdio>
#include <iostream>

#include "engine/args.hpp"
#include "engine/checkpoint.hpp"
#include "engine/base/error.hpp"
#include "engine/net_sync.hpp"
#include "model/cpu/ops.hpp"
#include "engine/schedule.hpp"

namespace spes {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void set_threads(int64_t threads) {
  const int n = threads > 0 ? int(threads) : omp_get_num_procs();
  omp_set_num_threads(n);
}

// Nodes of one run may share a machine and a config: each keeps its checkpoints in
// its own node-N folder.
std::string checkpoint_root(const Config& c) {
  if (c.spes.n_nodes == 1) return c.checkpoint.dir;
  return (std::filesystem::path(c.checkpoint.dir) / ("node-" + std::to_string(c.spes.node_id))).string();
}

std::string latest_or_none(const std::string& root) {
  const std::string dir = latest_checkpoint(root);
  return dir.empty() ? "none" : dir;
}

DataSpec data_spec(const Config& c) {
  DataSpec s;
  s.train_manifest = c.data.train;
  s.validation_manifest = c.data.validation;
  s.val_fraction = c.data.val_fraction;
  s.dtype = c.data.token_dtype == "uint32" ? TokenDtype::kUint32 : TokenDtype::kUint16;
  s.seq_len = c.model.seq_len;
  s.vocab_size = c.model.vocab_size;
  s.base_seed = c.train.seed;
  s.node_id = c.spes.node_id;
  return s;
}

}  // namespace

Trainer::Trainer(const Config& config)
    : cfg_(config),
      layout_(make_layout(config.model)),
      own_(make_ownership(config.model, layout_, int(config.spes.node_id), int(config.spes.n_nodes),
                          config.spes.ownership, config.spes.experts_per_node)),
      fingerprint_(model_fingerprint(config.model, layout_, own_)) {
  set_threads(cfg_.train.threads);
  // Every node (and the coordinator) initialises θ from the run seed alone, so they
  // all start from the same parameters; only the data order is node-specific.
  params_.resize(layout_.total);
  init_parameters(params_.data(), cfg_.model, layout_, cfg_.train.seed);
  grads_.assign(own_.space.size(), 0.0f);
  m_.assign(own_.space.size(), 0.0f);
  v_.assign(own_.space.size(), 0.0f);
  data_ = std::make_unique<DataPipeline>(open_data(data_spec(cfg_)));
  model_ = std::make_unique<CpuModel>(cfg_.model, layout_, own_, cfg_.train.micro_batch, cfg_.model.seq_len);
  inputs_.resize(cfg_.train.micro_batch * cfg_.model.seq_len);
  targets_.resize(inputs_.size());
}

Trainer::~Trainer() = default;

void Trainer::load_params(const CheckpointState& s, const std::string& source) {
  if (s.fingerprint != fingerprint_ || int64_t(s.params.size()) != layout_.total)
    throw CheckpointError(source + ": checkpoint was written for another model or ownership than " + cfg_.path +
                          " (fingerprint " + std::to_string(s.fingerprint) + " vs " + std::to_string(fingerprint_) +
                          ", " + std::to_string(s.params.size()) + " vs " + std::to_string(layout_.total) +
                          " parameters)");
  params_ = s.params;
  step_ = s.step;
}

void Trainer::set_sync_hook(std::unique_ptr<SyncHook> hook) { sync_ = std::move(hook); }

int64_t Trainer::optimizer_state_bytes() const {
  return int64_t(sizeof(float)) * int64_t(grads_.size() + m_.size() + v_.size());
}

const char* Trainer::csv_header() {
  return "step,tokens,loss,ce,lb,router_z,lm_z,lr,grad_norm,step_ms,tokens_per_s,expert_load_cv,"
         "val_ce,sync_round,sync_ms,bytes_up,bytes_down,state_hash";
}

EvalResult Trainer::evaluate(int64_t max_batches) {
  EvalResult r;
  if (!data_->validation) return r;
  ValidationIterator& it = *data_->validation;
  it.reset();
  const int64_t T = cfg_.model.seq_len;
  std::unique_ptr<CpuModel> tail_model;  // for a last, smaller batch
  double ce_sum = 0;
  for (int64_t b = 0; max_batches == 0 || b < max_batches; ++b) {
    const int64_t rows = it.next_batch(inputs_.data(), targets_.data(), cfg_.train.micro_batch);
    if (rows == 0) break;
    CpuModel* m = model_.get();
    if (rows < cfg_.train.micro_batch) {
      tail_model = std::make_unique<CpuModel>(cfg_.model, layout_, own_, rows, T);
      m = tail_model.get();
    }
    const LossParts p = m->forward(params_.data(), inputs_.data(), targets_.data(), cfg_.train.loss);
    ce_sum += p.ce * double(rows * T);
    r.tokens += rows * T;
  }
  r.ce = r.tokens ? ce_sum / double(r.tokens) : NAN;
  return r;
}

void Trainer::train_step(std::ostream& csv) {
  const auto t0 = Clock::now();
  const int64_t n_micro = cfg_.train.global_batch / cfg_.train.micro_batch;
  const float aux = aux_loss_factor(cfg_.train.loss, step_, cfg_.train.steps);
  const float grad_scale = 1.0f / float(n_micro);
  std::fill(grads_.begin(), grads_.end(), 0.0f);

  LossParts sum;
  sum.expert_counts.assign(cfg_.model.n_layers * cfg_.model.n_experts, 0);
  for (int64_t i = 0; i < n_micro; ++i) {
    data_->train.next_batch(inputs_.data(), targets_.data(), cfg_.train.micro_batch);
    LossParts p = model_->forward_backward(params_.data(), grads_.data(), inputs_.data(), targets_.data(),
                                           cfg_.train.loss, aux, grad_scale);
    sum.ce += p.ce / double(n_micro);
    sum.lb += p.lb / double(n_micro);
    sum.router_z += p.router_z / double(n_micro);
    sum.lm_z += p.lm_z / double(n_micro);
    for (size_t k = 0; k < sum.expert_counts.size(); ++k) sum.expert_counts[k] += p.expert_counts[k];
  }
  const double loss = sum.total(cfg_.train.loss);
  const double grad_norm = std::sqrt(cpu::sum_squares(grads_.data(), int64_t(grads_.size())));
  if (!std::isfinite(loss) || !std::isfinite(grad_norm))
    throw Error("step " + std::to_string(step_) + ": " + (std::isfinite(loss) ? "gradient norm" : "loss") +
                " is " + (std::isnan(std::isfinite(loss) ? grad_norm : loss) ? "NaN" : "infinite") +
                "; stopping before the update. Last good checkpoint: " +
                (last_checkpoint_.empty() ? latest_or_none(checkpoint_root(cfg_)) : last_checkpoint_) +
                " (lower [optim] lr or set [optim] grad_clip, then --resume)");

  if (cfg_.optim.grad_clip > 0 && grad_norm > cfg_.optim.grad_clip)
    cpu::scale_inplace(grads_.data(), int64_t(grads_.size()), float(cfg_.optim.grad_clip / (grad_norm + 1e-6)));
  const double lr = lr_at(cfg_.optim, step_);
  for (const ParamTensor& t : layout_.tensors) {
    const int64_t g = own_.space.packed_index(t.offset);
    if (g < 0) continue;  // frozen expert: no state, no update
    const bool no_decay = !cfg_.optim.decay_norms_and_embeddings &&
                          (t.kind == ParamKind::norm || t.kind == ParamKind::embedding);
    cpu::adamw_update(params_.data() + t.offset, grads_.data() + g, m_.data() + g, v_.data() + g, t.numel(),
                      float(lr), float(cfg_.optim.beta1), float(cfg_.optim.beta2), float(cfg_.optim.eps),
                      no_decay ? 0.0f : float(cfg_.optim.weight_decay), step_ + 1);
  }
  ++step_;
  const int64_t step_tokens = cfg_.train.global_batch * cfg_.model.seq_len;
  tokens_seen_ += step_tokens;

  SyncStats sync;
  if (sync_ && cfg_.spes.sync_steps > 0 && step_ % cfg_.spes.sync_steps == 0)
    sync = sync_->sync_round(params_.data(), step_);

  std::string val;
  const bool last = step_ == cfg_.train.steps;
  if (data_->validation && ((cfg_.train.eval_every > 0 && step_ % cfg_.train.eval_every == 0) || last)) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6f", evaluate(cfg_.train.eval_batches).ce);
    val = buf;
  }
  const double step_ms = ms_since(t0);
  char hash[20] = "";
  if (sync.round > 0) std::snprintf(hash, sizeof hash, "%016llx", (unsigned long long)sync.state_hash);
  char row[512];
  std::snprintf(row, sizeof row, "%lld,%lld,%.6f,%.6f,%.6f,%.6f,%.6f,%.6e,%.6f,%.1f,%.1f,%.4f,%s,%lld,%.1f,%lld,%lld,%s",
                (long long)step_, (long long)tokens_seen_, loss, sum.ce, sum.lb, sum.router_z, sum.lm_z, lr,
                grad_norm, step_ms, double(step_tokens) / (step_ms / 1000.0),
                expert_load_cv(sum.expert_counts, cfg_.model.n_layers, cfg_.model.n_experts), val.c_str(),
                (long long)sync.round, sync.ms, (long long)sync.bytes_up, (long long)sync.bytes_down, hash);
  csv << row << std::endl;  // flushed: a reader following stdout sees every step
}

void Trainer::save(bool final) {
  CheckpointState s;
  s.config_toml = config_to_toml(cfg_);
  s.fingerprint = fingerprint_;
  s.node_id = cfg_.spes.node_id;
  s.step = step_;
  s.params = params_;
  s.adam_m = m_;
  s.adam_v = v_;
  s.data_state = data_->train.state();
  s.rng_state = {uint64_t(tokens_seen_)};
  if (sync_) sync_->save_state(s);
  last_checkpoint_ = save_checkpoint(checkpoint_root(cfg_), s, cfg_.checkpoint.keep);
  std::fprintf(stderr, "[node %lld] %scheckpoint %s\n", (long long)cfg_.spes.node_id, final ? "final " : "",
               last_checkpoint_.c_str());
}

void Trainer::restore_latest() {
  const std::string dir = latest_checkpoint(checkpoint_root(cfg_));
  if (dir.empty()) {
    std::fprintf(stderr, "[node %lld] --resume: no checkpoint in %s, starting fresh\n",
                 (long long)cfg_.spes.node_id, checkpoint_root(cfg_).c_str());
    return;
  }
  CheckpointState s = load_checkpoint(dir);
  load_params(s, dir);
  if (s.node_id != cfg_.spes.node_id)
    throw CheckpointError(dir + ": checkpoint belongs to node " + std::to_string(s.node_id) + ", not node " +
                          std::to_string(cfg_.spes.node_id));
  if (int64_t(s.adam_m.size()) != own_.space.size() || int64_t(s.adam_v.size()) != own_.space.size())
    throw CheckpointError(dir + ": optimizer-state sizes do not match the config");
  m_ = std::move(s.adam_m);
  v_ = std::move(s.adam_v);
  data_->train.restore(s.data_state);
  tokens_seen_ = s.rng_state.empty() ? step_ * cfg_.train.global_batch * cfg_.model.seq_len : int64_t(s.rng_state[0]);
  if (sync_) sync_->load_state(s, params_.data());
  last_checkpoint_ = dir;
  std::fprintf(stderr, "[node %lld] resumed from %s at step %lld\n", (long long)cfg_.spes.node_id, dir.c_str(),
               (long long)step_);
}

void Trainer::run(std::ostream& csv, bool resume) {
  if (resume) restore_latest();
  std::fprintf(stderr,
               "[node %lld] %lld parameters (%lld shared, %lld per expert), owned %lld; optimizer state %.1f MiB\n",
               (long long)cfg_.spes.node_id, (long long)layout_.total, (long long)layout_.shared_count,
               (long long)layout_.expert_block, (long long)own_.space.size(), optimizer_state_bytes() / 1048576.0);
  csv << csv_header() << std::endl;
  const int64_t stop = cfg_.train.max_steps_this_run > 0
                           ? std::min(cfg_.train.steps, step_ + cfg_.train.max_steps_this_run)
                           : cfg_.train.steps;
  const auto t0 = Clock::now();
  auto last_progress = t0;
  const int64_t start = step_;
  while (step_ < stop) {
    train_step(csv);
    if (cfg_.checkpoint.every > 0 && step_ % cfg_.checkpoint.every == 0 && step_ < stop) save(false);
    if (std::chrono::duration<double>(Clock::now() - last_progress).count() > 10 || step_ == stop) {
      last_progress = Clock::now();
      const double s = std::chrono::duration<double>(last_progress - t0).count();
      const double per_step = s / double(step_ - start);
      std::fprintf(stderr, "[node %lld] step %lld/%lld  %.1fs elapsed  ETA %.0fs\n", (long long)cfg_.spes.node_id,
                   (long long)step_, (long long)cfg_.train.steps, s, per_step * double(stop - step_));
    }
  }
  save(true);
}

namespace po = boost::program_options;

namespace {

struct CommonArgs {
  std::string config;
  std::vector<std::string> sets;
  int64_t node_id = -1;
};

po::options_description common_options(CommonArgs& a) {
  po::options_description d;
  d.add_options()("set", po::value(&a.sets)->composing(), "override a config key: section.key=value")(
      "node-id", po::value(&a.node_id), "this node's id (same as --set spes.node_id=N)");
  return d;
}

Config load_with_overrides(CommonArgs& a) {
  if (a.node_id >= 0) a.sets.push_back("spes.node_id=" + std::to_string(a.node_id));
  return load_config(a.config, a.sets);
}

}  // namespace

int train_main(int argc, char** argv) {
  CommonArgs a;
  bool resume = false;
  po::options_description opts = common_options(a);
  opts.add_options()("config", po::value(&a.config)->required(), "TOML config")(
      "resume", po::bool_switch(&resume), "continue from the newest checkpoint");
  parse_args(argc, argv, opts, "spes-engine train CONFIG [--set section.key=value]... [--node-id N] [--resume]");
  Config c = load_with_overrides(a);
  if (c.train.device == "cuda")
    throw ConfigError(c.path + ": [train] device = \"cuda\": the CUDA training step is not built yet; use \"cpu\"");
  Trainer t(c);
  // Before run(): the trainer's params are still the seeded init θ the sync base starts from.
  if (c.spes.sync_steps > 0) t.set_sync_hook(make_net_sync_hook(c, t.layout(), t.ownership(), t.params().data()));
  t.run(std::cout, resume);
  return 0;
}

int eval_main(int argc, char** argv) {
  CommonArgs a;
  std::string checkpoint, data;
  int64_t batches = 0;
  po::options_description opts = common_options(a);
  opts.add_options()("config", po::value(&a.config)->required(), "TOML config")(
      "checkpoint", po::value(&checkpoint)->required(), "checkpoint folder (or a root of step folders)")(
      "data", po::value(&data), "validation manifest (default: the config's validation data)")(
      "batches", po::value(&batches), "micro-batches to evaluate (0 = all)");
  parse_args(argc, argv, opts, "spes-engine eval CONFIG --checkpoint DIR [--data MANIFEST] [--batches N]");
  Config c = load_with_overrides(a);
  if (!data.empty()) {
    c.data.validation = data;
    c.data.val_fraction = 0.0;
  }
  CheckpointState s = load_checkpoint(checkpoint);
  Trainer t(c);
  t.load_params(s, checkpoint);
  const EvalResult r = t.evaluate(batches);
  if (r.tokens == 0) throw DataError(c.path + ": no validation data ([data] validation or val_fraction)");
  std::printf("checkpoint,step,tokens,ce,perplexity\n%s,%lld,%lld,%.6f,%.4f\n", checkpoint.c_str(), (long long)s.step,
              (long long)r.tokens, r.ce, std::exp(r.ce));
  return 0;
}

}  // namespace spes
