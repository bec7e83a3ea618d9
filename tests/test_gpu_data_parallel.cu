// Data parallel inside a node on the NCCL communicator (issue 16), at one rank: the
// only count a one-GPU machine can run, and enough to put NCCL itself (init, the
// all-reduce of the owned gradients, the broadcast of θ after a sync round) under
// the same step and the same SPES rounds as the plain GPU backend. Several ranks need
// several GPUs; their logic (the split, the mean, bit-identical ranks) is tested on
// CPU ranks in test_data_parallel.cpp. Skipped without a GPU.
#include <doctest/doctest.h>

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "engine/backend.hpp"
#include "engine/config.hpp"
#include "engine/gpu_backend.hpp"
#include "engine/trainer.hpp"
#include "model/layout.hpp"
#include "tests/gpu_test.hpp"
#include "tests/gpu_train_util.hpp"
#include "tests/spes_run_util.hpp"
#include "tests/test_util.hpp"

using namespace spes;

namespace {

std::unique_ptr<TrainBackend> nccl_one_rank(const Config& c) {
  const ParamLayout layout = make_layout(c.model);
  return make_nccl_data_parallel_backend(c, layout, test::ownership_of(c, layout), {0});
}

}  // namespace

GPU_TEST_CASE("nccl data parallel, 1 rank: training equals the plain GPU backend, bitwise") {
  auto dir = test::temp_dir("gpu-nccl-train");
  const std::vector<std::string> sets = {"train.steps=12", "optim.warmup_steps=4", "optim.decay_steps=12"};
  const Config plain_cfg = test::gpu_config(dir / "plain", sets), nccl_cfg = test::gpu_config(dir / "nccl", sets);
  std::ostringstream plain_csv, nccl_csv;
  Trainer plain(plain_cfg);
  plain.run(plain_csv, false);
  Trainer nccl(nccl_cfg, nccl_one_rank(nccl_cfg));
  nccl.run(nccl_csv, false);
  // The mean of one rank's gradients is those gradients (NCCL's average over one rank
  // multiplies by 1), and a micro-batch split into one slice is the micro-batch: the
  // same kernels on the same inputs, so the same bits.
  CHECK(test::loss_columns(nccl_csv.str()) == test::loss_columns(plain_csv.str()));
  CHECK(nccl.params() == plain.params());
  const EvalResult a = plain.evaluate(0), b = nccl.evaluate(0);
  MESSAGE("validation CE after 12 steps: plain " << a.ce << ", NCCL 1 rank " << b.ce);
  CHECK(a.ce == b.ce);
}

GPU_TEST_CASE("nccl data parallel, 1 rank: a GPU node in a 4-node SPES run agrees with 3 CPU nodes every round") {
  auto dir = test::temp_dir("gpu-nccl-spes");
  const std::vector<std::string> spes = {"spes.n_nodes=4", "spes.ownership=\"partitioned\"", "spes.sync_steps=3",
                                         "spes.run_id=\"gpu-nccl-test\"", "spes.round_timeout_s=120",
                                         "train.steps=9", "optim.warmup_steps=3", "optim.decay_steps=9",
                                         "spes.state_dir=\"" + (dir / "coordinator").string() + "\""};
  test::InProcessSpes run(test::gpu_config(dir / "base", spes));
  std::vector<std::unique_ptr<Trainer>> nodes;
  for (int n = 0; n < 4; ++n) {
    std::vector<std::string> sets = run.node_sets(spes, n);
    if (n > 0) sets.push_back("train.device=\"cpu\"");
    const Config c = test::gpu_config(dir / ("n" + std::to_string(n)), sets);
    nodes.push_back(n == 0 ? std::make_unique<Trainer>(c, nccl_one_rank(c)) : std::make_unique<Trainer>(c));
  }
  const std::vector<std::string> csv = run.run(nodes);
  // The GPU node's host θ after each round is the coordinator's merged θ (fp32, as on
  // the CPU nodes), so the state hashes agree; the rounds' θ reached the device
  // through NCCL's broadcast.
  const auto h0 = test::InProcessSpes::round_hashes(csv[0]);
  MESSAGE("rounds: " << h0.size());
  CHECK(h0.size() == 3);
  for (int n = 1; n < 4; ++n) CHECK(test::InProcessSpes::round_hashes(csv[size_t(n)]) == h0);
  CHECK(nodes[0]->params() == nodes[1]->params());
}
