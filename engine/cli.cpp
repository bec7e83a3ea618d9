#include "engine/cli.hpp"

#include <cstdio>
#include <string>

namespace spes {

int run_cli(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: spes-engine <train|coordinator|local|eval|export-hf|tokenize|merge-experts> ...\n");
    return 2;
  }
  std::fprintf(stderr, "spes-engine: unknown command '%s'\n", argv[1]);
  return 2;
}

}  // namespace spes
