// `spes-engine train CONFIG [--set section.key=value]... [--node-id N] [--resume]`:
// one node of a run. CSV rows on stdout, logs on stderr.
#include <iostream>

#include "engine/args.hpp"
#include "engine/checkpoint.hpp"
#include "engine/commands.hpp"
#include "engine/net_sync.hpp"
#include "engine/trainer.hpp"

namespace spes {

int train_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  ConfigArgs a;
  bool resume = false;
  po::options_description opts;
  a.declare(opts);
  opts.add_options()("resume", po::bool_switch(&resume), "continue from the newest checkpoint");
  if (!parse_args(args, opts, "spes-engine train CONFIG [--set section.key=value]... [--node-id N] [--resume]"))
    return 0;
  Config c = a.load();
  // Resuming from a checkpoint: θ comes from it, so [train] init is not read
  // (a large file, and it may be gone by now).
  if (resume && !latest_checkpoint(node_checkpoint_root(c)).empty()) c.train.init.clear();
  Trainer t(c);
  // Before run(): θ is still the initial θ (initial_theta) the sync base starts from.
  if (c.spes.sync_steps > 0) t.set_sync_hook(make_net_sync_hook(c, t.layout(), t.ownership(), t.theta().data()));
  t.run(std::cout, resume);
  return 0;
}

}  // namespace spes
