#include "engine/cli.hpp"

#include <cstdio>
#include <cstring>
#include <string>

#include "data/tokenize.hpp"
#include "engine/trainer.hpp"

namespace spes {

namespace {

int tokenize_command(int argc, char** argv) { return tokenize_main({argv + 1, argv + argc}); }

struct Command {
  const char* name;
  int (*main)(int, char**);
  const char* summary;
};

const Command kCommands[] = {
    {"train", train_main, "train one node: train CONFIG [--set section.key=value]... [--node-id N] [--resume]"},
    {"eval", eval_main, "validation loss: eval CONFIG --checkpoint DIR [--data MANIFEST]"},
    {"tokenize", tokenize_command, "text/JSONL to token files: tokenize --input FILE... --out DIR [--val-fraction F]"},
};

void usage() {
  std::fprintf(stderr, "usage: spes-engine <command> [args]\ncommands:\n");
  for (const Command& c : kCommands) std::fprintf(stderr, "  %-14s %s\n", c.name, c.summary);
}

}  // namespace

int run_cli(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  for (const Command& c : kCommands)
    if (!std::strcmp(argv[1], c.name)) return c.main(argc - 1, argv + 1);
  std::fprintf(stderr, "spes-engine: unknown command '%s'\n", argv[1]);
  usage();
  return 2;
}

}  // namespace spes
