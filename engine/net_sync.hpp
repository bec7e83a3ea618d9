// The trainer's sync hook backed by the sync protocol (net/SyncClient): what
// `spes-engine train` installs when [spes] sync_steps > 0.
#pragma once
#include <cstdint>
#include <memory>

#include "engine/config.hpp"
#include "engine/trainer.hpp"
#include "model/layout.hpp"

namespace spes {

// init_params: the seeded initial θ when the caller holds it (a fresh trainer's
// params), so the client does not recompute it; null = recompute from the seed.
std::unique_ptr<SyncHook> make_net_sync_hook(const Config& cfg, const ParamLayout& layout, const Ownership& own,
                                             const float* init_params = nullptr);

}  // namespace spes
