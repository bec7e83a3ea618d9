// `spes-engine import-hf --in HF_DIR --out DIR`: a Hugging Face checkpoint folder
// (Qwen3, Qwen3-MoE, OLMo-2 or OLMoE; model/hf_config.hpp) as a step-0 checkpoint of
// this engine under DIR (parameters only, like upcycle's), and DIR/config.toml: the
// default config with the [model] the folder implies and [train] init = DIR, so
// eval, generate, upcycle and export-hf take it like any checkpoint, and train does
// once DIR/data holds token files made with the model's tokenizer ([data] train).
#include <filesystem>

#include "engine/args.hpp"
#include "engine/base/atomic_file.hpp"
#include "engine/base/log.hpp"
#include "engine/checkpoint.hpp"
#include "engine/commands.hpp"
#include "engine/config.hpp"
#include "model/hf_export.hpp"

namespace spes {

int import_hf_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  std::string in, out;
  po::options_description opts;
  opts.add_options()("in", po::value(&in)->required(), "Hugging Face folder (config.json + safetensors)")(
      "out", po::value(&out)->required(), "output checkpoint root (DIR/step-00000000, DIR/config.toml)");
  if (!parse_args(args, opts, "spes-engine import-hf --in HF_DIR --out DIR", {})) return 0;
  if (!latest_checkpoint(out).empty())
    throw UsageError("--out " + out + " already holds checkpoint " + latest_checkpoint(out) + "; pick a new folder");

  HfModel hf = import_hf(in);
  Config c;
  c.model = hf.config;
  c.train.init = std::filesystem::absolute(out).string();
  // Where `tokenize --out DIR/data` puts its manifest (relative to DIR/config.toml):
  // token files in the model's vocabulary, made with its tokenizer.
  c.data.train = "data/train.manifest";
  // Through the TOML reader: the engine's own checks on the imported shape.
  const std::string toml = config_to_toml(c);
  c = parse_config_text(toml, in + "/config.json (imported)");
  const ParamLayout layout = make_layout(c.model);
  const Ownership own = make_ownership(c.model, layout, 0, 1, OwnershipMode::all, 0);
  CheckpointState s;
  s.params = std::move(hf.params);
  s.config_toml = toml;
  s.fingerprint = model_fingerprint(c.model, layout, own);
  s.step = 0;
  const std::string dir = save_checkpoint(out, s, 0);
  write_file_atomic((std::filesystem::path(out) / "config.toml").string(), toml);
  log_line("[import-hf]", "%s (%s) -> %s (%lld parameters, %lld experts x %lld layers); config: %s/config.toml",
           in.c_str(), hf_arch_class(hf.arch), dir.c_str(), (long long)layout.total, (long long)c.model.n_experts,
           (long long)c.model.n_layers, out.c_str());
  return 0;
}

}  // namespace spes
