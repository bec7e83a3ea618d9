#include "engine/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <ostream>

#include "engine/base/csv.hpp"
#include "engine/base/error.hpp"
#include "engine/base/log.hpp"
#include "engine/base/progress.hpp"
#include "engine/checkpoint.hpp"
#include "engine/init_theta.hpp"
#include "engine/schedule.hpp"
#include "model/flops.hpp"

namespace spes {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
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
  s.dtype = c.data.token_dtype;
  s.seq_len = c.model.seq_len;
  s.vocab_size = c.model.vocab_size;
  s.base_seed = c.train.seed;
  s.node_id = c.spes.node_id;
  return s;
}

// One step as its CSV row shows it.
struct StepRecord {
  int64_t step = 0, tokens = 0;
  double loss = 0;
  LossParts parts;  // the step's mean over its micro-batches
  double lr = 0, grad_norm = 0, step_ms = 0, tokens_per_s = 0, elapsed_s = 0;
  std::optional<double> mfu;     // on a GPU only
  double expert_load_cv = 0;
  std::optional<double> val_ce;  // on eval steps only
  SyncStats sync;
};

std::string val_ce_field(const StepRecord& r) { return r.val_ce ? strprintf("%.6f", *r.val_ce) : ""; }

// The columns of the training CSV, in order (engine/README.md, "CSV columns").
const CsvColumn<StepRecord> kStepColumns[] = {
    {"step", [](const StepRecord& r) { return strprintf("%lld", (long long)r.step); }, "optimizer steps done"},
    {"tokens", [](const StepRecord& r) { return strprintf("%lld", (long long)r.tokens); },
     "training tokens consumed by this node so far"},
    {"loss", [](const StepRecord& r) { return strprintf("%.6f", r.loss); },
     "total loss = ce + lb_coef·lb + router_z_coef·router_z + lm_z_coef·lm_z"},
    {"ce", [](const StepRecord& r) { return strprintf("%.6f", r.parts.ce); }, "cross-entropy (nats/token)"},
    {"lb", [](const StepRecord& r) { return strprintf("%.6f", r.parts.lb); },
     "load-balancing loss (1 = perfectly balanced), mean over layers"},
    {"router_z", [](const StepRecord& r) { return strprintf("%.6f", r.parts.router_z); },
     "router z-loss, mean over layers"},
    {"lm_z", [](const StepRecord& r) { return strprintf("%.6f", r.parts.lm_z); }, "lm-head z-loss"},
    {"lr", [](const StepRecord& r) { return strprintf("%.6e", r.lr); }, "learning rate of this step"},
    {"grad_norm", [](const StepRecord& r) { return strprintf("%.6f", r.grad_norm); },
     "global gradient norm before clipping"},
    {"step_ms", [](const StepRecord& r) { return strprintf("%.1f", r.step_ms); },
     "wall time of the step (sync round and eval included)"},
    {"tokens_per_s", [](const StepRecord& r) { return strprintf("%.1f", r.tokens_per_s); },
     "this node's throughput: the step's tokens over `step_ms`"},
    {"mfu", [](const StepRecord& r) { return r.mfu ? strprintf("%.4f", *r.mfu) : ""; },
     "model FLOPs utilisation on a GPU: (6 × active parameters + 6·L·T·d attention) FLOPs per token "
     "(`model/flops`: only the top-k experts count) × tokens/s over the device's dense bf16 peak (datasheet for "
     "H100/H200/A100, else a GEMM measured at start-up, named in the log); empty on the CPU"},
    {"expert_load_cv", [](const StepRecord& r) { return strprintf("%.4f", r.expert_load_cv); },
     "coefficient of variation of tokens per expert, mean over layers (0 = balanced)"},
    {"val_ce", val_ce_field, "validation cross-entropy on eval steps, empty otherwise"},
    {"sync_round", [](const StepRecord& r) { return strprintf("%lld", (long long)r.sync.round); },
     "the sync round done after this step (0 when none); a step that applies two (`overlap` with "
     "`overlap_steps` 0, at a checkpoint or the run's end) names the later, and its bytes and wait are both "
     "rounds'"},
    {"sync_ms", [](const StepRecord& r) { return strprintf("%.1f", r.sync.ms); },
     "wall time of that round (0 when none)"},
    {"bytes_up", [](const StepRecord& r) { return strprintf("%lld", (long long)r.sync.bytes_up); },
     "bytes this node sent in that round (0 when none)"},
    {"bytes_down", [](const StepRecord& r) { return strprintf("%lld", (long long)r.sync.bytes_down); },
     "bytes this node received in that round (0 when none)"},
    {"sync_inflight_ms", [](const StepRecord& r) { return strprintf("%.1f", r.sync.inflight_ms); },
     "`overlap` only: how long the round applied at this step was in flight since its push (0 otherwise)"},
    {"sync_wait_ms", [](const StepRecord& r) { return strprintf("%.1f", r.sync.wait_ms); },
     "`overlap` only: how long the step loop waited for that round (0 otherwise); with the round still in "
     "flight at a checkpoint or the run's end, the whole wait for it"},
    {"state_hash",
     [](const StepRecord& r) {
       return r.sync.round > 0 ? strprintf("%016llx", (unsigned long long)r.sync.state_hash) : "";
     },
     "hash of θ after that round (hex; empty on steps without a round); identical on every node and the "
     "coordinator (with `overlap`: of the round's θ_global, applied at this step)"},
    {"elapsed_s", [](const StepRecord& r) { return strprintf("%.3f", r.elapsed_s); },
     "seconds since this node's trainer was created (start-up before it excluded; from 0 again on `--resume`) "
     "to the end of this step: eval rows against it give time to quality"},
};

// The loss parts of a step: the mean over its micro-batches; expert counts summed.
void accumulate(LossParts& sum, const LossParts& p, int64_t n_micro) {
  sum.ce += p.ce / double(n_micro);
  sum.lb += p.lb / double(n_micro);
  sum.router_z += p.router_z / double(n_micro);
  sum.lm_z += p.lm_z / double(n_micro);
  for (size_t k = 0; k < sum.expert_counts.size(); ++k) sum.expert_counts[k] += p.expert_counts[k];
}

// Two rounds applied at one step (overlapped, overlap_steps 0: the step finished one
// and pushed the next, which a checkpoint or the run's end then applies): the row
// names the later round; its bytes and the loop's wait are both rounds'.
void fold_later_round(SyncStats& row, const SyncStats& later) {
  if (later.round == 0) return;
  const SyncStats earlier = row;
  row = later;
  row.bytes_up += earlier.bytes_up;
  row.bytes_down += earlier.bytes_down;
  row.wait_ms += earlier.wait_ms;
}

}  // namespace

Trainer::Trainer(const Config& config, std::unique_ptr<TrainBackend> backend)
    : cfg_(config),
      layout_(make_layout(config.model)),
      own_(make_ownership(config.model, layout_, int(config.spes.node_id), int(config.spes.n_nodes),
                          config.spes.ownership, config.spes.experts_per_node)),
      fingerprint_(model_fingerprint(config.model, layout_, own_)),
      backend_(backend ? std::move(backend) : make_backend(config, layout_, own_)) {
  // Every node (and the coordinator) starts from the same θ — the run seed's init or
  // the [train] init checkpoint; only the data order is node-specific.
  initial_theta(cfg_, layout_, backend_->host_theta().data());
  backend_->push_theta();
  data_ = std::make_unique<DataPipeline>(open_data(data_spec(cfg_)));
  inputs_.resize(cfg_.train.micro_batch * cfg_.model.seq_len);
  targets_.resize(inputs_.size());
}

Trainer::~Trainer() = default;

std::span<const float> Trainer::theta() {
  backend_->pull_theta();
  return backend_->host_theta();
}

std::vector<float> Trainer::params() {
  const std::span<const float> t = theta();
  return {t.begin(), t.end()};
}

void Trainer::set_params(const std::vector<float>& params) {
  if (int64_t(params.size()) != layout_.total)
    throw Error("set_params: " + std::to_string(params.size()) + " values for " + std::to_string(layout_.total) +
                " parameters");
  std::copy(params.begin(), params.end(), backend_->host_theta().begin());
  backend_->push_theta();
}

void Trainer::load_params(const CheckpointState& s, const std::string& source) {
  if (s.fingerprint != fingerprint_ || int64_t(s.params.size()) != layout_.total)
    throw CheckpointError(source + ": checkpoint was written for another model or ownership than " + cfg_.path +
                          " (fingerprint " + std::to_string(s.fingerprint) + " vs " + std::to_string(fingerprint_) +
                          ", " + std::to_string(s.params.size()) + " vs " + std::to_string(layout_.total) +
                          " parameters)");
  set_params(s.params);
  step_ = s.step;
}

void Trainer::set_sync_hook(std::unique_ptr<SyncHook> hook) { sync_ = std::move(hook); }

std::string Trainer::csv_header() { return spes::csv_header(kStepColumns); }

std::string Trainer::csv_reference_markdown() { return spes::csv_reference_markdown(kStepColumns); }

std::string Trainer::node_prefix() const { return "[node " + std::to_string(cfg_.spes.node_id) + "]"; }

std::string node_checkpoint_root(const Config& c) {
  if (c.spes.n_nodes == 1) return c.checkpoint.dir;
  return (std::filesystem::path(c.checkpoint.dir) / ("node-" + std::to_string(c.spes.node_id))).string();
}

void refuse_earlier_checkpoint(const Config& c, const std::string& resume_command) {
  const std::string root = node_checkpoint_root(c), newest = latest_checkpoint(root);
  if (!newest.empty())
    throw ConfigError(root + " holds a checkpoint of an earlier run (" +
                     std::filesystem::path(newest).filename().string() + "): `" + resume_command +
                     " --resume` continues it; a new run needs another [checkpoint] dir, or that one removed");
}

std::string Trainer::checkpoint_root() const { return node_checkpoint_root(cfg_); }

EvalResult Trainer::evaluate(int64_t max_batches) {
  EvalResult r;
  if (!data_->validation) return r;
  ValidationIterator& it = *data_->validation;
  it.reset();
  const int64_t T = cfg_.model.seq_len;
  double ce_sum = 0;
  for (int64_t b = 0; max_batches == 0 || b < max_batches; ++b) {
    const int64_t rows = it.next_batch(inputs_.data(), targets_.data(), cfg_.train.micro_batch);
    if (rows == 0) break;
    const LossParts p = backend_->forward(inputs_.data(), targets_.data(), rows);
    ce_sum += p.ce * double(rows * T);
    r.tokens += rows * T;
  }
  r.ce = r.tokens ? ce_sum / double(r.tokens) : NAN;
  return r;
}

SyncStats Trainer::sync_if_due() {
  if (!sync_ || cfg_.spes.sync_steps <= 0) return {};
  const int64_t tau = cfg_.spes.overlap_steps;  // overlapped rounds: apply a round tau steps after its push
  if (tau > 0 && step_ % cfg_.spes.sync_steps == tau) return settle_round();
  if (step_ % cfg_.spes.sync_steps != 0) return {};
  backend_->pull_theta();
  // What a checkpoint would hold now: kept until the first step after this round.
  // Overlapped rounds apply a round while another is in flight, whose sync state is
  // not ours to read: they keep the plain non-finite error.
  const bool keep = !sync_->round_in_flight();
  if (keep) {
    const std::span<const float> th = backend_->host_theta();
    pre_round_.params.assign(th.begin(), th.end());
    pre_round_.step = step_;
    pre_round_.data_state = data_->train.state();
    pre_round_.rng_state = {uint64_t(tokens_seen_)};
    sync_->save_state(pre_round_);
  }
  const SyncStats s = sync_->sync_round(backend_->host_theta().data(), step_, figures_, ask_stop_);
  backend_->push_theta();
  stop_if_round_ends_run(s);
  figures_.sync_ms = s.ms;
  check_round_ = keep && s.round > pre_round_.sync_round ? s.round : 0;
  return s;
}

// The first step after round r is not finite, so θ of round r is bad (a poisoned
// push the bound let through, or a bound set too loose): the node keeps its state
// from before round r as a checkpoint (replacing one of round r at the same step),
// reports r to the coordinator and stops naming it, so the run can resume from the
// round before (`spes-engine coordinator --rollback-to`).
void Trainer::stop_after_bad_round(const std::string& what) {
  const int64_t r = check_round_;
  CheckpointState& s = pre_round_;
  s.config_toml = config_to_toml(cfg_);
  s.fingerprint = fingerprint_;
  s.node_id = cfg_.spes.node_id;
  s.adam_m.resize(size_t(own_.space.size()));
  s.adam_v.resize(size_t(own_.space.size()));
  backend_->read_moments(s.adam_m, s.adam_v);  // the step stopped before its update: as they were at the sync
  last_checkpoint_ = save_checkpoint(checkpoint_root(), s, cfg_.checkpoint.keep);
  const std::string why = "step " + std::to_string(step_) + ": " + what + " at the first step after sync round " +
                          std::to_string(r);
  sync_->report_bad_round(r, why);
  throw Error(why + ": round " + std::to_string(r) + " is bad (a hostile or broken push?). This node's state " +
              "from before it is checkpoint " + last_checkpoint_ + "; round " + std::to_string(r) +
              " was reported to the coordinator. Revoke the culprit, restart the coordinator with --rollback-to " +
              std::to_string(r - 1) + ", then resume the nodes (--resume)");
}

Trainer::StepStats Trainer::train_step(std::ostream& csv) {
  const auto t0 = Clock::now();
  const int64_t n_micro = cfg_.train.global_batch / cfg_.train.micro_batch;
  const float aux = aux_loss_factor(cfg_.train.loss, step_, cfg_.train.steps);
  const float grad_scale = 1.0f / float(n_micro);
  backend_->zero_grads();

  StepRecord rec;
  LossParts& sum = rec.parts;
  sum.expert_counts.assign(cfg_.model.n_layers * cfg_.model.n_experts, 0);
  for (int64_t i = 0; i < n_micro; ++i) {
    data_->train.next_batch(inputs_.data(), targets_.data(), cfg_.train.micro_batch);
    accumulate(sum, backend_->forward_backward(inputs_.data(), targets_.data(), aux, grad_scale), n_micro);
  }
  const double loss = sum.total(cfg_.train.loss);
  const double grad_norm = std::sqrt(backend_->grad_sum_squares());
  if ((!std::isfinite(loss) || !std::isfinite(grad_norm)) && check_round_ > 0)
    stop_after_bad_round(std::string(std::isfinite(loss) ? "gradient norm" : "loss") + " is " +
                         (std::isnan(std::isfinite(loss) ? grad_norm : loss) ? "NaN" : "infinite"));
  check_round_ = 0;
  if (!std::isfinite(loss) || !std::isfinite(grad_norm))
    throw Error("step " + std::to_string(step_) + ": " + (std::isfinite(loss) ? "gradient norm" : "loss") +
                " is " + (std::isnan(std::isfinite(loss) ? grad_norm : loss) ? "NaN" : "infinite") +
                "; stopping before the update. Last good checkpoint: " +
                (last_checkpoint_.empty() ? latest_or_none(checkpoint_root()) : last_checkpoint_) +
                " (lower [optim] lr or set [optim] grad_clip, then --resume)");

  AdamWStep s;
  s.lr = lr_at(cfg_.optim, step_);
  s.beta1 = cfg_.optim.beta1;
  s.beta2 = cfg_.optim.beta2;
  s.eps = cfg_.optim.eps;
  s.weight_decay = cfg_.optim.weight_decay;
  s.decay_norms_and_embeddings = cfg_.optim.decay_norms_and_embeddings;
  s.t = step_ + 1;
  if (cfg_.optim.grad_clip > 0 && grad_norm > cfg_.optim.grad_clip)
    s.grad_scale = float(cfg_.optim.grad_clip / (grad_norm + 1e-6));
  backend_->optimizer_step(s);
  ++step_;
  const int64_t step_tokens = cfg_.train.global_batch * cfg_.model.seq_len;
  tokens_seen_ += step_tokens;

  figures_.step = step_;
  figures_.loss = loss;
  figures_.tokens_per_s = double(step_tokens) / (ms_since(t0) / 1000.0);  // the compute, before the round
  rec.sync = sync_if_due();
  // Overlapped rounds: a checkpoint holds a whole round, and the run ends on its last
  // round's θ, so a round still in flight is applied here, where this row reports it
  // and the eval sees it.
  if (saves_after_step()) fold_later_round(rec.sync, settle_round());
  const bool last = step_ == cfg_.train.steps;
  if (data_->validation && ((cfg_.train.eval_every > 0 && step_ % cfg_.train.eval_every == 0) || last)) {
    rec.val_ce = evaluate(cfg_.train.eval_batches).ce;
    figures_.val_ce = *rec.val_ce;
    figures_.val_step = step_;
  }
  rec.step_ms = ms_since(t0);
  rec.elapsed_s = ms_since(started_) / 1000.0;
  rec.step = step_;
  rec.tokens = tokens_seen_;
  rec.loss = loss;
  rec.lr = s.lr;
  rec.grad_norm = grad_norm;
  rec.tokens_per_s = double(step_tokens) / (rec.step_ms / 1000.0);
  // MFU: active training FLOPs over the device's dense bf16 peak; none on the CPU.
  const double peak = backend_->peak_flops().flops;
  if (peak > 0) rec.mfu = train_flops_per_token(cfg_.model) * rec.tokens_per_s / peak;
  rec.expert_load_cv = expert_load_cv(sum.expert_counts, cfg_.model.n_layers, cfg_.model.n_experts);
  csv << csv_row(kStepColumns, rec) << std::endl;  // flushed: a reader following stdout sees every step
  if (!csv)
    throw Error("step " + std::to_string(step_) + ": the CSV row could not be written to stdout (file system full, "
                "or the reader gone); the newest checkpoint and --resume continue the run");
  return {loss, rec.tokens_per_s, val_ce_field(rec)};
}

bool Trainer::saves_after_step() const {
  return step_ == stop_ || (cfg_.checkpoint.every > 0 && step_ % cfg_.checkpoint.every == 0);
}

SyncStats Trainer::settle_round() {
  if (!sync_ || !sync_->round_in_flight()) return {};
  backend_->pull_theta();
  const SyncStats s = sync_->settle(backend_->host_theta().data());
  backend_->push_theta();
  stop_if_round_ends_run(s);
  return s;
}

void Trainer::save(bool final) {
  settle_round();  // overlapped rounds: a checkpoint holds a whole round
  CheckpointState s;
  s.config_toml = config_to_toml(cfg_);
  s.fingerprint = fingerprint_;
  s.node_id = cfg_.spes.node_id;
  s.step = step_;
  const std::span<const float> th = theta();
  s.params.assign(th.begin(), th.end());
  s.adam_m.resize(size_t(own_.space.size()));
  s.adam_v.resize(size_t(own_.space.size()));
  backend_->read_moments(s.adam_m, s.adam_v);
  s.data_state = data_->train.state();
  s.rng_state = {uint64_t(tokens_seen_)};
  if (sync_) sync_->save_state(s);
  last_checkpoint_ = save_checkpoint(checkpoint_root(), s, cfg_.checkpoint.keep);
  log_line(node_prefix().c_str(), "%scheckpoint %s", final ? "final " : "", last_checkpoint_.c_str());
}

void Trainer::restore_latest() {
  const std::string dir = latest_checkpoint(checkpoint_root());
  if (dir.empty()) {
    log_line(node_prefix().c_str(), "--resume: no checkpoint in %s, starting fresh", checkpoint_root().c_str());
    return;
  }
  CheckpointState s = load_checkpoint(dir);
  load_params(s, dir);
  if (s.node_id != cfg_.spes.node_id)
    throw CheckpointError(dir + ": checkpoint belongs to node " + std::to_string(s.node_id) + ", not node " +
                          std::to_string(cfg_.spes.node_id));
  if (int64_t(s.adam_m.size()) != own_.space.size() || int64_t(s.adam_v.size()) != own_.space.size())
    throw CheckpointError(dir + ": optimizer-state sizes do not match the config");
  backend_->write_moments(s.adam_m, s.adam_v);
  data_->train.restore(s.data_state);
  tokens_seen_ = s.rng_state.empty() ? step_ * cfg_.train.global_batch * cfg_.model.seq_len : int64_t(s.rng_state[0]);
  if (sync_) sync_->load_state(s, backend_->host_theta().data());
  // A checkpoint taken at a sync step before that step's round (what a bad round
  // leaves behind: stop_after_bad_round) owes that round: run() syncs first.
  const int64_t every = cfg_.spes.sync_steps;
  owes_round_ = sync_ && every > 0 && step_ > 0 && step_ % every == 0 && s.sync_round * every < step_;
  last_checkpoint_ = dir;
  log_line(node_prefix().c_str(), "resumed from %s at step %lld", dir.c_str(), (long long)step_);
}

// Whether to end the run before the next step: a signal ends a run without sync
// rounds after the step under way; with sync rounds the node asks the run to stop in
// its pushes instead, and stops where a round's result says (stop_if_round_ends_run).
bool Trainer::stop_requested() {
  if (stopping_ || ask_stop_ || !signalled()) return false;
  const char* why = strsignal(*signal_);
  const int64_t every = cfg_.spes.sync_steps;
  if (sync_ && every > 0) {
    ask_stop_ = true;
    log_line(node_prefix().c_str(),
             "%s: asking the run to stop at its next sync round (pushed at step %lld): every node stops there "
             "with a checkpoint (--resume continues); a second signal stops this node now",
             why, (long long)((step_ / every + 1) * every));
    return false;
  }
  stopping_ = true;
  stop_ = step_;
  log_line(node_prefix().c_str(), "%s: stopping at step %lld with a checkpoint (--resume continues)", why,
           (long long)stop_);
  return true;
}

// A round's result that ends the run: this node stops at this step, with a checkpoint
// of the round, as every node that received it does.
void Trainer::stop_if_round_ends_run(const SyncStats& s) {
  if (!s.stop || stopping_) return;
  stopping_ = true;
  stopped_by_run_ = !ask_stop_ && step_ < cfg_.train.steps;
  stop_ = step_;
  log_line(node_prefix().c_str(), "round %lld ends the run (%s): stopping at step %lld with a checkpoint (--resume "
           "continues)",
           (long long)s.round, ask_stop_ ? "as this node asked" : "another node or the coordinator was asked to stop",
           (long long)step_);
}

void Trainer::run(std::ostream& csv, bool resume) {
  if (resume) restore_latest();
  // A node asked to stop that cannot reach its coordinator as its run starts (a
  // coordinator signalled with no node joined has exited) stops at once: it has
  // trained nothing since its checkpoint, and no round would ever come.
  if (sync_ && !sync_->join(theta().data(), [this] { return signalled(); })) {
    stopping_ = true;
    log_line(node_prefix().c_str(),
             "%s before the first step and the coordinator cannot be reached: stopping at step %lld, nothing "
             "trained since %s",
             strsignal(*signal_), (long long)step_, last_checkpoint_.empty() ? "the start" : last_checkpoint_.c_str());
    return;
  }
  stop_ = cfg_.train.max_steps_this_run > 0 ? std::min(cfg_.train.steps, step_ + cfg_.train.max_steps_this_run)
                                            : cfg_.train.steps;
  if (owes_round_) {
    const SyncStats s = sync_if_due();
    log_line(node_prefix().c_str(), "step %lld: the checkpoint's sync round, now done: round %lld (state %016llx)",
             (long long)step_, (long long)s.round, (unsigned long long)s.state_hash);
    owes_round_ = false;
  }
  std::fprintf(stderr,
               "[node %lld] %lld parameters (%lld shared, %lld per expert), owned %lld; optimizer state %.1f MiB; %s\n",
               (long long)cfg_.spes.node_id, (long long)layout_.total, (long long)layout_.shared_count,
               (long long)layout_.expert_block, (long long)own_.space.size(), optimizer_state_bytes() / 1048576.0,
               backend_->describe().c_str());
  csv << csv_header() << std::endl;
  if (!csv) throw Error("the CSV header could not be written to stdout (file system full, or the reader gone)");
  Progress progress(node_prefix(), 10.0);
  const int64_t start = step_;
  while (step_ < stop_) {
    if (stop_requested()) break;  // before another step starts
    const StepStats st = train_step(csv);
    if (saves_after_step() && step_ < stop_) save(false);
    std::string line = strprintf("step %lld/%lld  loss %.4f  %.0f tok/s", (long long)step_,
                                 (long long)cfg_.train.steps, st.loss, st.tokens_per_s);
    if (!st.val_ce.empty()) line += "  val " + st.val_ce;
    progress.update(line + "  ETA " + progress.eta(double(step_ - start), double(stop_ - start)), step_ == stop_);
  }
  progress.finish();
  save(true);
}

}  // namespace spes
