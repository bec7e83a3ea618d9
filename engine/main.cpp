// spes-engine: the command-line entry point. Subcommands are wired in engine/cli.cpp.
#include <cstdio>
#include <exception>

#include "engine/cli.hpp"
#include "engine/openmp_env.hpp"

int main(int argc, char** argv) {
  spes::default_to_short_openmp_spin(argv);
  try {
    return spes::run_cli(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spes-engine: error: %s\n", e.what());
    return 1;
  }
}
