#include "engine/cli.hpp"

#include <cstdio>

#include "engine/args.hpp"
#include "engine/commands.hpp"

namespace spes {

namespace {

struct Command {
  const char* name;
  int (*run)(const std::vector<std::string>&);
  const char* summary;
};

const Command kCommands[] = {
    {"train", train_command, "train one node: train CONFIG [--set section.key=value]... [--node-id N] [--resume]"},
    {"local", local_command, "coordinator + every node on this machine: local CONFIG [--set k=v]... [--resume]"},
    {"coordinator", coordinator_command,
     "merge coordinator: coordinator CONFIG [--set k=v]... [--fresh] [--dump-state DIR [--dump-every N]]"},
    {"eval", eval_command, "validation loss: eval CONFIG --checkpoint DIR [--data MANIFEST]"},
    {"export-hf", export_hf_command,
     "HF export (OLMoE, Qwen3(-MoE), OLMo-2): export-hf --checkpoint DIR --out DIR [--dtype F32|BF16]"},
    {"import-hf", import_hf_command,
     "HF checkpoint (Qwen3(-MoE), OLMo-2, OLMoE) to a step-0 checkpoint: import-hf --in HF_DIR --out DIR"},
    {"merge-experts", merge_experts_command,
     "expert-merging warm-up on an HF export: merge-experts --in A.safetensors --out B.safetensors --alpha X [--topk K]"},
    {"generate", generate_command,
     "sample text from a checkpoint: generate --checkpoint DIR [--prompt TEXT] [--max-tokens N] [--temperature T]"},
    {"plan", plan_command,
     "memory per node vs centralized, no GPU needed: plan CONFIG [--node-id N] [--gpus G] [--micro-batch B] [--memory 80GiB] [--link 1Gbit [--step-ms MS]]"},
    {"tokenize", tokenize_command, "text/JSONL (plain, .gz, .zst) to token files: tokenize --input FILE|DIR... --out DIR [--val-fraction F]"},
    {"upcycle", upcycle_command,
     "dense checkpoint to an MoE: upcycle --checkpoint DENSE --config MOE.toml --out DIR [--noise X] [--seed S]"},
    {"plot", plot_command,
     "CSV columns as an SVG line plot: plot CSV... --x COL --y COL [--group COL] [--logy] [-o out.svg] [--title T]"},
    {"certs", certs_command, "the run's CA and TLS certificates: certs CONFIG --out DIR [--host H]... [--days N]"},
    {"reference", reference_command,
     "a reference table of the READMEs as markdown: reference config|csv|rounds-csv"},
};

void usage(std::FILE* to) {
  std::fprintf(to, "usage: spes-engine <command> [args]   (spes-engine <command> --help for its options)\ncommands:\n");
  for (const Command& c : kCommands) std::fprintf(to, "  %-14s %s\n", c.name, c.summary);
}

}  // namespace

int run_cli(const std::vector<std::string>& argv) {
  if (argv.empty() || argv[0] == "--help" || argv[0] == "-h") {
    usage(argv.empty() ? stderr : stdout);
    return argv.empty() ? 2 : 0;
  }
  for (const Command& c : kCommands) {
    if (argv[0] != c.name) continue;
    try {
      return c.run({argv.begin() + 1, argv.end()});
    } catch (const UsageError& e) {
      std::fprintf(stderr, "spes-engine %s: %s\n", c.name, e.what());
      return 2;
    }
  }
  std::fprintf(stderr, "spes-engine: unknown command '%s'\n", argv[0].c_str());
  usage(stderr);
  return 2;
}

}  // namespace spes
