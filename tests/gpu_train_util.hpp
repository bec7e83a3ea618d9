// Shared by the whole-step GPU tests (test_gpu_step, test_gpu_data_parallel): the
// small GPU-shaped test model with its token data, and the CSV columns two runs
// must agree on.
#pragma once
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

#include "engine/backend.hpp"
#include "engine/config.hpp"
#include "model/layout.hpp"
#include "tests/test_util.hpp"

namespace spes::test {

// The GPU test model on write_token_data tokens in dir (80k tokens, 10% held out).
inline Config gpu_config(const std::filesystem::path& dir, const std::vector<std::string>& sets = {}) {
  return config_on_tokens(dir, R"([model]
vocab_size = 256
d_model = 128
n_layers = 2
n_heads = 2
n_kv_heads = 1
n_experts = 4
top_k = 2
expert_hidden = 96    # not d_model: a GEMM that swaps the two widths fails
seq_len = 64
qk_norm = true
init_std = 0.05
[train]
device = "cuda"
gpus = [0]        # one GPU: the tests compare one GpuBackend with the CPU
seed = 5
steps = 300
micro_batch = 4
global_batch = 8
threads = 0
decayed_aux_loss = true
[optim]
lr = 3e-3
warmup_steps = 20
decay_steps = 300
grad_clip = 1.0
[spes]
n_nodes = 2
node_id = 1
ownership = "partitioned"
[data]
val_fraction = 0.1
)",
                          80000, 256, "gpu-step.toml", sets);
}

inline Ownership ownership_of(const Config& c, const ParamLayout& layout) {
  return make_ownership(c.model, layout, int(c.spes.node_id), int(c.spes.n_nodes), c.spes.ownership,
                        c.spes.experts_per_node);
}

inline std::vector<std::vector<std::string>> csv_rows(const std::string& csv) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream is(csv);
  std::string line;
  std::getline(is, line);
  while (std::getline(is, line)) {
    std::vector<std::string> cells;
    std::istringstream ls(line);
    std::string cell;
    while (std::getline(ls, cell, ',')) cells.push_back(cell);
    rows.push_back(cells);
  }
  return rows;
}

// step:loss,ce,lb,router_z,lm_z,lr,grad_norm of every row (the columns that must
// agree between runs; step time and throughput do not).
inline std::vector<std::string> loss_columns(const std::string& csv) {
  std::vector<std::string> out;
  for (const auto& r : csv_rows(csv)) {
    REQUIRE(r.size() > 8);
    std::string s = r[0] + ":";
    for (int c = 2; c <= 8; ++c) s += r[c] + (c < 8 ? "," : "");
    out.push_back(s);
  }
  return out;
}

// The worst relative difference, over the rows, of the given CSV columns of `csv`
// against the same columns of `reference` (same number of rows; a reference value of
// 0 is an error: the comparison would be meaningless).
inline double worst_column_difference(const std::string& csv, const std::string& reference,
                                      std::initializer_list<int> columns) {
  const auto rows = csv_rows(csv), ref = csv_rows(reference);
  REQUIRE(rows.size() == ref.size());
  double worst = 0;
  for (size_t i = 0; i < rows.size(); ++i)
    for (const int col : columns) {
      const double a = std::stod(rows[i].at(size_t(col))), b = std::stod(ref[i].at(size_t(col)));
      REQUIRE(b != 0);
      worst = std::max(worst, std::fabs(a - b) / std::fabs(b));
    }
  return worst;
}

// Moments written to a data-parallel node (a resume) must reach every rank, bit for
// bit: a rank left with its own would step differently from then on.
inline void check_moments_reach_every_rank(TrainBackend& node, const std::vector<RankBackend*>& ranks, size_t owned) {
  std::vector<float> m(owned), v(owned);
  for (size_t i = 0; i < owned; ++i) m[i] = float(i % 97) * 1e-3f - 0.05f, v[i] = float(i % 89) * 1e-4f;
  node.write_moments(m, v);
  for (size_t r = 0; r < ranks.size(); ++r) {
    std::vector<float> mr(owned), vr(owned);
    ranks[r]->read_moments(mr, vr);
    CHECK_MESSAGE((mr == m && vr == v), "rank " << r << " does not hold the moments written to the node");
  }
}

inline double mean_loss_of_last(const std::string& csv, int n) {
  const auto rows = csv_rows(csv);
  REQUIRE(int(rows.size()) >= n);
  double s = 0;
  for (int i = int(rows.size()) - n; i < int(rows.size()); ++i) s += std::stod(rows[i][2]);
  return s / n;
}

}  // namespace spes::test
