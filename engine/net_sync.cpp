#include "engine/net_sync.hpp"

#include "net/sync_client.hpp"

namespace spes {

namespace {

class NetSyncHook : public SyncHook {
 public:
  NetSyncHook(const Config& cfg, const ParamLayout& layout, const Ownership& own, const float* init_params)
      : client_(cfg, layout, own, model_fingerprint(cfg.model, layout, own), options(init_params)) {}

  SyncStats sync_round(float* params, int64_t step) override {
    const net::SyncStats s = client_.sync_round(params, step);
    SyncStats out;
    out.round = s.round;
    out.ms = s.ms;
    out.bytes_up = s.bytes_up;
    out.bytes_down = s.bytes_down;
    out.state_hash = s.state_hash;
    return out;
  }
  void save_state(CheckpointState& s) const override { client_.save_state(s); }
  void load_state(const CheckpointState& s, float*) override { client_.load_state(s); }

 private:
  static net::SyncClientOptions options(const float* init_params) {
    net::SyncClientOptions o;
    o.initial_params = init_params;
    return o;
  }
  net::SyncClient client_;
};

}  // namespace

std::unique_ptr<SyncHook> make_net_sync_hook(const Config& cfg, const ParamLayout& layout, const Ownership& own,
                                             const float* init_params) {
  return std::make_unique<NetSyncHook>(cfg, layout, own, init_params);
}

}  // namespace spes
