// The round state machine (see round.hpp): pure bookkeeping of one round's pushes,
// quorum and membership; every transition logged.
#include "net/round.hpp"

#include <algorithm>
#include <cstdarg>
#include <cinttypes>
#include <cstdio>
#include <stdexcept>

namespace spes::net {

namespace {

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

const char* phase_name(RoundPhase p) {
  switch (p) {
    case RoundPhase::waiting: return "waiting";
    case RoundPhase::collecting: return "collecting";
    case RoundPhase::merging: return "merging";
    case RoundPhase::publishing: return "publishing";
  }
  return "?";
}

}  // namespace

RoundMachine::RoundMachine(RoundRules rules, int64_t completed_round, LineSink log)
    : rules_(std::move(rules)), log_(std::move(log)), completed_(completed_round) {
  if (rules_.n_nodes < 1) throw std::invalid_argument("RoundMachine: n_nodes must be ≥ 1");
  if (int(rules_.node_chunks.size()) != rules_.n_nodes)
    throw std::invalid_argument("RoundMachine: node_chunks needs one entry per node");
  rules_.min_nodes = std::clamp(rules_.min_nodes, 1, rules_.n_nodes);
  nodes_.resize(size_t(rules_.n_nodes));
  owns_.assign(size_t(rules_.n_nodes), std::vector<uint8_t>(size_t(rules_.n_chunks), 0));
  for (int p = 0; p < rules_.n_nodes; ++p)
    for (int c : rules_.node_chunks[size_t(p)]) {
      if (c < 0 || c >= rules_.n_chunks) throw std::invalid_argument("RoundMachine: node chunk outside the grid");
      owns_[size_t(p)][size_t(c)] = 1;
    }
  for (Node& n : nodes_) n.got.assign(size_t(rules_.n_chunks), 0), n.crc.assign(size_t(rules_.n_chunks), 0);
}

void RoundMachine::set_phase(RoundPhase p, int64_t round, const std::string& why) {
  log(format("round %" PRId64 ": %s -> %s (%s)", round, phase_name(phase_), phase_name(p), why.c_str()));
  phase_ = p;
}

// Pushes only arrive between rounds' merges: the glue merges and publishes in one go.
void RoundMachine::expect_open(const char* event) const {
  if (phase_ != RoundPhase::waiting && phase_ != RoundPhase::collecting)
    throw std::logic_error(std::string("RoundMachine: ") + event + " while " + phase_name(phase_));
}

int RoundMachine::done_count() const {
  int done = 0;
  for (const Node& n : nodes_) done += n.done;
  return done;
}

bool RoundMachine::node_joined(int node, int64_t node_round, bool hash_matches) {
  Node& n = nodes_.at(size_t(node));
  const bool in_sync = node_round == completed_ && hash_matches;
  n.synced_round = in_sync ? completed_ : -1;
  n.awaiting = 0;
  return in_sync;
}

void RoundMachine::node_snapshot(int node) { nodes_.at(size_t(node)).synced_round = completed_; }

void RoundMachine::node_left(int node) {
  Node& n = nodes_.at(size_t(node));
  n.synced_round = -1;
  n.awaiting = 0;
}

PushVerdict RoundMachine::check_push(int node, int64_t r) {
  expect_open("push");
  PushVerdict v;
  if (r <= completed_) {
    ++late_;
    v.check = PushCheck::stale;
    v.reason = "stale round: round " + std::to_string(r) + " is closed (coordinator at round " +
               std::to_string(completed_) + "); resync from a snapshot";
  } else if (r > completed_ + 1) {
    v.check = PushCheck::future;
    v.reason = "push for round " + std::to_string(r) + " but the open round is " + std::to_string(completed_ + 1);
  } else if (nodes_.at(size_t(node)).synced_round != completed_) {
    // Its Δ would be against some other θ: it must take a snapshot first.
    v.check = PushCheck::must_snapshot;
    v.reason = "node does not hold round " + std::to_string(completed_) + "'s state; resync from a snapshot";
  }
  return v;
}

bool RoundMachine::owns(int node, int chunk) const {
  return chunk >= 0 && chunk < rules_.n_chunks && owns_.at(size_t(node))[size_t(chunk)];
}

ChunkCheck RoundMachine::check_chunk(int node, int chunk, uint32_t crc) const {
  const Node& n = nodes_.at(size_t(node));
  if (!n.got.at(size_t(chunk))) return ChunkCheck::fresh;
  return n.crc[size_t(chunk)] == crc ? ChunkCheck::duplicate : ChunkCheck::conflict;
}

RoundDecision RoundMachine::on_chunk(int node, int chunk, uint32_t crc) {
  expect_open("chunk");
  RoundDecision d;
  Node& n = nodes_.at(size_t(node));
  if (n.got.at(size_t(chunk))) {  // idempotent, whatever the caller checked
    if (n.crc[size_t(chunk)] != crc) d.refuse = "resent chunk differs from the first push";
    return d;
  }
  if (phase_ == RoundPhase::waiting) {
    set_phase(RoundPhase::collecting, completed_ + 1, "first push, from node " + std::to_string(node));
    timed_out_ = false;
    d.arm_timer = completed_ + 1;
  }
  n.got[size_t(chunk)] = 1;
  n.crc[size_t(chunk)] = crc;
  ++n.got_n;
  return d;
}

std::vector<int> RoundMachine::refuse_push(int node) {
  expect_open("refused push");
  Node& n = nodes_.at(size_t(node));
  std::vector<int> out;
  for (int c = 0; c < rules_.n_chunks; ++c)
    if (n.got[size_t(c)]) out.push_back(c);
  std::fill(n.got.begin(), n.got.end(), 0);
  n.got_n = 0;
  n.done = false;
  n.awaiting = 0;
  log(format("round %" PRId64 ": node %d's push refused as a whole (%zu chunk(s) withdrawn)", completed_ + 1, node,
             out.size()));
  return out;
}

RoundDecision RoundMachine::on_push_done(int node) {
  expect_open("PushDone");
  RoundDecision d;
  Node& n = nodes_.at(size_t(node));
  const int expect = int(rules_.node_chunks.at(size_t(node)).size());
  if (n.got_n != expect) {
    d.refuse = "PushDone after " + std::to_string(n.got_n) + " of " + std::to_string(expect) + " chunks";
    return d;
  }
  n.done = true;
  n.awaiting = completed_ + 1;
  d.close = maybe_close();
  return d;
}

RoundDecision RoundMachine::on_timer(int64_t round) {
  RoundDecision d;
  if (phase_ != RoundPhase::collecting || round != completed_ + 1) return d;  // that round already closed
  timed_out_ = true;
  log(format("round %" PRId64 ": timeout after %.1f s with %d of %d nodes done (min_nodes %d)", round,
             rules_.round_timeout_s, done_count(), rules_.n_nodes, rules_.min_nodes));
  d.close = maybe_close();
  return d;
}

// Quorum: every node, or ≥ min_nodes once the timer has fired.
std::optional<RoundClose> RoundMachine::maybe_close() {
  if (phase_ != RoundPhase::collecting) return std::nullopt;
  const int done = done_count();
  std::string why;
  if (done == rules_.n_nodes) why = "all " + std::to_string(rules_.n_nodes) + " nodes pushed";
  else if (timed_out_ && done >= rules_.min_nodes)
    why = "timeout, quorum " + std::to_string(done) + " of " + std::to_string(rules_.n_nodes);
  else return std::nullopt;
  RoundClose c;
  c.round = completed_ + 1;
  c.participants = done;
  c.late_pushes = late_;
  c.why = why;
  for (int p = 0; p < rules_.n_nodes; ++p) {
    const Node& n = nodes_[size_t(p)];
    if (!n.done) {
      if (!c.missing.empty()) c.missing += ';';
      c.missing += std::to_string(p);
    }
  }
  set_phase(RoundPhase::merging, c.round, why);
  return c;
}

std::vector<int> RoundMachine::publish(const std::string& recipients_note) {
  if (phase_ != RoundPhase::merging) throw std::logic_error("RoundMachine: publish while " + std::string(phase_name(phase_)));
  ++completed_;
  set_phase(RoundPhase::publishing, completed_, recipients_note);
  std::vector<int> to;
  for (int p = 0; p < rules_.n_nodes; ++p) {
    Node& n = nodes_[size_t(p)];
    if (n.awaiting != completed_) continue;
    n.awaiting = 0;
    n.synced_round = completed_;
    to.push_back(p);
  }
  return to;
}

void RoundMachine::next_round() {
  if (phase_ != RoundPhase::publishing)
    throw std::logic_error("RoundMachine: next_round while " + std::string(phase_name(phase_)));
  for (Node& n : nodes_) {
    std::fill(n.got.begin(), n.got.end(), 0);
    n.got_n = 0;
    n.done = false;
  }
  late_ = 0;
  timed_out_ = false;
  set_phase(RoundPhase::waiting, completed_ + 1, "round " + std::to_string(completed_) + " published");
}

}  // namespace spes::net
