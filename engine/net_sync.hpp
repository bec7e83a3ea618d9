// The program's side of the sync protocol: net/ takes plain values, built here from
// the Config (net never sees a Config or a checkpoint), and the trainer's sync hook
// backed by net::SyncClient — what `spes-engine train` installs when
// [spes] sync_steps > 0. Its state travels in CheckpointState's sync_* fields.
#pragma once
#include <cstdint>
#include <memory>
#include <span>

#include "engine/config.hpp"
#include "engine/sync_hook.hpp"
#include "model/layout.hpp"
#include "net/coordinator.hpp"
#include "net/sync_client.hpp"

namespace spes {

// The coordinator of this config's run: every node's ownership and fingerprint,
// [spes] settings, the secret (secret_file / $SPES_SECRET) and a fresh run's θ from
// initial_theta ([train] init, else train.seed).
// No on_round hook (the coordinator command adds its --dump-state export).
net::CoordinatorParams coordinator_params(const Config& cfg);

// Node own.node_id of this config's run. init_params: the initial θ (initial_theta)
// (layout.total floats), which the caller must hold until the client is built.
net::SyncClientParams sync_client_params(const Config& cfg, const ParamLayout& layout, const Ownership& own,
                                         std::span<const float> init_params);

// init_params: the initial θ when the caller holds it (a fresh trainer's params),
// so the client does not recompute it; null = initial_theta again.
std::unique_ptr<SyncHook> make_net_sync_hook(const Config& cfg, const ParamLayout& layout, const Ownership& own,
                                             const float* init_params = nullptr);

}  // namespace spes
