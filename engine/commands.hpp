// The `spes-engine` subcommands, one file each (engine/cmd_*.cpp); main.cpp only
// dispatches. Each takes the words after the command name and returns the exit code.
#pragma once
#include <string>
#include <vector>

namespace spes {

// `merge-experts --in A.safetensors --out B.safetensors --alpha X [--topk K]`
int merge_experts_main(const std::vector<std::string>& args);

}  // namespace spes
