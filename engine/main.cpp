// spes-engine: the command-line entry point. Subcommands are dispatched in
// engine/cli.cpp, one file each (engine/cmd_*.cpp).
#include <cstdio>
#include <exception>
#include <new>

#include "engine/cli.hpp"
#include "engine/openmp_env.hpp"

int main(int argc, char** argv) {
  spes::default_to_short_openmp_spin(argv);
  try {
    return spes::run_cli({argv + 1, argv + argc});
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "spes-engine: error: out of host memory: the run asked for more than this machine can allocate "
                 "(`spes-engine plan CONFIG` shows what a node needs)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spes-engine: error: %s\n", e.what());
    return 1;
  }
}
