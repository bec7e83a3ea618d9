#include "engine/cli.hpp"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include "data/tokenize.hpp"
#include "engine/args.hpp"
#include "engine/checkpoint.hpp"
#include "engine/config.hpp"
#include "engine/base/error.hpp"
#include "engine/local.hpp"
#include "engine/trainer.hpp"
#include "model/hf_export.hpp"
#include "engine/commands.hpp"
#include "model/expert_merge.hpp"

namespace spes {

namespace {

int tokenize_command(int argc, char** argv) { return tokenize_main({argv + 1, argv + argc}); }

// `export-hf --checkpoint DIR --out DIR [--dtype F32|BF16]`: the checkpoint's
// model as a folder transformers loads (OlmoeForCausalLM).
int export_hf_command(int argc, char** argv) {
  namespace po = boost::program_options;
  std::string checkpoint, out, dtype = "F32";
  po::options_description opts;
  opts.add_options()("checkpoint", po::value(&checkpoint)->required(), "checkpoint folder or root")(
      "out", po::value(&out)->required(), "output folder")("dtype", po::value(&dtype), "F32 or BF16");
  parse_args(argc, argv, opts, "spes-engine export-hf --checkpoint DIR --out DIR [--dtype F32|BF16]");
  if (dtype != "F32" && dtype != "BF16") throw Error("--dtype " + dtype + ": expected F32 or BF16");
  const CheckpointState s = load_checkpoint(checkpoint);
  const Config c = parse_config_text(s.config_toml, checkpoint + "/config.toml");
  const ParamLayout layout = make_layout(c.model);
  if (int64_t(s.params.size()) != layout.total)
    throw CheckpointError(checkpoint + ": " + std::to_string(s.params.size()) + " parameters, its config needs " +
                          std::to_string(layout.total));
  HfExportOptions o;
  o.dtype = dtype;
  o.router_aux_loss_coef = c.train.loss.lb_coef;
  export_hf(c.model, layout, s.params.data(), out, o);
  std::fprintf(stderr, "exported step %lld to %s (config.json, model.safetensors)\n", (long long)s.step, out.c_str());
  return 0;
}

int merge_experts_command(int argc, char** argv) { return merge_experts_main({argv + 1, argv + argc}); }

struct Command {
  const char* name;
  int (*main)(int, char**);
  const char* summary;
};

const Command kCommands[] = {
    {"train", train_main, "train one node: train CONFIG [--set section.key=value]... [--node-id N] [--resume]"},
    {"local", local_main, "coordinator + every node on this machine: local CONFIG [--set k=v]... [--resume]"},
    {"eval", eval_main, "validation loss: eval CONFIG --checkpoint DIR [--data MANIFEST]"},
    {"export-hf", export_hf_command, "HF OLMoE export: export-hf --checkpoint DIR --out DIR [--dtype F32|BF16]"},
    {"coordinator", coordinator_command,
     "merge coordinator: coordinator CONFIG [--set k=v]... [--fresh] [--dump-state DIR [--dump-every N]]"},
    {"merge-experts", merge_experts_command,
     "expert-merging warm-up on an HF export: merge-experts --in A.safetensors --out B.safetensors --alpha X [--topk K]"},
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
