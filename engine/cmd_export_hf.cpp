// `spes-engine export-hf --checkpoint DIR --out DIR [--dtype F32|BF16]`: the
// checkpoint's model as a folder transformers loads, in the architecture the model
// is (model/hf_config.hpp: OLMoE, Qwen3-MoE, dense Qwen3 or OLMo-2).
#include <cstdio>

#include "engine/args.hpp"
#include "engine/checkpoint.hpp"
#include "engine/commands.hpp"
#include "engine/config.hpp"
#include "model/hf_export.hpp"

namespace spes {

int export_hf_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  std::string checkpoint, out, dtype = "F32";
  po::options_description opts;
  opts.add_options()("checkpoint", po::value(&checkpoint)->required(), "checkpoint folder or root")(
      "out", po::value(&out)->required(), "output folder")("dtype", po::value(&dtype), "F32 or BF16");
  if (!parse_args(args, opts, "spes-engine export-hf --checkpoint DIR --out DIR [--dtype F32|BF16]", {})) return 0;
  if (dtype != "F32" && dtype != "BF16") throw UsageError("--dtype " + dtype + ": expected F32 or BF16");
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
  std::fprintf(stderr, "exported step %lld to %s as %s (config.json, model.safetensors)\n", (long long)s.step,
               out.c_str(), hf_arch_class(hf_arch_of(c.model)));
  return 0;
}

}  // namespace spes
