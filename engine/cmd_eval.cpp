// `spes-engine eval CONFIG --checkpoint DIR [--data MANIFEST] [--batches N]`: the
// validation loss of a checkpoint, as one CSV row on stdout.
#include <cmath>
#include <cstdio>

#include "engine/args.hpp"
#include "engine/checkpoint.hpp"
#include "engine/commands.hpp"
#include "engine/trainer.hpp"

namespace spes {

int eval_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  ConfigArgs a;
  std::string checkpoint, data;
  int64_t batches = 0;
  po::options_description opts;
  a.declare(opts);
  opts.add_options()("checkpoint", po::value(&checkpoint)->required(), "checkpoint folder (or a root of step folders)")(
      "data", po::value(&data), "validation manifest (default: the config's validation data)")(
      "batches", po::value(&batches), "micro-batches to evaluate (0 = all)");
  if (!parse_args(args, opts, "spes-engine eval CONFIG --checkpoint DIR [--data MANIFEST] [--batches N]")) return 0;
  if (batches < 0) throw UsageError("--batches must be ≥ 0 (0 = all)");
  Config c = a.load();
  c.train.init.clear();  // θ comes from --checkpoint: no need to read [train] init's
  if (!data.empty()) {
    // The trainer opens training data too; eval never draws from it, so --data stands
    // in for it and the config's training manifest need not exist (an import's
    // config.toml names one its folder may not hold yet).
    c.data.train = c.data.validation = data;
    c.data.val_fraction = 0.0;
  }
  const CheckpointState s = load_checkpoint(checkpoint);
  Trainer t(c);
  t.load_params(s, checkpoint);
  const EvalResult r = t.evaluate(batches);
  if (r.tokens == 0) throw DataError(c.path + ": no validation data ([data] validation or val_fraction)");
  std::printf("checkpoint,step,tokens,ce,perplexity\n%s,%lld,%lld,%.6f,%.4f\n", checkpoint.c_str(), (long long)s.step,
              (long long)r.tokens, r.ce, std::exp(r.ce));
  return 0;
}

}  // namespace spes
