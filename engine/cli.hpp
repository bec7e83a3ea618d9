#pragma once
namespace spes {
// Dispatches `spes-engine <command> ...`; returns the process exit code.
int run_cli(int argc, char** argv);
}  // namespace spes
