// `spes-engine <command> [args]`: the dispatcher (main.cpp calls it; tests call it
// to check exit codes). Prints a UsageError with the usage and returns 2; other
// errors propagate to main, which prints them on one line and exits 1.
#pragma once
#include <string>
#include <vector>

namespace spes {

int run_cli(const std::vector<std::string>& argv);  // argv[0] is the command name

}  // namespace spes
