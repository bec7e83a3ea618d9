// The trainer's sync hook backed by the sync protocol (net/SyncClient): what
// `spes-engine train` installs when [spes] sync_steps > 0.
#pragma once
#include <cstdint>
#include <memory>

#include "engine/config.hpp"
#include "engine/trainer.hpp"
#include "model/layout.hpp"

namespace spes {

std::unique_ptr<SyncHook> make_net_sync_hook(const Config& cfg, const ParamLayout& layout, const Ownership& own);

}  // namespace spes
