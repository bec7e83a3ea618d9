// The coordinator's glue (see coordinator.hpp): on one Asio thread, sessions
// (net/session) hand pushes here; byte-level checks happen here, round-level ones
// in the state machine (net/round), whose decisions drive the round timer, the
// streaming merge, persistence (net/global_state: before publishing) and the
// publication of each round to the nodes that pushed.
#include "net/coordinator.hpp"

#include "engine/base/progress.hpp"

#include <algorithm>
#include <utility>  // before Asio: boost/asio/awaitable.hpp uses std::exchange
#include <boost/asio.hpp>
#include <chrono>
#include <cinttypes>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <ostream>
#include <set>
#include <thread>

#include "engine/base/csv.hpp"
#include "engine/base/error.hpp"
#include "model/expert_merge.hpp"
#include "net/asio_util.hpp"
#include "net/digest.hpp"
#include "net/finite_guard.hpp"
#include "net/frame.hpp"
#include "net/global_state.hpp"
#include "net/grid.hpp"
#include "net/line_log.hpp"
#include "net/publication.hpp"
#include "net/round.hpp"
#include "net/run_status.hpp"
#include "net/round_archive.hpp"
#include "net/session.hpp"
#include "net/status_server.hpp"
#include "net/streaming_merge.hpp"
#include "net/tls.hpp"
#include "net/update_bound.hpp"

namespace spes::net {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

// One closed round as its row of the rounds CSV shows it.
struct RoundRecord {
  int64_t round = 0, step = 0;
  int participants = 0;
  std::string missing_nodes;
  int64_t late_pushes = 0, bytes_in = 0, bytes_out = 0;
  double merge_alpha = 0, merge_ms = 0;
  uint64_t state_hash = 0;
};

// The columns of the rounds CSV, in order (net/README.md, "Coordinator CSV").
const CsvColumn<RoundRecord> kRoundColumns[] = {
    {"round", [](const RoundRecord& r) { return strprintf("%" PRId64, r.round); }, "the round"},
    {"step", [](const RoundRecord& r) { return strprintf("%" PRId64, r.step); },
     "its step: round × `sync_steps`"},
    {"participants", [](const RoundRecord& r) { return strprintf("%d", r.participants); },
     "nodes whose push the round merged"},
    {"missing_nodes", [](const RoundRecord& r) { return r.missing_nodes; },
     "the other nodes, e.g. `1;3` (empty when every node took part)"},
    {"late_pushes", [](const RoundRecord& r) { return strprintf("%" PRId64, r.late_pushes); },
     "stale pushes refused while the round was open"},
    {"bytes_in", [](const RoundRecord& r) { return strprintf("%" PRId64, r.bytes_in); },
     "bytes the coordinator received since the previous round's row"},
    {"bytes_out", [](const RoundRecord& r) { return strprintf("%" PRId64, r.bytes_out); },
     "bytes of the round's result, summed over its recipients"},
    {"merge_alpha", [](const RoundRecord& r) { return strprintf("%.6g", r.merge_alpha); },
     "the expert-merging warm-up's α at this round (0 when off)"},
    {"merge_ms", [](const RoundRecord& r) { return strprintf("%.2f", r.merge_ms); },
     "the round's close: the merge and the write-ahead persist of the next state file, which are one pass"},
    {"state_hash", [](const RoundRecord& r) { return hash_hex(r.state_hash); },
     "hash of θ after the round (hex), the one every node checks"},
};

const CoordinatorParams& checked(const CoordinatorParams& p, const CoordinatorOptions& opt) {
  if (p.n_nodes < 1) throw NetError("coordinator: n_nodes must be ≥ 1");
  if (p.sync_steps < 1)
    throw NetError("coordinator: [spes] sync_steps must be ≥ 1 (a round's step is round × sync_steps), got " +
                   std::to_string(p.sync_steps));
  if (int(p.nodes.size()) != p.n_nodes)
    throw NetError("coordinator: " + std::to_string(p.nodes.size()) + " node descriptions for " +
                   std::to_string(p.n_nodes) + " nodes");
  if (opt.chunk_elems < kInt8Block || opt.chunk_elems > kMaxChunkElems || opt.chunk_elems % kInt8Block)
    throw NetError("chunk_elems must be a multiple of " + std::to_string(kInt8Block) + " in [" +
                   std::to_string(kInt8Block) + ", " + std::to_string(kMaxChunkElems) + "]");
  // What the listening sockets need, checked before a fresh run writes its round 0:
  // without a secret or TLS only loopback, unless allow_insecure (refuse, never rebind
  // quietly); TLS files that load.
  check_secret(p.secret, "coordinator");
  check_insecure("coordinator bind address", parse_host_port(p.address).host, !p.secret.empty(), p.tls.on(),
                 p.allow_insecure);
  if (p.tls.on()) tls_context(p.tls, true);
  if (!p.status_address.empty())
    check_insecure("status page bind address", parse_host_port(p.status_address).host, !p.secret.empty(),
                   p.tls.on(), p.allow_insecure);
  return p;
}

// Node ids as the logs show them: "0;2".
template <class Nodes>
std::string node_list(const Nodes& nodes) {
  std::string out;
  for (int node : nodes) {
    if (!out.empty()) out += ';';
    out += std::to_string(node);
  }
  return out;
}

int quorum(const CoordinatorParams& p) { return int(std::clamp<int64_t>(p.min_nodes, 1, p.n_nodes)); }

RoundRules round_rules(const CoordinatorParams& p, const ChunkGrid& grid) {
  RoundRules r;
  r.n_nodes = p.n_nodes;
  r.min_nodes = quorum(p);
  r.round_timeout_s = p.round_timeout_s;
  r.n_chunks = int(grid.chunks.size());
  for (const CoordinatorNode& n : p.nodes) {
    std::vector<int> chunks;
    for (const Range& range : n.space.ranges())
      for (int c : grid.chunks_in(range)) chunks.push_back(c);
    r.node_chunks.push_back(std::move(chunks));
  }
  return r;
}

// How many nodes may push each chunk (the merge picks its sum's width by it).
std::vector<int> chunk_owners(const CoordinatorParams& p, const ChunkGrid& grid) {
  std::vector<int> owners(grid.chunks.size(), 0);
  for (const CoordinatorNode& n : p.nodes)
    for (const Range& range : n.space.ranges())
      for (int c : grid.chunks_in(range)) ++owners[size_t(c)];
  return owners;
}

HandshakeRules handshake_rules(const CoordinatorParams& p, const CoordinatorOptions& opt) {
  HandshakeRules h;
  h.run_id = p.run_id;
  h.n_nodes = p.n_nodes;
  h.codec = p.codec;
  h.secret = p.secret;
  h.tls = p.tls;
  for (const CoordinatorNode& n : p.nodes) h.fingerprints.push_back(n.fingerprint);
  h.chunk_elems = uint32_t(opt.chunk_elems);
  h.rolled_back_to = rolled_back_to(p.state_dir);
  return h;
}

SessionLimits session_limits(const CoordinatorOptions& opt) {
  SessionLimits l;
  l.handshake_timeout_s = opt.handshake_timeout_s;
  l.max_pending = std::max(1, opt.max_pending);
  l.heartbeat_timeout_s = opt.heartbeat_timeout_s;
  l.io_timeout_s = opt.io_timeout_s;
  return l;
}

}  // namespace

struct Coordinator::Impl final : SessionHandler {
  CoordinatorParams p;
  CoordinatorOptions opt;
  LineLog log;
  ChunkGrid grid;
  StatePersistence persistence;
  RoundArchive archive;
  GlobalState state;  // θ as of the completed round
  StreamingMerge merge;
  RoundMachine rounds;
  UpdateBound update_bound;
  std::vector<float> delta_scratch;  // one decoded push, for the overflow check and the bound ...
  std::vector<float> theta_scratch;  // ... against θ_old of its chunk
  int merge_threads = int(std::max(1u, std::thread::hardware_concurrency()));

  asio::io_context io;
  asio::steady_timer round_timer{io};
  std::unique_ptr<asio::signal_set> signals;
  SessionServer server;
  tcp::endpoint bound;  // read by other threads (port()): set once in the constructor
  bool stopped = false;
  bool csv_failed = false;  // the round CSV's stream failed (said once)
  // Stopping a run at a round (net/README.md, Stopping a run): the nodes that asked
  // in their push to the open round (a request leaves with its node's connection; a
  // reconnecting node asks again as it resends), and whether this process was
  // signalled (every round it publishes from then on ends the run, and it exits once
  // no node is left). The newest round if it ended the run, until the run resumes (a
  // node joins holding it), and the nodes connected when it closed that had not
  // pushed to it: a snapshot of it tells them, and a signalled coordinator waits for
  // them a while (exit_when_told).
  std::set<int> stop_asked;
  bool stopping = false;
  int members = 0;  // nodes joined and not yet left
  int64_t stop_round = -1;
  std::set<int> stop_missed;
  asio::steady_timer stop_grace{io};

  mutable std::mutex stats_mu;
  CoordinatorStats stats_;  // round, step, state_hash, late_pushes, csv_rows; the rest is the server's
  Progress progress{"[coordinator]"};  // on a terminal: the open round at a glance (logs have the rest)
  StatusBoard board;                    // what the status page shows ...
  std::unique_ptr<StatusServer> status;  // ... served on its own thread (last: it reads the members above)

  Impl(CoordinatorParams params, CoordinatorOptions o);

  // SessionHandler
  bool on_joined(Session& s, int64_t node_round, uint64_t node_hash) override {
    ++members;
    board.node_connected(s.node_id(), true);
    const bool in_sync = rounds.node_joined(s.node_id(), node_round, node_hash == state.hash);
    if (in_sync && node_round == stop_round && !stopping) {  // a node resumed from the stop: the run goes on
      stop_round = -1;
      stop_missed.clear();
    }
    return in_sync;
  }
  void on_left(Session& s) override {
    --members;
    stop_asked.erase(s.node_id());
    board.node_connected(s.node_id(), false);
    rounds.node_left(s.node_id());
    if (stopping && members == 0) asio::post(io, [this] { exit_when_told(); });  // not from inside a session's callback
  }
  void on_snapshot(Session& s) override { rounds.node_snapshot(s.node_id()); }
  bool snapshot_ends_run(Session& s, int64_t round) override {
    if (round != stop_round) return false;
    if (stop_missed.erase(s.node_id()) > 0)
      log("node %d missed round %" PRId64 ", which ended the run: its snapshot tells it to stop there", s.node_id(),
          round);
    return true;
  }
  void on_push_chunk(Session& s, const wire::PushChunk* m) override;
  void on_push_done(Session& s, const wire::PushDone* m) override;
  void on_bad_round(Session& s, const wire::BadRound* m) override;
  GlobalState open_state();
  std::map<int64_t, std::string> round_pushers;  // the kept rounds' participants, e.g. "0;2"

  bool check_round(Session& s, int64_t r);
  bool check_finite_update(Session& s, const GridChunk& ch, const uint8_t* payload, const float** decoded);
  bool check_update_bound(Session& s, int c, const uint8_t* payload, const float* decoded);
  void refuse_push(Session& s, wire::ErrorCode code, const std::string& why, const char* reason = "bad_push");
  // The open round's step: the completed round's plus sync_steps (= round × sync_steps
  // when the interval never changed). Never a node's word: it drives the warm-up's α.
  int64_t open_round_step() const { return state.step + p.sync_steps; }
  void arm_timer(int64_t r);
  void close_round(const RoundClose& rc);
  void on_signal(int sig);
  void wait_for_signal();
  void exit_when_told();
  void shutdown();
  void start_status_page();
  RunStatus status_now() const;  // the board and the live counters (status server's thread)
  template <class F>
  void update_stats(F&& f) {
    std::lock_guard<std::mutex> lk(stats_mu);
    f(stats_);
  }
};

Coordinator::Impl::Impl(CoordinatorParams params, CoordinatorOptions o)
    : p(std::move(params)),
      opt(std::move(o)),
      log("[coordinator]", opt.log),
      grid(make_grid(checked(p, opt).layout, p.n_experts, opt.chunk_elems)),
      persistence(PersistRules{p.state_dir, p.run_id, p.nodes[0].fingerprint, p.codec, p.layout.total,
                               p.outer.has_momentum()},
                  log),
      archive(p.state_dir, p.keep_rounds, log),
      state(open_state()),
      merge(grid, p.codec, 0, chunk_owners(p, grid)),
      rounds(round_rules(p, grid), state.round, log.sink()),
      update_bound(grid, p.update_bound),
      delta_scratch(size_t(opt.chunk_elems)),
      theta_scratch(delta_scratch.size()),
      server(io, handshake_rules(p, opt), session_limits(opt), grid, state, *this, log),
      board(p.run_id, codec_name(p.codec), p.n_nodes, state.round, state.step, state.hash,
            folder_bytes(persistence.folder())) {
  const HostPort hp = parse_host_port(p.address);
  std::string host = hp.host;
  const int port = opt.port >= 0 ? opt.port : hp.port;
  if (host == "localhost") host = "127.0.0.1";
  bound = server.listen(host, uint16_t(port));
  log("listening on %s:%u (%s, %d nodes, min_nodes %d, round timeout %.0f s, codec %s%s)", host.c_str(),
      unsigned(bound.port()),
      p.tls.on() ? "TLS 1.3, node certificates" : p.secret.empty() ? "no secret" : "HMAC auth, frame MACs", p.n_nodes,
      quorum(p), p.round_timeout_s, codec_name(p.codec), p.secret.empty() && !p.tls.on() ? ", insecure" : "");
  if (p.update_bound.on())
    log("update bound: %g × the median accepted update of the last %d rounds (first rounds: %g × RMS of θ)",
        p.update_bound.kappa, p.update_bound.rounds, p.update_bound.first);
  else
    log("update bound off (update_bound = 0): pushes are checked for finite values only");
  if (!p.outer.identity())
    log("outer optimizer %s, lr %g, momentum %g", outer_kind_name(p.outer.kind), p.outer.lr, p.outer.momentum);
  stats_.round = state.round;
  stats_.step = state.step;
  stats_.state_hash = state.hash;
  state.chunk_round.assign(grid.chunks.size(), state.round);
  start_status_page();
}

// Off loopback only as the sync port may be (a secret, TLS or allow_insecure).
void Coordinator::Impl::start_status_page() {
  if (p.status_address.empty()) return;
  const HostPort hp = parse_host_port(p.status_address);
  status = std::make_unique<StatusServer>(hp.host, hp.port, [this] { return status_now(); });
  log("status page at %s (Prometheus: %smetrics, JSON: %sstatus.json)", status->url().c_str(), status->url().c_str(),
      status->url().c_str());
}

RunStatus Coordinator::Impl::status_now() const {
  RunStatus s = board.snapshot();
  const SessionCounters& c = server.counters();
  s.bytes_in = c.bytes_in;
  s.bytes_out = c.bytes_out;
  s.connections = c.connections;
  s.snapshots = c.snapshots;
  s.dropped = c.dropped;
  for (int r = 0; r < kRefusalReasons; ++r) s.refusals.emplace_back(refusal_reason_name(r), c.refused_by[size_t(r)]);
  {
    std::lock_guard<std::mutex> lk(stats_mu);
    s.push_refusals.assign(stats_.push_refusals.begin(), stats_.push_refusals.end());
    s.max_update_ratio = stats_.max_update_ratio;
  }
  for (NodeStatus& n : s.nodes) {
    n.bytes_up = server.traffic(n.id).up;
    n.bytes_down = server.traffic(n.id).down;
  }
  return s;
}

// The state to serve: with --rollback-to a kept round is made the state first
// (net/round_archive); the round it starts from is kept too.
GlobalState Coordinator::Impl::open_state() {
  if (opt.rollback_to >= 0) {
    if (opt.fresh) throw NetError("--rollback-to and --fresh exclude each other");
    roll_back(p.state_dir, persistence.path(), opt.rollback_to, p.layout.total, log);
  }
  GlobalState g = persistence.open(opt.fresh, p.init_theta,
                                   p.init_source.empty() ? "seed " + std::to_string(p.seed) : p.init_source);
  archive.keep(g.round, persistence.path());
  return g;
}

// A node's first step after round m->round() was not finite (engine/trainer): the
// round is logged with the nodes that pushed to it, for the operator to revoke one
// and roll back (net/README.md, A bad round).
void Coordinator::Impl::on_bad_round(Session& s, const wire::BadRound* m) {
  const int64_t r = m->round();
  const auto it = round_pushers.find(r);
  const std::string pushers = it == round_pushers.end() ? "unknown (not a kept round)" : it->second;
  const std::string reason(str_view(m->reason()).substr(0, kMaxReasonBytes));
  log("BAD ROUND %" PRId64 " reported by node %d (%s); nodes that pushed to it: %s; kept rounds to roll back to "
      "with --rollback-to: up to %" PRId64,
      r, s.node_id(), reason.c_str(), pushers.c_str(), r - 1);
  update_stats([&](CoordinatorStats& st) {
    st.bad_round_reports.push_back(strprintf("round %lld: node %d: ", (long long)r, s.node_id()) + reason);
  });
}

// Round-level checks of a push (state machine); a stale one counts as a late push.
bool Coordinator::Impl::check_round(Session& s, int64_t r) {
  const PushVerdict v = rounds.check_push(s.node_id(), r);
  if (v.ok()) return true;
  const char* reason = v.check == PushCheck::stale ? "stale_round" : "bad_push";
  update_stats([&](CoordinatorStats& st) {
    st.late_pushes += v.check == PushCheck::stale;
    ++st.push_refusals[reason];
  });
  s.fail(v.check == PushCheck::future ? wire::ErrorCode_bad_push : wire::ErrorCode_stale_round, v.reason);
  return false;
}

void Coordinator::Impl::on_push_chunk(Session& s, const wire::PushChunk* m) {
  const int node = s.node_id();
  if (m->node_id() != node) return refuse_push(s, wire::ErrorCode_bad_push, "push for another node id");
  if (!check_round(s, m->round())) return;
  if (!valid_codec(m->codec()) || Codec(m->codec()) != p.codec)
    return refuse_push(s, wire::ErrorCode_codec, "push codec mismatch", "codec");
  const int c = grid.find(m->begin(), m->end());
  if (c < 0 || !rounds.owns(node, c))
    return refuse_push(s, wire::ErrorCode_bad_push, "push range [" + std::to_string(m->begin()) + ", " +
                                                        std::to_string(m->end()) + ") is not a chunk this node owns");
  const GridChunk& ch = grid.chunks[size_t(c)];
  const size_t n_bytes = vec_size(m->payload());
  const uint8_t* payload = n_bytes ? m->payload()->data() : nullptr;
  if (!payload_size_ok(p.codec, payload, n_bytes, ch.size()))
    return refuse_push(s, wire::ErrorCode_bad_push,
                       "push payload of " + std::to_string(n_bytes) + " bytes does not fit a " +
                           codec_name(p.codec) + " chunk of " + std::to_string(ch.size()) + " values");
  if (crc32c(payload, n_bytes) != m->checksum())
    return refuse_push(s, wire::ErrorCode_bad_push, "push chunk checksum mismatch");
  switch (rounds.check_chunk(node, c, m->checksum())) {
    case ChunkCheck::duplicate: return;  // a resend after a reconnect: idempotent
    case ChunkCheck::conflict:
      return refuse_push(s, wire::ErrorCode_bad_push, "resent chunk differs from the first push");
    case ChunkCheck::fresh: break;
  }
  if (!payload_valid(p.codec, payload, ch.size()))
    return refuse_push(s, wire::ErrorCode_bad_push,
                       "node " + std::to_string(node) + ": push for round " + std::to_string(rounds.open_round()) +
                           " holds non-finite values in [" + std::to_string(ch.begin) + ", " +
                           std::to_string(ch.end) + "); refused, the round goes on without this node",
                       "non_finite");
  const float* decoded = nullptr;
  if (!check_finite_update(s, ch, payload, &decoded)) return;
  if (!check_update_bound(s, c, payload, decoded)) return;
  const RoundDecision d = rounds.on_chunk(node, c, m->checksum());
  if (d.arm_timer) arm_timer(*d.arm_timer);
  merge.add(c, payload, decoded);
}

// A push that would make θ non-finite is refused before this chunk reaches the
// merge, and as a whole: refuse_push withdraws what the node pushed so far this
// round (net/streaming_merge), the node is dropped and the round goes on as for a
// missing node. fp32 carries values that payload_valid has found finite, and their
// mean is finite: net/finite_guard.hpp says why. *decoded: the lossy Δ, decoded
// once here for the merge too.
bool Coordinator::Impl::check_finite_update(Session& s, const GridChunk& ch, const uint8_t* payload,
                                            const float** decoded) {
  if (p.codec == Codec::fp32) return true;
  float* v = delta_scratch.data();  // the decoded Δ, one chunk
  decode(p.codec, payload, ch.size(), v, merge_threads);
  *decoded = v;
  state.file->read(Section::theta, ch.begin, ch.size(), theta_scratch.data());
  const int64_t i = first_overflow(theta_scratch.data(), v, ch.size());
  if (i < 0) return true;
  refuse_push(s, wire::ErrorCode_bad_push,
              "node " + std::to_string(s.node_id()) + ": push for round " + std::to_string(rounds.open_round()) +
                  " would make θ non-finite in [" + std::to_string(ch.begin) + ", " + std::to_string(ch.end) +
                  ") (parameter " + std::to_string(ch.begin + i) + "); refused, the round goes on without this node",
              "non_finite");
  return false;
}

// The insider bound (net/update_bound.hpp): the size of the pushed update, RMS of Δ
// in decoded values, against its class's recent accepted sizes. Reads sizes only:
// the merge's arithmetic is untouched. `decoded`: the lossy Δ, decoded (with θ_old of
// the chunk in theta_scratch) by check_finite_update; fp32 carries values.
bool Coordinator::Impl::check_update_bound(Session& s, int c, const uint8_t* payload, const float* decoded) {
  if (!update_bound.rules().on()) return true;
  const GridChunk& ch = grid.chunks[size_t(c)];
  double size = 0;
  if (decoded) {
    size = rms(decoded, ch.size());
  } else {
    state.file->read(Section::theta, ch.begin, ch.size(), theta_scratch.data());
    decode(p.codec, payload, ch.size(), delta_scratch.data(), merge_threads);
    size = rms_diff(delta_scratch.data(), theta_scratch.data(), ch.size());
  }
  const double limit = update_bound.bound(c, update_bound.has_history(c) ? 0.0 : rms(theta_scratch.data(), ch.size()));
  if (size <= limit) {
    update_bound.accept(s.node_id(), c, size, limit);
    return true;
  }
  const std::string why = strprintf(
      "node %d: push for round %" PRId64 " refused: its update of chunk %d [%" PRId64 ", %" PRId64
      ") has size %.4g (RMS of Δ), over the bound %.4g (%s); refused, the round goes on without this node",
      s.node_id(), rounds.open_round(), c, ch.begin, ch.end, size, limit,
      update_bound.has_history(c) ? "update_bound × the median accepted update" : "update_bound_first × RMS of θ");
  log("%s", why.c_str());
  refuse_push(s, wire::ErrorCode_bad_push, why, "update_bound");
  return false;
}

// A bad push is refused as a whole: nothing of it stays in the round's merge.
void Coordinator::Impl::refuse_push(Session& s, wire::ErrorCode code, const std::string& why, const char* reason) {
  merge.withdraw(rounds.refuse_push(s.node_id()));
  stop_asked.erase(s.node_id());
  update_bound.withdraw(s.node_id());
  update_stats([&](CoordinatorStats& st) { ++st.push_refusals[reason]; });
  s.fail(code, why);
}

void Coordinator::Impl::on_push_done(Session& s, const wire::PushDone* m) {
  if (m->node_id() != s.node_id()) return refuse_push(s, wire::ErrorCode_bad_push, "PushDone for another node id");
  if (!check_round(s, m->round())) return;
  if (m->step() != open_round_step())  // its word moves nothing: the schedule owns the step
    log("node %d reports step %" PRId64 " for round %" PRId64 "; by the schedule it is step %" PRId64
        " (sync_steps %" PRId64 "): using the schedule",
        s.node_id(), int64_t(m->step()), rounds.open_round(), open_round_step(), p.sync_steps);
  const RoundDecision d = rounds.on_push_done(s.node_id());
  if (!d.refuse.empty()) return refuse_push(s, wire::ErrorCode_bad_push, d.refuse);
  if (m->stop()) {
    stop_asked.insert(s.node_id());
    log("node %d asks the run to stop: it ends at round %" PRId64 ", every node with a checkpoint of it", s.node_id(),
        rounds.open_round());
  }
  const std::optional<TrainFigures> figures = read_figures(m->figures());
  board.node_pushed(s.node_id(), rounds.open_round(), figures ? &*figures : nullptr, rounds.done_count());
  if (opt.log && progress.terminal())
    progress.update(strprintf("round %lld collecting: %d of %d nodes pushed", (long long)rounds.open_round(),
                              rounds.done_count(), p.n_nodes));
  if (d.close) close_round(*d.close);
}

void Coordinator::Impl::arm_timer(int64_t r) {
  round_timer.expires_after(to_duration(p.round_timeout_s));
  round_timer.async_wait([this, r](boost::system::error_code ec) {
    if (ec) return;
    const RoundDecision d = rounds.on_timer(r);
    if (d.close) close_round(*d.close);
  });
}

// merging (here) → publishing → waiting. The merge reads the completed round's
// state file and writes the next one, which is committed before anything is published.
void Coordinator::Impl::close_round(const RoundClose& rc) {
  round_timer.cancel();
  const auto t0 = Clock::now();
  const int64_t r = rc.round;
  const int64_t step = open_round_step();
  const double alpha = merge_alpha_at(p.merge.alpha, p.merge.interval, p.merge.decay_steps, step);
  auto ms_since = [](Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); };
  const std::unique_ptr<StateWriter> next = persistence.next(r, step);
  const std::vector<bool> changed = merge.close(*state.file, *next, p.layout, alpha, p.merge.topk, p.outer);
  const double mean_ms = ms_since(t0);
  if (merge.outer_skipped() > 0)
    log("round %" PRId64 ": the outer step would not be finite in %" PRId64 " chunk(s); they keep θ and momentum", r,
        merge.outer_skipped());
  const std::shared_ptr<Publication> pub =
      build_publication(p.codec, grid, changed, merge.target(), *state.file, *next, persistence.folder(), r, step,
                        rc.participants, alpha);
  pub->stop = stopping || !stop_asked.empty();
  const double result_ms = ms_since(t0) - mean_ms;
  if (!pub->refused.empty()) {
    const GridChunk& first = grid.chunks[size_t(pub->refused[0])];
    log("round %" PRId64 ": the merged update would make θ non-finite in %zu chunk(s), first [%" PRId64 ", %" PRId64
        "); they keep their value",
        r, pub->refused.size(), first.begin, first.end);
  }
  // Write-ahead: durably on disk before anyone can see the round, so a crash at any
  // instant loses no published round (a failure here stops the coordinator).
  persistence.commit(*next, state);
  archive.keep(r, persistence.path());
  pub->hash = state.hash;
  for (int c : pub->chunks) state.chunk_round[size_t(c)] = r;
  const double merge_ms = ms_since(t0);
  log("round %" PRId64 " merged: step %" PRId64 ", %d participant(s)%s%s, alpha %.4g, %zu of %zu chunks changed, "
      "%.1f ms (mean %.0f, result %.0f, persist %.0f), state %s",
      r, step, rc.participants, rc.missing.empty() ? "" : ", missing ", rc.missing.c_str(), alpha,
      pub->chunks.size(), grid.chunks.size(), merge_ms, mean_ms, result_ms, merge_ms - mean_ms - result_ms,
      hash_hex(state.hash).c_str());
  if (p.on_round) {
    try {
      std::vector<float> theta(size_t(p.layout.total));  // only for the hook (--dump-state), freed at once
      state.file->read(Section::theta, 0, p.layout.total, theta.data());
      p.on_round(theta, r);
    } catch (const std::exception& e) {
      log("round %" PRId64 ": on_round hook failed: %s", r, e.what());
    }
  }

  const std::vector<int> to = rounds.publish(std::to_string(rc.participants) + " recipient(s)");
  round_pushers[r] = node_list(to);
  while (round_pushers.size() > size_t(std::max(2, p.keep_rounds)) + 8) round_pushers.erase(round_pushers.begin());
  pub->bytes += int64_t(kHeaderBytes + 96);  // RoundDone (small), counted with the chunks
  std::vector<std::shared_ptr<Session>> recipients;
  for (int node : to)
    if (auto s = server.node_session(node)) recipients.push_back(std::move(s));
  // The row and the stats first: a node may see its result before this function returns.
  const RoundRecord record{r,
                           step,
                           rc.participants,
                           rc.missing,
                           rc.late_pushes,
                           server.take_round_bytes_in(),
                           pub->bytes * int64_t(recipients.size()),
                           alpha,
                           merge_ms,
                           state.hash};
  const std::string row = csv_row(kRoundColumns, record) + "\n";
  if (opt.csv) {
    *opt.csv << row << std::flush;
    // The round log is output, the state file the run: the run goes on, said once.
    if (!*opt.csv && !csv_failed) {
      csv_failed = true;
      log("round %" PRId64 ": the round CSV on stdout could not be written (file system full, or the reader gone); "
          "later rows are lost, the state file is not affected", r);
    }
  }
  update_stats([&](CoordinatorStats& st) {
    st.round = state.round;
    st.step = state.step;
    st.state_hash = state.hash;
    st.csv_rows += row;
  });
  board.round_closed({r, step, rc.participants, rc.missing, record.late_pushes, record.bytes_in, record.bytes_out,
                      alpha, merge_ms, unix_now()},
                     state.hash, folder_bytes(persistence.folder()));
  update_bound.close_round();
  update_stats([&](CoordinatorStats& st) { st.max_update_ratio = update_bound.max_ratio(); });
  std::shared_ptr<const Publication> cpub = pub;
  for (const auto& s : recipients) s->enqueue_publication(cpub);
  // The nodes connected now that did not push to the round miss its result (a node
  // already gone is not waited for: it resumes behind, as after any lost round).
  stop_round = pub->stop ? r : -1;
  stop_missed.clear();
  if (pub->stop) {
    log("round %" PRId64 " ends the run (asked by %s): its nodes stop with a checkpoint of it; resuming them "
        "(--resume) continues the run",
        r, stopping ? "a signal to the coordinator" : ("node " + node_list(stop_asked)).c_str());
    for (int node = 0; node < p.n_nodes; ++node)
      if (std::find(to.begin(), to.end(), node) == to.end() && server.node_session(node)) stop_missed.insert(node);
  }
  stop_asked.clear();
  merge.begin_round();
  rounds.next_round();
  if (opt.log && progress.terminal())
    progress.update(strprintf("round %lld published to %zu node(s), %.1f MB out; waiting for round %lld",
                              (long long)r, recipients.size(), double(pub->bytes * int64_t(recipients.size())) / 1e6,
                              (long long)rounds.open_round()),
                    true);
}

void Coordinator::Impl::shutdown() {
  if (stopped) return;
  stopped = true;
  int64_t refused = 0;
  for (const auto& [reason, n] : stats_.push_refusals) refused += n;  // this thread writes them: no lock to read
  log("stopping at round %" PRId64 " (state %s); %" PRId64 " push(es) refused, largest accepted update / bound %.3g",
      state.round, hash_hex(state.hash).c_str(), refused, update_bound.max_ratio());
  round_timer.cancel();
  stop_grace.cancel();
  boost::system::error_code ec;
  if (signals) signals->cancel(ec);
  server.stop();
  io.stop();
}

Coordinator::Coordinator(CoordinatorParams params, CoordinatorOptions opt)
    : impl_(std::make_unique<Impl>(std::move(params), std::move(opt))) {}

Coordinator::~Coordinator() = default;

uint16_t Coordinator::port() const { return impl_->bound.port(); }

uint16_t Coordinator::status_port() const { return impl_->status ? impl_->status->port() : 0; }

// The first SIGINT / SIGTERM stops the run at a round: with nodes connected, the next
// round published ends it (each node stops with a checkpoint of it and leaves) and
// the coordinator exits once the last node has left (exit_when_told); with none, at
// once, unless nodes missed the round that ended the run. A second signal stops it at
// once. Every published round is on disk either way.
void Coordinator::Impl::on_signal(int sig) {
  if (stopping || (members == 0 && stop_missed.empty())) {
    log("%s: stopping now", strsignal(sig));
    return shutdown();
  }
  stopping = true;
  if (members > 0)
    log("%s: the run stops at round %" PRId64 " (the next one published): every node stops with a checkpoint of "
        "it, then the coordinator; a second signal stops the coordinator now",
        strsignal(sig), rounds.open_round());
  else
    log("%s: stopping once the nodes that missed round %" PRId64 " took its snapshot; a second signal stops the "
        "coordinator now",
        strsignal(sig), stop_round);
  wait_for_signal();
  if (members == 0) exit_when_told();
}

// A signalled coordinator with no node left exits, unless nodes of the run missed the
// round that ended it: a node whose push came after that round closed is refused
// (stale round), leaves and comes straight back for its snapshot, which tells it to
// stop. So it waits stop_grace_s for them, from the moment no node is left.
void Coordinator::Impl::exit_when_told() {
  if (stopped || members > 0) return;
  if (stop_missed.empty()) return shutdown();  // (set only with a stop round)
  log("waiting up to %.0f s for node %s, which missed round %" PRId64 " (it ended the run), to take its snapshot",
      opt.stop_grace_s, node_list(stop_missed).c_str(), stop_round);
  stop_grace.expires_after(to_duration(opt.stop_grace_s));
  stop_grace.async_wait([this](boost::system::error_code ec) {
    if (ec || stopped || members > 0) return;
    log("node %s did not come back for round %" PRId64 "; stopping without it (it resumes behind the run)",
        node_list(stop_missed).c_str(), stop_round);
    shutdown();
  });
}

void Coordinator::Impl::wait_for_signal() {
  signals->async_wait([this](boost::system::error_code ec, int sig) {
    if (!ec) on_signal(sig);
  });
}

void Coordinator::run() {
  Impl& I = *impl_;
  if (I.opt.handle_signals) {
    I.signals = std::make_unique<asio::signal_set>(I.io, SIGINT, SIGTERM);
    I.wait_for_signal();
  }
  I.server.start();
  I.io.run();
}

void Coordinator::stop() {
  asio::post(impl_->io, [this] { impl_->shutdown(); });
}

CoordinatorStats Coordinator::stats() const {
  CoordinatorStats st;
  {
    std::lock_guard<std::mutex> lk(impl_->stats_mu);
    st = impl_->stats_;
  }
  const SessionCounters& c = impl_->server.counters();
  st.connections = c.connections;
  st.live_sessions = c.live_sessions;
  st.refused = c.refused;
  st.busy = c.busy;
  st.dropped = c.dropped;
  st.snapshots = c.snapshots;
  st.bytes_in = c.bytes_in;
  st.bytes_out = c.bytes_out;
  return st;
}

std::string Coordinator::csv_header() { return spes::csv_header(kRoundColumns); }

std::string Coordinator::csv_reference_markdown() { return spes::csv_reference_markdown(kRoundColumns); }

}  // namespace spes::net
