// The node side of a sync round (see sync_client.hpp), put together from its parts:
//
//   node_state      the round the node holds, and the coordinator's grid
//   node_link       the connection: TCP, TLS, frames, deadlines, heartbeats while waiting
//   node_heartbeat  heartbeats between rounds
//   node_handshake  Challenge → Hello → Welcome
//   node_push       Δ encoded and pushed in grid chunks
//   node_result     the round's result applied, hashed and checked
//   node_snapshot   the coordinator's θ, when the node is behind
//   node_retry      what a failed attempt means for the next; backoff
//
// Here: a round with its retries, overlapped rounds, and the checkpointed state.
#include "net/sync_client.hpp"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include "engine/base/error.hpp"
#include "net/address.hpp"
#include "net/line_log.hpp"
#include "net/node_handshake.hpp"
#include "net/node_heartbeat.hpp"
#include "net/node_link.hpp"
#include "net/node_push.hpp"
#include "net/node_result.hpp"
#include "net/node_retry.hpp"
#include "net/node_snapshot.hpp"
#include "net/node_state.hpp"

namespace spes::net {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

SyncClientOptions with_defaults(SyncClientOptions o, double round_timeout_s) {
  if (o.io_timeout_s <= 0) o.io_timeout_s = std::max(60.0, round_timeout_s + 120.0);
  if (o.threads <= 0) o.threads = int(std::max(1u, std::thread::hardware_concurrency()));
  return o;
}

std::string node_name(const SyncClientParams& p) { return "node " + std::to_string(p.node_id); }

// Overlapped rounds: θ ← θ_global + (θ − θ_pushed) over the owned ranges (the local
// progress since the push is kept: θ_pushed stood in for the round's result, and is
// corrected), θ ← θ_global elsewhere. Two exactness rules: a parameter not trained
// since the push becomes θ_global itself, and one whose θ_global is its pushed value
// keeps its own (so one node owning every parameter, fp32, trains exactly as alone).
void keep_local_progress(float* params, const float* global, const std::vector<float>& pushed,
                         const OwnedSpace& space, int64_t total) {
  int64_t at = 0;
  for (const OwnedSegment& s : space.segments()) {
    std::memcpy(params + at, global + at, size_t(s.flat.begin - at) * 4);
    const float* p = pushed.data() + s.packed_begin;
    for (int64_t i = 0; i < s.flat.size(); ++i) {
      float& x = params[s.flat.begin + i];
      const float g = global[s.flat.begin + i];
      if (std::memcmp(&x, &p[i], 4) == 0) x = g;
      else if (std::memcmp(&g, &p[i], 4) != 0) x = g + (x - p[i]);
    }
    at = s.flat.end;
  }
  std::memcpy(params + at, global + at, size_t(total - at) * 4);
}

}  // namespace

struct SyncClient::Impl {
  SyncClientParams node;  // initial_params cleared after the constructor
  const SyncClientOptions opt;
  LineLog log;
  NodeLink link;
  HeldRound held;
  NodeGrid grid;
  int64_t coordinator_round = 0;  // its completed round, from its last Welcome
  int64_t rolled_back_to = -1;    // from its last Welcome
  bool in_sync = false;           // the connection's node holds the coordinator's round (else: snapshot first)
  PushPipeline pusher{link, node, opt.threads};
  ResultReceiver results{link, node, opt.threads, log};
  SnapshotReceiver snapshots{link, node, log};
  RoundRetry retry{opt, node.node_id, link.coordinator(), log};

  // The link's users take turns: sync_round (throughout), restore, disconnect and
  // the idle heartbeat, whose thread starts last, once everything above exists.
  std::mutex turn;
  IdleHeartbeat heartbeat{link, turn, log};

  // Overlapped rounds (start_round / finish_round).
  std::vector<float> inflight;  // θ as pushed, then θ_global of that round
  std::vector<float> pushed;    // owned space: θ as pushed
  std::thread inflight_thread;
  RoundReport inflight_report;
  std::exception_ptr inflight_error;

  Impl(const SyncClientParams& params, SyncClientOptions op)
      : node(params),
        opt(with_defaults(std::move(op), params.round_timeout_s)),
        log("[node " + std::to_string(params.node_id) + "]", opt.log),
        link(parse_host_port(node.coordinator), node.tls, opt.connect_timeout_s, opt.io_timeout_s) {
    if (int64_t(node.initial_params.size()) != node.layout.total)
      throw NetError(node_name(node) + ": initial θ has " + std::to_string(node.initial_params.size()) +
                     " values, the layout " + std::to_string(node.layout.total));
    check_secret(node.secret, node_name(node));
    check_insecure(node_name(node) + ": coordinator", link.coordinator().host, !node.secret.empty(), node.tls.on(),
                   node.allow_insecure);
    held.base.resize(size_t(node.space.size()));
    node.space.gather(node.initial_params.data(), held.base.data());
    node.initial_params = {};
    if (codec_is_lossy(node.codec)) {
      held.residual.assign(held.base.size(), 0.0f);
      held.pending.assign(held.base.size(), 0.0f);
    }
  }

  // One round: attempts until one completes (a push and its result, or a snapshot).
  RoundReport sync_round(float* params, int64_t step, const TrainFigures& figures, bool ask_stop) {
    const auto t0 = Clock::now();
    RoundReport report;
    link.reset_counters();
    retrying([&] { attempt(params, step, figures, ask_stop, report); });
    report.ms = ms_since(t0);
    report.bytes_up = link.bytes_up();
    report.bytes_down = link.bytes_down();
    return report;
  }

  // Runs `try_once` until it completes, each failed attempt closing the connection
  // and retried as node_retry says (for up to retry_for_s).
  template <class F>
  void retrying(F&& try_once) {
    retry.begin_round();
    for (;;) {
      try {
        return try_once();
      } catch (const Refused& e) {
        link.disconnect();
        retry.after(e);
      } catch (const Transient& e) {
        link.disconnect();
        retry.after(e);
      }
    }
  }

  // A node that is not in sync after connecting takes a snapshot instead of pushing.
  void attempt(float* params, int64_t step, const TrainFigures& figures, bool ask_stop, RoundReport& report) {
    if (!link.connected()) in_sync = connect(params);
    if (!in_sync) {
      snapshots.resync(grid, coordinator_round, held, params, report, rolled_back_to);
      in_sync = true;
      return;
    }
    const auto t_push = Clock::now();
    pusher.push(grid, held, params, step, figures, ask_stop);
    report.push_ms = ms_since(t_push);
    results.receive(grid, held, params, report);
  }

  // Connects and authenticates; returns whether the node is in sync.
  bool connect(const float* params) {
    link.open();
    const uint64_t hash = held.force_snapshot ? 0 : held_state_hash(held, node.space, params, node.layout.total);
    const Welcome w = handshake(link, node, held.round, hash);
    grid.use_chunk_elems(node.layout, node.n_experts, node.space, w.chunk_elems);
    coordinator_round = w.coordinator_round;
    rolled_back_to = w.rolled_back_to;
    link.authenticated(w.frame_key ? &*w.frame_key : nullptr);
    const bool in_sync = w.in_sync && !held.force_snapshot;
    log("connected to %s:%u (coordinator round %" PRId64 ", ours %" PRId64 ", %s)", link.coordinator().host.c_str(),
        unsigned(link.coordinator().port), w.coordinator_round, held.round, in_sync ? "in sync" : "snapshot needed");
    // Behind the run: a node resumed from a checkpoint older than the coordinator's
    // round (killed between two checkpoints), or one that missed rounds. It goes on
    // from the coordinator's θ; the rounds between are not replayed.
    if (held.round > 0 && w.coordinator_round > held.round)
      log("note: this node holds round %" PRId64 ", the coordinator %" PRId64 ": the node goes on from the "
          "coordinator's θ, and the run no longer matches one without the stop; after a resume from an older "
          "checkpoint, restarting the coordinator with --rollback-to %" PRId64 " replays those rounds exactly "
          "(if it still keeps that round)",
          held.round, w.coordinator_round, held.round);
    return in_sync;
  }
};

SyncClient::SyncClient(const SyncClientParams& params, SyncClientOptions opt)
    : impl_(std::make_unique<Impl>(params, std::move(opt))) {}

SyncClient::~SyncClient() {
  if (impl_->inflight_thread.joinable()) impl_->inflight_thread.join();
}

RoundReport SyncClient::sync_round(float* params, int64_t step, const TrainFigures& figures, bool ask_stop) {
  std::lock_guard<std::mutex> lk(impl_->turn);
  return impl_->sync_round(params, step, figures, ask_stop);
}

void SyncClient::start_round(const float* params, int64_t step, const TrainFigures& figures, bool ask_stop) {
  Impl& I = *impl_;
  if (I.inflight_thread.joinable()) throw NetError("internal: a sync round is already in flight");
  I.inflight.assign(params, params + I.node.layout.total);
  I.pushed.resize(size_t(I.node.space.size()));
  I.node.space.gather(params, I.pushed.data());
  I.inflight_error = nullptr;
  // The round holds the link's turn as sync_round does: otherwise the idle heartbeat
  // thread could write on the socket while the round does.
  I.inflight_thread = std::thread([&I, step, figures, ask_stop] {
    try {
      std::lock_guard<std::mutex> lk(I.turn);
      I.inflight_report = I.sync_round(I.inflight.data(), step, figures, ask_stop);
    } catch (...) {
      I.inflight_error = std::current_exception();
    }
  });
}

bool SyncClient::join(const float* params, const std::function<bool()>& give_up) {
  Impl& I = *impl_;
  std::lock_guard<std::mutex> lk(I.turn);
  bool first = true, gave_up = false;
  I.retrying([&] {
    if (!first && give_up && give_up()) {
      gave_up = true;
      return;
    }
    first = false;
    if (!I.link.connected()) I.in_sync = I.connect(params);
  });
  return !gave_up;
}

bool SyncClient::round_in_flight() const { return impl_->inflight_thread.joinable(); }

RoundReport SyncClient::finish_round(float* params) {
  Impl& I = *impl_;
  I.inflight_thread.join();
  if (I.inflight_error) std::rethrow_exception(std::exchange(I.inflight_error, nullptr));
  if (I.inflight_report.resynced)  // a snapshot replaced θ: the local work is dropped
    std::memcpy(params, I.inflight.data(), size_t(I.node.layout.total) * 4);
  else
    keep_local_progress(params, I.inflight.data(), I.pushed, I.node.space, I.node.layout.total);
  return I.inflight_report;
}

bool SyncClient::report_bad_round(int64_t round, const std::string& why) {
  Impl& I = *impl_;
  std::lock_guard<std::mutex> lk(I.turn);
  try {
    if (!I.link.connected()) {
      I.link.open();
      const Welcome w = handshake(I.link, I.node, I.held.round, 0);
      I.link.authenticated(w.frame_key ? &*w.frame_key : nullptr);
    }
    I.link.write(FrameWriter(256 + why.size()).bad_round(round, I.node.node_id, why));
    I.link.disconnect();
    return true;
  } catch (const std::exception& e) {
    I.log("could not report round %" PRId64 " to the coordinator: %s", round, e.what());
    I.link.disconnect();
    return false;
  }
}

SyncState SyncClient::state() const { return {impl_->held.round, impl_->held.base, impl_->held.residual}; }

void SyncClient::restore(const SyncState& s) {
  Impl& I = *impl_;
  std::lock_guard<std::mutex> lk(I.turn);
  I.link.disconnect();
  HeldRound& held = I.held;
  held.force_snapshot = false;
  held.round = s.round;
  if (!s.base.empty()) {
    if (int64_t(s.base.size()) != I.node.space.size())
      throw NetError("saved sync base has " + std::to_string(s.base.size()) + " values, node owns " +
                     std::to_string(I.node.space.size()));
    held.base = s.base;
  }
  if (codec_is_lossy(I.node.codec)) {
    if (s.residual.size() == held.base.size()) held.residual = s.residual;
    else std::fill(held.residual.begin(), held.residual.end(), 0.0f);
  }
}

void SyncClient::disconnect() {
  std::lock_guard<std::mutex> lk(impl_->turn);
  impl_->link.disconnect();
}

}  // namespace spes::net
