// Config → net parameters, and the trainer's sync hook (see net_sync.hpp).
#include "engine/net_sync.hpp"

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/base/log.hpp"
#include "engine/checkpoint.hpp"
#include "engine/init_theta.hpp"
#include "engine/trainer.hpp"
#include "net/address.hpp"
#include "net/certs.hpp"

namespace spes {

namespace {

// [spes] tls_*: the certificate and key default to `name`.{crt,key} beside the CA.
net::TlsFiles tls_files(const SpesConfig& s, const std::string& name) {
  net::TlsFiles f;
  if (s.tls_ca.empty()) return f;
  const std::filesystem::path dir = std::filesystem::path(s.tls_ca).parent_path();
  f.ca = s.tls_ca;
  f.cert = s.tls_cert.empty() ? (dir / (name + ".crt")).string() : s.tls_cert;
  f.key = s.tls_key.empty() ? (dir / (name + ".key")).string() : s.tls_key;
  return f;
}

net::MergeWarmup merge_warmup(const SpesConfig& s) {
  net::MergeWarmup m;
  m.alpha = s.merge_alpha;
  m.topk = s.merge_topk;
  m.interval = s.merge_interval;
  m.decay_steps = s.merge_decay_steps;
  return m;
}

SyncStats engine_stats(const net::RoundReport& s) {
  SyncStats out;
  out.round = s.round;
  out.ms = s.ms;
  out.bytes_up = s.bytes_up;
  out.bytes_down = s.bytes_down;
  out.state_hash = s.state_hash;
  out.stop = s.stop;
  return out;
}

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

class NetSyncHook : public SyncHook {
 public:
  NetSyncHook(const net::SyncClientParams& p, bool overlap)
      : client_(p), overlap_(overlap), prefix_("[node " + std::to_string(p.node_id) + "]") {}

  // Overlapped: apply the round started at the last sync step if it is still in
  // flight (waiting only if it has not arrived since), then push this one and go on
  // (unless that round ended the run).
  SyncStats sync_round(float* params, int64_t step, const net::TrainFigures& figures, bool ask_stop) override {
    if (!overlap_) return engine_stats(client_.sync_round(params, step, figures, ask_stop));
    SyncStats out;
    if (client_.round_in_flight()) out = finish(params);
    if (out.stop) return out;
    client_.start_round(params, step, figures, ask_stop);
    started_ = std::chrono::steady_clock::now();
    return out;
  }
  bool join(const float* params, const std::function<bool()>& give_up) override {
    return client_.join(params, give_up);
  }
  bool round_in_flight() const override { return client_.round_in_flight(); }
  SyncStats settle(float* params) override {
    return client_.round_in_flight() ? finish(params) : SyncStats{};
  }
  void save_state(CheckpointState& s) const override {
    net::SyncState st = client_.state();
    s.sync_round = st.round;
    s.sync_base = std::move(st.base);
    s.sync_residual = std::move(st.residual);
  }
  void load_state(const CheckpointState& s, float*) override {
    client_.restore(net::SyncState{s.sync_round, s.sync_base, s.sync_residual});
  }
  void report_bad_round(int64_t round, const std::string& why) override {
    if (client_.report_bad_round(round, why))
      log_line(prefix_.c_str(), "round %lld reported to the coordinator as bad", (long long)round);
  }

 private:
  SyncStats finish(float* params) {
    const auto t0 = std::chrono::steady_clock::now();
    SyncStats out = engine_stats(client_.finish_round(params));
    out.wait_ms = ms_since(t0);
    out.inflight_ms = ms_since(started_);
    if (out.wait_ms >= 1)
      log_line(prefix_.c_str(), "round %lld in flight %.0f ms; the step loop waited %.0f ms for it",
               (long long)out.round, out.inflight_ms, out.wait_ms);
    return out;
  }

  net::SyncClient client_;
  bool overlap_;
  std::string prefix_;
  std::chrono::steady_clock::time_point started_;
};

}  // namespace

net::CoordinatorParams coordinator_params(const Config& cfg) {
  const SpesConfig& s = cfg.spes;
  net::CoordinatorParams p;
  p.run_id = s.run_id;
  p.n_nodes = int(s.n_nodes);
  p.min_nodes = s.min_nodes;
  p.codec = s.codec;
  p.secret = net::load_secret(s.secret_file);
  p.allow_insecure = s.allow_insecure;
  p.tls = tls_files(s, "coordinator");
  p.address = s.coordinator;
  p.status_address = s.status_bind;
  p.round_timeout_s = s.round_timeout_s;
  p.state_dir = s.state_dir;
  p.sync_steps = s.sync_steps;
  p.merge = merge_warmup(s);
  p.outer = {s.outer_optimizer, s.outer_lr, s.outer_momentum};
  p.update_bound = {s.update_bound, int(s.update_bound_rounds), s.update_bound_first};
  p.keep_rounds = int(s.keep_rounds);
  p.layout = make_layout(cfg.model);
  p.n_experts = cfg.model.n_experts;
  for (int node = 0; node < p.n_nodes; ++node) {
    const Ownership own = make_ownership(cfg.model, p.layout, node, p.n_nodes, s.ownership, s.experts_per_node);
    p.nodes.push_back({model_fingerprint(cfg.model, p.layout, own), own.space});
  }
  p.init_theta = [cfg, layout = p.layout](float* theta) { initial_theta(cfg, layout, theta); };
  p.seed = cfg.train.seed;
  if (!cfg.train.init.empty()) p.init_source = "[train] init " + cfg.train.init;
  return p;
}

net::SyncClientParams sync_client_params(const Config& cfg, const ParamLayout& layout, const Ownership& own,
                                         std::span<const float> init_params) {
  const SpesConfig& s = cfg.spes;
  net::SyncClientParams p;
  p.run_id = s.run_id;
  p.node_id = own.node_id;
  p.n_nodes = int(s.n_nodes);
  p.codec = s.codec;
  p.secret = net::load_secret(s.secret_file);
  p.allow_insecure = s.allow_insecure;
  p.tls = tls_files(s, net::node_cert_name(own.node_id));
  p.coordinator = s.coordinator;
  p.round_timeout_s = s.round_timeout_s;
  p.layout = layout;
  p.n_experts = cfg.model.n_experts;
  p.space = own.space;
  p.fingerprint = model_fingerprint(cfg.model, layout, own);
  p.initial_params = init_params;
  return p;
}

std::unique_ptr<SyncHook> make_net_sync_hook(const Config& cfg, const ParamLayout& layout, const Ownership& own,
                                             const float* init_params) {
  std::vector<float> init;
  if (!init_params) {
    init.resize(size_t(layout.total));
    initial_theta(cfg, layout, init.data());
    init_params = init.data();
  }
  return std::make_unique<NetSyncHook>(
      sync_client_params(cfg, layout, own, std::span<const float>(init_params, size_t(layout.total))), cfg.spes.overlap);
}

}  // namespace spes
