// Data parallel inside a node on CPU ranks (threads), so the logic runs in CI: the
// thread communicator's mean is exact and identical everywhere; 2 ranks × B/2
// sequences give the update of 1 rank over the same B sequences; the ranks hold
// bit-identical parameters after every step and every sync round; one checkpoint
// per node.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <thread>

#include "engine/checkpoint.hpp"
#include "engine/communicator.hpp"
#include "engine/cpu_backend.hpp"
#include "engine/data_parallel.hpp"
#include "engine/trainer.hpp"
#include "gpu_train_util.hpp"  // ownership_of, CSV and moments checks
#include "spes_run_util.hpp"
#include "test_util.hpp"

using namespace spes;

namespace {

// A CPU data-parallel backend of `G` ranks for cfg; `ranks` receives the rank
// backends (owned by the returned backend) for inspection.
std::unique_ptr<TrainBackend> cpu_ranks(const Config& cfg, int G, std::vector<RankBackend*>& ranks) {
  const ParamLayout L = make_layout(cfg.model);
  const Ownership own = test::ownership_of(cfg, L);
  std::vector<std::unique_ptr<RankBackend>> rs;
  for (int r = 0; r < G; ++r) {
    rs.push_back(std::make_unique<CpuBackend>(cfg.model, cfg.train.loss, L, own, cfg.train.micro_batch / G, 1));
    ranks.push_back(rs.back().get());
  }
  return make_data_parallel_backend(std::move(rs), make_thread_communicator(G), cfg.train.micro_batch,
                                    cfg.model.seq_len);
}

double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

TEST_CASE("data parallel: the thread communicator's mean is exact and the same on every rank") {
  const int G = 3;
  const size_t n = 1001;  // not a multiple of the ranks: uneven slices
  std::mt19937 g(7);
  std::normal_distribution<float> d;
  std::vector<std::vector<float>> bufs(G, std::vector<float>(n));
  for (auto& b : bufs)
    for (auto& x : b) x = d(g);
  std::vector<float> expect(n);
  for (size_t i = 0; i < n; ++i) {
    float s = 0;
    for (int r = 0; r < G; ++r) s += bufs[r][i];  // rank order, as documented
    expect[i] = s * (1.0f / float(G));
  }
  auto comm = make_thread_communicator(G);
  std::vector<std::thread> ts;
  for (int r = 0; r < G; ++r) ts.emplace_back([&, r] { comm->all_reduce_mean(r, bufs[r]); });
  for (auto& t : ts) t.join();
  for (int r = 0; r < G; ++r) CHECK(bufs[r] == expect);

  std::vector<std::vector<std::byte>> bytes(G, std::vector<std::byte>(33));
  for (int r = 0; r < G; ++r) std::fill(bytes[r].begin(), bytes[r].end(), std::byte(r + 1));
  ts.clear();
  for (int r = 0; r < G; ++r) ts.emplace_back([&, r] { comm->broadcast(r, bytes[r], 1); });
  for (auto& t : ts) t.join();
  for (int r = 0; r < G; ++r) CHECK(bytes[r] == bytes[1]);
  CHECK(bytes[0][0] == std::byte(2));
}

TEST_CASE("data parallel: 2 ranks × B/2 give the update of 1 rank × B; ranks stay bit-identical") {
  auto dir = test::temp_dir("dp-update");
  // LB is a product of per-batch statistics: a batch split in two differs from the
  // whole by design (as with gradient accumulation), so it is off for the 1×B check.
  const Config c = test::small_config(dir, {"train.steps=4", "train.micro_batch=4", "train.global_batch=8",
                                            "train.lb_coef=0", "spes.n_nodes=2", "spes.node_id=1"});
  std::ostringstream csv_one, csv_two;
  Trainer one(c);  // 1 rank, micro-batches of 4
  one.run(csv_one, false);
  std::vector<RankBackend*> ranks;
  Trainer two(c, cpu_ranks(c, 2, ranks));  // 2 ranks, 2 sequences each
  two.run(csv_two, false);
  const double diff = rel_diff(two.params(), one.params());
  MESSAGE("2 ranks x 2 vs 1 rank x 4, after 4 steps: relative θ difference " << diff << " (tol 1e-5)");
  CHECK(diff < 1e-5);  // the same sums in another order (fp32)
  // Every rank holds the same parameters, bit for bit.
  ranks[0]->pull_theta();
  ranks[1]->pull_theta();
  const auto t0 = ranks[0]->host_theta(), t1 = ranks[1]->host_theta();
  CHECK(std::equal(t0.begin(), t0.end(), t1.begin()));
  // One checkpoint per node, not per rank.
  CHECK(latest_checkpoint((dir / "ckpt" / "node-1").string()).find("step-00000004") != std::string::npos);
}

// The node's loss parts are its ranks' token-weighted mean (CE and the z-losses are
// token means either way: 1e-5, fp32 sums in another order; LB see below), and
// moments written to the node (a resume) reach every rank, bit for bit.
TEST_CASE("data parallel: loss parts are the ranks' mean; moments reach every rank") {
  auto dir = test::temp_dir("dp-parts");
  const Config c = test::small_config(dir, {"train.steps=2", "train.micro_batch=4", "train.global_batch=8",
                                            "train.lb_coef=0", "spes.n_nodes=2", "spes.node_id=1"});
  std::ostringstream csv_one, csv_two;
  Trainer one(c);
  one.run(csv_one, false);
  std::vector<RankBackend*> ranks;
  Trainer two(c, cpu_ranks(c, 2, ranks));
  two.run(csv_two, false);
  const double parts_diff = test::worst_column_difference(csv_two.str(), csv_one.str(), {3, 5, 6});
  MESSAGE("ce, router_z, lm_z, 2 ranks vs 1: worst relative difference " << parts_diff << " (tol 1e-5)");
  CHECK(parts_diff < 1e-5);
  // LB is a product of per-batch statistics, so two halves' mean differs from the
  // whole batch's by design (0.4 % here); a sum over the ranks would double it.
  const double lb_diff = test::worst_column_difference(csv_two.str(), csv_one.str(), {4});
  MESSAGE("lb, 2 ranks vs 1: worst relative difference " << lb_diff << " (tol 0.1)");
  CHECK(lb_diff < 0.1);

  std::vector<RankBackend*> fresh_ranks;
  const std::unique_ptr<TrainBackend> node = cpu_ranks(c, 2, fresh_ranks);
  test::check_moments_reach_every_rank(*node, fresh_ranks,
                                       size_t(test::ownership_of(c, make_layout(c.model)).space.size()));
}

TEST_CASE("data parallel: 1 rank equals the plain backend, bitwise (the one-GPU NCCL path's logic)") {
  auto dir = test::temp_dir("dp-one");
  const std::vector<std::string> sets = {"train.steps=3", "spes.n_nodes=2", "spes.node_id=1"};
  const Config a = test::small_config(dir / "a", sets), b = test::small_config(dir / "b", sets);
  std::ostringstream csv_plain, csv_one;
  Trainer plain(a);
  plain.run(csv_plain, false);
  std::vector<RankBackend*> ranks;
  Trainer one(b, cpu_ranks(b, 1, ranks));  // the gradient "mean" of one rank still runs
  one.run(csv_one, false);
  CHECK(one.params() == plain.params());
}

TEST_CASE("data parallel: a 2-rank node in a 4-node SPES run agrees on every round's state hash") {
  auto dir = test::temp_dir("dp-spes");
  const std::vector<std::string> spes = {"spes.n_nodes=4", "spes.ownership=\"partitioned\"", "spes.sync_steps=2",
                                         "spes.run_id=\"dp-test\"", "spes.round_timeout_s=60", "train.steps=4",
                                         "train.micro_batch=2", "train.global_batch=4",
                                         "spes.state_dir=\"" + (dir / "coordinator").string() + "\""};
  test::InProcessSpes run(test::small_config(dir / "c", spes));
  std::vector<std::unique_ptr<Trainer>> nodes;
  std::vector<RankBackend*> ranks;
  for (int n = 0; n < 4; ++n) {
    const Config c = test::small_config(dir / ("n" + std::to_string(n)), run.node_sets(spes, n));
    nodes.push_back(n == 0 ? std::make_unique<Trainer>(c, cpu_ranks(c, 2, ranks)) : std::make_unique<Trainer>(c));
  }
  const std::vector<std::string> csv = run.run(nodes);

  // Every node logged the same hash after each of the 2 rounds.
  const auto h0 = test::InProcessSpes::round_hashes(csv[0]);
  CHECK(h0.size() == 2);
  for (int n = 1; n < 4; ++n) CHECK(test::InProcessSpes::round_hashes(csv[size_t(n)]) == h0);
  // After the last round both ranks of node 0 hold the merged θ.
  ranks[0]->pull_theta();
  const auto t0 = ranks[0]->host_theta(), t1 = ranks[1]->host_theta();
  CHECK(std::equal(t0.begin(), t0.end(), t1.begin()));
  CHECK(nodes[0]->params() == nodes[1]->params());
}

// Evaluation batches may be short (the validation set's last one): the rows go to the
// ranks in slices of micro_batch / G, the last ranks getting fewer or none, and the
// node's CE and lm z-loss are those of one rank over all the rows (1e-6: the same
// per-token values, summed in another order).
TEST_CASE("data parallel: a short evaluation batch split over the ranks gives one rank's losses") {
  auto dir = test::temp_dir("dp-eval");
  const Config c = test::small_config(dir, {"train.micro_batch=4", "train.global_batch=8", "spes.n_nodes=2",
                                            "spes.node_id=1"});
  const ParamLayout L = make_layout(c.model);
  const Ownership own = test::ownership_of(c, L);
  CpuBackend plain(c.model, c.train.loss, L, own, c.train.micro_batch, 1);
  std::vector<RankBackend*> ranks;
  const std::unique_ptr<TrainBackend> node = cpu_ranks(c, 2, ranks);
  std::vector<float> theta(size_t(L.total));
  init_parameters(theta.data(), c.model, L, c.train.seed);
  for (TrainBackend* b : {static_cast<TrainBackend*>(&plain), node.get()}) {
    std::copy(theta.begin(), theta.end(), b->host_theta().begin());
    b->push_theta();
  }
  std::mt19937 g(3);
  std::uniform_int_distribution<int> tok(0, int(c.model.vocab_size) - 1);
  std::vector<int32_t> x(size_t(c.train.micro_batch * c.model.seq_len)), y(x.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = tok(g), y[i] = tok(g);
  for (int64_t rows = 1; rows <= c.train.micro_batch; ++rows) {
    const LossParts a = plain.forward(x.data(), y.data(), rows), b = node->forward(x.data(), y.data(), rows);
    CAPTURE(rows);
    CHECK(std::fabs(b.ce - a.ce) <= 1e-6 * std::fabs(a.ce));
    CHECK(std::fabs(b.lm_z - a.lm_z) <= 1e-6 * std::fabs(a.lm_z));
  }
}
