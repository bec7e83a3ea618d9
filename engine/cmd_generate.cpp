// `spes-engine generate --checkpoint DIR [--prompt TEXT] [--max-tokens N]
// [--temperature T] [--top-k K] [--top-p P] [--seed S]`: what a trained model writes.
// The prompt and its continuation go to stdout as they are produced; the speed to
// stderr. Generation stops at the tokenizer's end-of-document token, after N new
// tokens, or when the trained context is full.
#include <chrono>
#include <cstdio>
#include <random>

#include <cmath>

#include "data/tokenizer.hpp"
#include "engine/args.hpp"
#include "engine/checkpoint.hpp"
#include "engine/commands.hpp"
#include "engine/config.hpp"
#include "model/cpu/cpu_decoder.hpp"
#include "model/token_sampling.hpp"

namespace spes {

int generate_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  std::string checkpoint, prompt;
  int64_t max_tokens = 256;
  int64_t seed = 1234;
  SamplingOptions so;
  po::options_description opts;
  opts.add_options()("checkpoint", po::value(&checkpoint)->required(), "checkpoint folder (or a root of step folders)")(
      "prompt", po::value(&prompt), "text to continue (default: a new document)")(
      "max-tokens", po::value(&max_tokens), "new tokens at most (default 256)")(
      "temperature", po::value(&so.temperature), "sampling temperature; 0 = greedy (default 0.8)")(
      "top-k", po::value(&so.top_k), "sample among the k most likely tokens (0 = all)")(
      "top-p", po::value(&so.top_p), "nucleus: the smallest set with this much probability (1 = all)")(
      "seed", po::value(&seed), "sampling seed (default 1234): same seed, same text");
  const char* usage =
      "spes-engine generate --checkpoint DIR [--prompt TEXT] [--max-tokens N] [--temperature T] [--top-k K] "
      "[--top-p P] [--seed S]";
  if (!parse_args(args, opts, usage, {})) return 0;
  if (max_tokens < 0) throw UsageError("--max-tokens must be ≥ 0");
  if (!(so.temperature >= 0 && std::isfinite(so.temperature))) throw UsageError("--temperature must be ≥ 0");
  if (so.top_k < 0) throw UsageError("--top-k must be ≥ 0");
  if (seed < 0) throw UsageError("--seed must be ≥ 0");
  if (!(so.top_p > 0 && so.top_p <= 1)) throw UsageError("--top-p must be in (0, 1]");

  const CheckpointState s = load_checkpoint(checkpoint);
  const Config c = parse_config_text(s.config_toml, checkpoint + "/config.toml");
  const ParamLayout layout = make_layout(c.model);
  if (int64_t(s.params.size()) != layout.total)
    throw CheckpointError(checkpoint + ": " + std::to_string(s.params.size()) + " parameters, its config needs " +
                          std::to_string(layout.total));
  // The run's tokenizer ([data] tokenizer, kept in the checkpoint's config; bytes by default).
  const std::unique_ptr<Tokenizer> tok = open_tokenizer(c.data.tokenizer.empty() ? "bytes" : c.data.tokenizer);
  if (c.model.vocab_size < tok->vocab_size())
    throw ConfigError(checkpoint + ": the model's vocabulary (" + std::to_string(c.model.vocab_size) +
                      ") is smaller than its tokenizer's, " + tok->name() + " (" + std::to_string(tok->vocab_size()) + ")");

  std::vector<uint32_t> ids = tok->encode(prompt);
  if (ids.empty()) ids.push_back(tok->eos_id());  // a new document
  const int64_t context = c.model.seq_len;
  if (int64_t(ids.size()) >= context)
    throw UsageError("the prompt is " + std::to_string(ids.size()) + " tokens; the model's context is " +
                     std::to_string(context));
  CpuDecoder dec(c.model, layout, s.params.data(), context);
  std::mt19937_64 rng(seed);
  std::fwrite(prompt.data(), 1, prompt.size(), stdout);
  std::fflush(stdout);

  const auto t0 = std::chrono::steady_clock::now();
  std::span<const float> logits;
  for (uint32_t id : ids) logits = dec.step(int32_t(id));
  int64_t produced = 0;
  const char* why = "--max-tokens reached";
  while (produced < max_tokens) {
    const int32_t next = sample_token(logits, so, rng);
    if (uint32_t(next) == tok->eos_id()) {
      why = "end of document";
      break;
    }
    // A token id of the padded vocabulary beyond the tokenizer's has no text.
    const std::string text = next < tok->vocab_size() ? tok->decode(std::span<const int32_t>(&next, 1)) : "";
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    ++produced;
    if (dec.position() >= context) {
      why = "context full";
      break;
    }
    logits = dec.step(next);
  }
  std::fputc('\n', stdout);
  const double s_elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "generate: %lld tokens in %.2f s (%.1f tokens/s, CPU), stopped: %s\n", (long long)produced,
               s_elapsed, double(produced) / std::max(s_elapsed, 1e-9), why);
  return 0;
}

}  // namespace spes
