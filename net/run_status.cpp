#include "net/run_status.hpp"

#include <chrono>
#include <cmath>
#include <filesystem>

namespace spes::net {

void Curve::add(int64_t step, double value) {
  if (!std::isfinite(value)) return;
  if (++skipped_ < stride_) return;
  skipped_ = 0;
  points_.push_back({step, value});
  if (points_.size() < kMaxCurvePoints) return;
  size_t kept = 0;
  for (size_t i = 0; i < points_.size(); i += 2) points_[kept++] = points_[i];
  points_.resize(kept);
  stride_ *= 2;
}

StatusBoard::StatusBoard(std::string run_id, std::string codec, int n_nodes, int64_t round, int64_t step,
                         uint64_t hash, int64_t state_bytes)
    : loss_(size_t(n_nodes)), val_ce_(size_t(n_nodes)), started_(unix_now()) {
  s_.run_id = std::move(run_id);
  s_.codec = std::move(codec);
  s_.n_nodes = n_nodes;
  s_.round = round;
  s_.step = step;
  s_.state_hash = hash;
  s_.state_bytes = state_bytes;
  s_.nodes.resize(size_t(n_nodes));
  for (int i = 0; i < n_nodes; ++i) s_.nodes[size_t(i)].id = i;
}

void StatusBoard::node_connected(int node, bool connected) {
  std::lock_guard<std::mutex> lk(mu_);
  s_.nodes.at(size_t(node)).connected = connected;
}

void StatusBoard::node_pushed(int node, int64_t round, const TrainFigures* figures, int pushed) {
  std::lock_guard<std::mutex> lk(mu_);
  NodeStatus& n = s_.nodes.at(size_t(node));
  n.last_round_pushed = round;
  s_.pushed = pushed;
  if (!figures) return;
  // A figure that is not finite is unknown, whatever the node sent.
  auto finite = [](double v) { return std::isfinite(v) ? v : NAN; };
  n.reported = true;
  n.figures = *figures;
  n.figures.loss = finite(figures->loss);
  n.figures.tokens_per_s = finite(figures->tokens_per_s);
  n.figures.sync_ms = finite(figures->sync_ms);
  n.figures.val_ce = finite(figures->val_ce);
  loss_[size_t(node)].add(figures->step, figures->loss);
  // A validation CE is added once, at the step it was measured.
  const std::vector<CurvePoint>& val = val_ce_[size_t(node)].points();
  if (figures->val_step >= 0 && (val.empty() || val.back().step != figures->val_step))
    val_ce_[size_t(node)].add(figures->val_step, figures->val_ce);
}

void StatusBoard::round_closed(const LastRound& r, uint64_t state_hash, int64_t state_bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  s_.last = r;
  s_.round = r.round;
  s_.step = r.step;
  s_.state_hash = state_hash;
  s_.state_bytes = state_bytes;
  s_.pushed = 0;
}

RunStatus StatusBoard::snapshot() const {
  std::lock_guard<std::mutex> lk(mu_);
  RunStatus s = s_;
  for (size_t i = 0; i < s.nodes.size(); ++i) {
    s.nodes[i].loss = loss_[i].points();
    s.nodes[i].val_ce = val_ce_[i].points();
  }
  s.uptime_s = unix_now() - started_;
  return s;
}

int64_t folder_bytes(const std::string& folder) {
  std::error_code ec;
  int64_t total = 0;
  for (std::filesystem::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code e;
    if (it->is_regular_file(e)) {
      const auto n = it->file_size(e);
      if (!e) total += int64_t(n);
    }
  }
  return total;
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace spes::net
