// What a 2-node run in separate processes shows when it is stopped at a round and
// resumed (tests/test_local.cpp through `local`, tests/test_slurm_sbatch.cpp through
// the SLURM script): each node's newest checkpoint at one sync round's step, holding
// that round; once resumed to its end, the checkpoints and the coordinator's state
// of the run never stopped, bit for bit. Both keep the nodes' checkpoints in
// ckpt/node-N and the coordinator's state in coordinator/ of their folder.
#pragma once
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "engine/checkpoint.hpp"
#include "test_util.hpp"

namespace spes::test {

inline CheckpointState newest_checkpoint(const TempDir& dir, int node) {
  return load_checkpoint(latest_checkpoint(dir / ("ckpt/node-" + std::to_string(node))));
}

// Both nodes stopped before `steps`, at one step of a round (one every sync_steps),
// each with a checkpoint holding that round.
inline void check_stopped_at_one_round(const TempDir& dir, int64_t sync_steps, int64_t steps) {
  const CheckpointState n0 = newest_checkpoint(dir, 0), n1 = newest_checkpoint(dir, 1);
  CHECK(n0.step == n1.step);
  CHECK(n0.step % sync_steps == 0);
  CHECK(n0.step < steps);
  CHECK(n0.sync_round == n0.step / sync_steps);
}

// The run in dir, resumed to `steps`, ended as the run in ref that was never stopped.
inline void check_ends_as(const TempDir& ref, const TempDir& dir, int64_t steps) {
  for (int n : {0, 1}) {
    CAPTURE(n);
    const CheckpointState a = newest_checkpoint(ref, n), b = newest_checkpoint(dir, n);
    CHECK(b.step == steps);
    CHECK(a.params == b.params);
    CHECK(a.adam_m == b.adam_m);
    CHECK(a.adam_v == b.adam_v);
  }
  CHECK(read_text(ref / "coordinator/coordinator_state.bin") == read_text(dir / "coordinator/coordinator_state.bin"));
}

}  // namespace spes::test
