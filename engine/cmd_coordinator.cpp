// `spes-engine coordinator CONFIG [--set section.key=value]... [--fresh | --rollback-to ROUND]
//  [--dump-state DIR [--dump-every N]] [--port P]`: the merge coordinator of the
// config's run (net::Coordinator), serving until SIGINT/SIGTERM (which stop the run
// at its next round first: net/README.md, Stopping a run), with one CSV row per
// round on stdout. Without --fresh it resumes the run from state_dir (a missing
// or unreadable state is an error); --fresh starts a new run from the seed (or
// [train] init), replacing any state in state_dir; --rollback-to restarts the run from
// one of the last `keep_rounds` published rounds (net/round_archive); --dump-state writes θ as an HF export (config.json +
// model.safetensors) to DIR/round-NNNNNNNN every N rounds (default 1).
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "engine/args.hpp"
#include "engine/base/error.hpp"
#include "engine/base/log.hpp"
#include "engine/commands.hpp"
#include "engine/config.hpp"
#include "engine/net_sync.hpp"
#include "model/hf_export.hpp"
#include "net/coordinator.hpp"

namespace spes {

namespace {

void coordinator_log(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void coordinator_log(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vlog_line("[coordinator]", fmt, ap);
  va_end(ap);
}

}  // namespace

std::function<void(std::span<const float>, int64_t)> coordinator_hf_dump(const Config& cfg, const std::string& dir,
                                                                        int64_t every) {
  if (dir.empty() || every <= 0) return {};
  return [model = cfg.model, lb_coef = cfg.train.loss.lb_coef, layout = make_layout(cfg.model), dir, every](
             std::span<const float> theta, int64_t round) {
    if (round % every != 0) return;
    char name[32];
    std::snprintf(name, sizeof name, "round-%08lld", static_cast<long long>(round));
    const std::string out = (std::filesystem::path(dir) / name).string();
    try {
      HfExportOptions o;
      o.router_aux_loss_coef = lb_coef;
      export_hf(model, layout, theta.data(), out, o);
      coordinator_log("round %" PRId64 " exported to %s", round, out.c_str());
    } catch (const std::exception& e) {
      // The run goes on; the export is a by-product.
      coordinator_log("round %" PRId64 ": HF export to %s failed: %s", round, out.c_str(), e.what());
    }
  };
}

int coordinator_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  ConfigArgs a;
  std::string dump_dir;
  int64_t dump_every = 0;
  std::optional<int64_t> port, rollback_to;
  net::CoordinatorOptions opt;
  po::options_description opts;
  a.declare(opts, false);
  opts.add_options()("fresh", po::bool_switch(&opt.fresh), "start a new run from the seed, replacing any state in state_dir")(
      "dump-state", po::value(&dump_dir), "write θ as an HF export to DIR/round-NNNNNNNN")(
      "dump-every", po::value(&dump_every), "... every N rounds (default 1)")(
      "port", optional_value(port), "listen on this port instead of [spes] coordinator's (0: any free port)")(
      "rollback-to", optional_value(rollback_to),
      "restart the run from this kept round (state_dir/rounds; the last [spes] keep_rounds are kept)");
  if (!parse_args(args, opts,
                  "spes-engine coordinator CONFIG [--set section.key=value]... [--fresh | --rollback-to ROUND] "
                  "[--dump-state DIR "
                  "[--dump-every N]] [--port P]"))
    return 0;
  if (port && (*port < 0 || *port > 65535)) throw UsageError("--port " + std::to_string(*port) + ": expected 0..65535");
  if (port) opt.port = int(*port);
  if (rollback_to && *rollback_to < 0)
    throw UsageError("--rollback-to " + std::to_string(*rollback_to) + ": expected a round >= 0");
  if (rollback_to) opt.rollback_to = *rollback_to;
  const Config cfg = a.load();
  if (!dump_dir.empty() && dump_every <= 0) dump_every = 1;
  net::CoordinatorParams params = coordinator_params(cfg);
  params.on_round = coordinator_hf_dump(cfg, dump_dir, dump_every);
  opt.csv = &std::cout;
  opt.handle_signals = true;
  net::Coordinator c(std::move(params), opt);
  std::cout << net::Coordinator::csv_header() << "\n" << std::flush;
  c.run();
  return 0;
}

}  // namespace spes
