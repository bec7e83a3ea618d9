// The `spes-engine` subcommands, one file each (engine/cmd_*.cpp); engine/cli.cpp
// only dispatches. Each takes the words after the command name and returns the exit
// code; a bad argument throws UsageError (exit 2), any other failure an Error (exit 1).
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace spes {

struct Config;

// `train`'s exit status when another node or the coordinator stopped the run at a
// round before its last step (its checkpoint holds that round; --resume continues):
// not 0, which would say the run is done. 75 is sysexits' EX_TEMPFAIL, "try again".
constexpr int kExitStoppedByRun = 75;

int train_command(const std::vector<std::string>& args);          // cmd_train.cpp
int local_command(const std::vector<std::string>& args);          // cmd_local.cpp
int coordinator_command(const std::vector<std::string>& args);    // cmd_coordinator.cpp
int eval_command(const std::vector<std::string>& args);           // cmd_eval.cpp
int export_hf_command(const std::vector<std::string>& args);      // cmd_export_hf.cpp
int import_hf_command(const std::vector<std::string>& args);      // cmd_import_hf.cpp
int merge_experts_command(const std::vector<std::string>& args);  // cmd_merge_experts.cpp
int tokenize_command(const std::vector<std::string>& args);       // cmd_tokenize.cpp
int generate_command(const std::vector<std::string>& args);       // cmd_generate.cpp
int plan_command(const std::vector<std::string>& args);           // cmd_plan.cpp
int upcycle_command(const std::vector<std::string>& args);        // cmd_upcycle.cpp
int plot_command(const std::vector<std::string>& args);           // cmd_plot.cpp
int certs_command(const std::vector<std::string>& args);          // cmd_certs.cpp
int reference_command(const std::vector<std::string>& args);      // cmd_reference.cpp

// The coordinator's --dump-state hook (net::CoordinatorParams::on_round): θ as an HF
// export in DIR/round-NNNNNNNN at every `every`-th round; empty when dir is "".
std::function<void(std::span<const float>, int64_t)> coordinator_hf_dump(const Config& cfg, const std::string& dir,
                                                                        int64_t every);

}  // namespace spes
