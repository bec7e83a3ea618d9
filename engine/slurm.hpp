// Running under SLURM (`srun spes-engine train CONFIG`): one SPES node per task.
// The node id is the task id (SLURM_PROCID), the node count the task count
// (SLURM_NTASKS), and the coordinator is $SPES_COORDINATOR when set (the sbatch
// script sets it), else [spes] coordinator, or — when that is loopback — the job's
// first host (SLURM_JOB_NODELIST) at the configured port, where
// configs/spes-slurm.sbatch starts it.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace spes {

struct SlurmTask {
  int64_t node_id = 0;
  int64_t n_nodes = 1;
  std::string first_host;  // of SLURM_JOB_NODELIST
};

// SLURM's task when its variables are set (SLURM_PROCID and SLURM_NTASKS), else
// nothing. `getenv` is injectable for tests. Throws ConfigError on malformed values.
std::optional<SlurmTask> slurm_task(const std::function<const char*(const char*)>& getenv);

// The hosts of a SLURM node list, expanded in order: "gpu[01-03,7],login2" →
// gpu01 gpu02 gpu03 gpu7 login2. Throws ConfigError on a malformed list.
std::vector<std::string> expand_slurm_nodelist(const std::string& list);

// --set overrides that make this process node `task.node_id` of the run: node id,
// node count, and the coordinator address when the config's is loopback.
std::vector<std::string> slurm_overrides(const SlurmTask& task, const std::string& config_coordinator,
                                         const char* spes_coordinator_env);

}  // namespace spes
