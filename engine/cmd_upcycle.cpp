// `spes-engine upcycle --checkpoint DENSE --config MOE.toml --out DIR [--noise X]
// [--seed S]`: a dense checkpoint (n_experts = top_k = 1) becomes the E-expert model
// of MOE.toml (model/upcycle.hpp: every expert the dense MLP plus X·rms·N(0,1)
// noise, fresh routers, shared weights copied), written as a step-0 checkpoint of
// MOE.toml under DIR: a run starts from it with [train] init = "DIR"; eval,
// export-hf and generate read it like any checkpoint.
#include <cmath>

#include "engine/args.hpp"
#include "engine/base/finite.hpp"
#include "engine/base/format.hpp"
#include "engine/base/log.hpp"
#include "engine/checkpoint.hpp"
#include "engine/commands.hpp"
#include "engine/config.hpp"
#include "model/upcycle.hpp"

namespace spes {

int upcycle_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  ConfigArgs a;
  std::string checkpoint, out;
  double noise = 0.0;
  int64_t seed = 0;
  bool seed_given = false;
  po::options_description opts;
  a.declare(opts, false);
  opts.add_options()("checkpoint", po::value(&checkpoint)->required(), "the dense checkpoint (n_experts = top_k = 1)")(
      "out", po::value(&out)->required(), "output checkpoint root (DIR/step-00000000)")(
      "noise", po::value(&noise), "relative noise X: W_e = W + X·rms(W)·N(0,1) (default 0)")(
      "seed", po::value(&seed)->notifier([&](int64_t) { seed_given = true; }),
      "noise and router seed >= 0 (default: MOE.toml's [train] seed)");
  const char* usage =
      "spes-engine upcycle --checkpoint DENSE --config MOE.toml --out DIR [--noise X] [--seed S] [--set k=v]...";
  if (!parse_args(args, opts, usage)) return 0;
  if (!(noise >= 0 && std::isfinite(noise))) throw UsageError("--noise must be >= 0");
  if (seed < 0) throw UsageError("--seed must be >= 0");
  if (!latest_checkpoint(out).empty())
    throw UsageError("--out " + out + " already holds checkpoint " + latest_checkpoint(out) + "; pick a new folder");

  const CheckpointState dense_state = load_checkpoint(checkpoint);
  const Config dense = parse_config_text(dense_state.config_toml, checkpoint + "/config.toml");
  Config moe = a.load();
  const ParamLayout dense_layout = make_layout(dense.model), layout = make_layout(moe.model);
  UpcycleOptions o;
  o.noise = noise;
  o.seed = seed_given ? uint64_t(seed) : moe.train.seed;

  CheckpointState s;
  s.params.resize(size_t(layout.total));
  upcycle(dense.model, dense_layout, dense_state.params, moe.model, layout, s.params.data(), o,
          "the dense checkpoint " + checkpoint, a.config);
  // The dense checkpoint is finite (its load checks), so only the noise can overflow.
  if (const std::string why = describe_non_finite(s.params.data(), int64_t(s.params.size())); !why.empty())
    throw UsageError(strprintf("--noise %g makes the upcycled weights non-finite (%s); nothing written", noise,
                               why.c_str()));
  s.config_toml = config_to_toml(moe);
  const Ownership own = make_ownership(moe.model, layout, int(moe.spes.node_id), int(moe.spes.n_nodes),
                                       moe.spes.ownership, moe.spes.experts_per_node);
  s.fingerprint = model_fingerprint(moe.model, layout, own);
  s.node_id = moe.spes.node_id;
  s.step = 0;  // parameters only: a run from [train] init starts with fresh optimizer state
  const std::string dir = save_checkpoint(out, s, 0);

  const ModelConfig &d = dense.model, &m = moe.model;
  auto note = [&](const char* key, double dv, double mv) {
    if (dv != mv) log_line("[upcycle]", "note: [model] %s is %g in the dense model, %g in %s (used)", key, dv, mv,
                           a.config.c_str());
  };
  note("rope_theta", d.rope_theta, m.rope_theta);
  note("norm_eps", d.norm_eps, m.norm_eps);
  note("seq_len", double(d.seq_len), double(m.seq_len));
  if (!m.norm_topk_prob && m.top_k < m.n_experts)
    log_line("[upcycle]",
             "note: norm_topk_prob = false: the MoE output starts as the dense MLP scaled by the top-%lld router "
             "probability mass (< 1); norm_topk_prob = true reproduces the dense model at --noise 0",
             (long long)m.top_k);
  log_line("[upcycle]", "%s (step %lld) -> %lld experts x %lld layers, noise %g, seed %llu: %s (%lld parameters)",
           checkpoint.c_str(), (long long)dense_state.step, (long long)m.n_experts, (long long)m.n_layers, noise,
           (unsigned long long)o.seed, dir.c_str(), (long long)layout.total);
  return 0;
}

}  // namespace spes
