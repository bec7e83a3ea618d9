// The `spes-engine` subcommands, one file each (engine/cmd_*.cpp); main.cpp only
// dispatches. Each takes the words after the command name and returns the exit code.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace spes {

struct Config;

// `merge-experts --in A.safetensors --out B.safetensors --alpha X [--topk K]`
int merge_experts_main(const std::vector<std::string>& args);

// `coordinator CONFIG [--set section.key=value]... [--fresh] [--dump-state DIR [--dump-every N]] [--port P]`
// (argv[0] is "coordinator")
int coordinator_command(int argc, char** argv);
// The coordinator's --dump-state hook (net::CoordinatorParams::on_round): θ as an HF
// export in DIR/round-NNNNNNNN at every `every`-th round; empty when dir is "".
std::function<void(std::span<const float>, int64_t)> coordinator_hf_dump(const Config& cfg, const std::string& dir,
                                                                        int64_t every);

}  // namespace spes
