// `spes-engine merge-experts --in A.safetensors --out B.safetensors --alpha X [--topk K]`:
// the expert-merging warm-up (model/expert_merge.hpp) on an HF-named safetensors file (the
// export format), on its own, so the coordinator's merge can be checked and used
// outside a run. Non-expert tensors and metadata are copied unchanged; each tensor
// keeps its dtype (F16 inputs are written as F32, which the writer supports).
#include <cstdio>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "engine/args.hpp"
#include "engine/base/error.hpp"
#include "engine/base/finite.hpp"
#include "engine/commands.hpp"
#include "model/expert_merge.hpp"
#include "model/safetensors.hpp"

namespace spes {

int merge_experts_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  std::string in, out;
  double alpha = -1;
  int64_t topk = 4;
  po::options_description opts;
  opts.add_options()("in", po::value(&in)->required(), "input safetensors (HF OLMoE names)")(
      "out", po::value(&out)->required(), "output safetensors")(
      "alpha", po::value(&alpha)->required(), "merge strength α in [0, 1]")(
      "topk", po::value(&topk), "donors per expert (default 4, capped at E-1)");
  const char* usage = "spes-engine merge-experts --in A.safetensors --out B.safetensors --alpha X [--topk K]";
  if (!parse_args(args, opts, usage, {})) return 0;
  if (!(alpha >= 0 && alpha <= 1)) throw UsageError("--alpha must be in [0, 1]");
  if (topk < 1) throw UsageError("--topk must be >= 1");

  SafeTensorsFile f = read_safetensors(in);
  // Weights are finite, read and written: a NaN in one expert would spread to its
  // donors' merges.
  auto require_finite = [&](const std::string& file, const char* what) {
    for (const SafeTensor& t : f.tensors)
      if (const std::string why = describe_non_finite(t.data.data(), int64_t(t.data.size())); !why.empty())
        throw Error(file + ": " + what + " tensor '" + t.name + "' " + why + "; nothing written");
  };
  require_finite(in, "input");
  // layer -> expert -> {gate, up, down}
  static const std::regex name_re(R"(model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight)");
  std::map<int, std::map<int, std::array<SafeTensor*, 3>>> experts;
  for (SafeTensor& t : f.tensors) {
    std::smatch m;
    if (!std::regex_match(t.name, m, name_re)) continue;
    const int which = m[3] == "gate" ? 0 : m[3] == "up" ? 1 : 2;
    experts[std::stoi(m[1])][std::stoi(m[2])][which] = &t;
  }
  if (experts.empty()) throw Error(in + ": no tensors named model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight");
  int64_t merged_layers = 0, n_experts = 0;
  for (auto& [layer, by_expert] : experts) {
    std::vector<ExpertWeights<float>> xs;
    int expect_e = 0;
    for (auto& [e, w] : by_expert) {
      const std::string where = in + ": layer " + std::to_string(layer) + " expert " + std::to_string(e);
      if (e != expect_e++) throw Error(in + ": layer " + std::to_string(layer) + " has no expert " + std::to_string(expect_e - 1));
      for (int k = 0; k < 3; ++k)
        if (!w[k]) throw Error(where + " lacks its " + (k == 0 ? "gate" : k == 1 ? "up" : "down") + "_proj");
      ExpertWeights<float> x;
      x.gate = w[0]->data.data(), x.up = w[1]->data.data(), x.down = w[2]->data.data();
      x.gate_n = int64_t(w[0]->data.size()), x.up_n = int64_t(w[1]->data.size()), x.down_n = int64_t(w[2]->data.size());
      if (!xs.empty() && (x.gate_n != xs[0].gate_n || x.up_n != xs[0].up_n || x.down_n != xs[0].down_n ||
                          w[0]->shape != by_expert.begin()->second[0]->shape))
        throw Error(where + ": shapes differ from expert 0's");
      xs.push_back(x);
    }
    merge_layer(xs, alpha, topk);
    ++merged_layers;
    n_experts = int64_t(xs.size());
  }
  for (SafeTensor& t : f.tensors)
    if (t.dtype != "F32" && t.dtype != "BF16") t.dtype = "F32";
  require_finite(out, "merged");
  write_safetensors(out, f.tensors, f.metadata);
  std::fprintf(stderr, "merge-experts: %lld layers x %lld experts, alpha %g, top-%lld donors -> %s\n",
               (long long)merged_layers, (long long)n_experts, alpha,
               (long long)std::min<int64_t>(topk, n_experts - 1), out.c_str());
  return 0;
}

}  // namespace spes
