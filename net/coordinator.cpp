#include "net/coordinator.hpp"
#include "engine/base/log.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <utility>

#include <boost/asio.hpp>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <set>
#include <sstream>

#include "engine/base/error.hpp"
#include "model/layout.hpp"
#include "net/asio_util.hpp"
#include "net/codec.hpp"
#include "net/digest.hpp"
#include "net/frame.hpp"
#include "net/grid.hpp"
#include "net/streaming_merge.hpp"
#include "model/expert_merge.hpp"
#include "engine/base/parallel.hpp"
#include "net/state_file.hpp"

namespace spes::net {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

enum class Phase { waiting, collecting, merging, publishing };
const char* phase_name(Phase p) {
  switch (p) {
    case Phase::waiting: return "waiting";
    case Phase::collecting: return "collecting";
    case Phase::merging: return "merging";
    case Phase::publishing: return "publishing";
  }
  return "?";
}

// One round's result as it goes to every node that pushed: the changed grid
// chunks (lossy codecs: pre-encoded frames shared by all recipients; fp32: built
// from θ on the fly, which holds exactly the new values until the next round).
struct Publication {
  int64_t round = 0, step = 0;
  uint64_t hash = 0;
  int participants = 0;
  double alpha = 0;
  std::vector<int> chunks;
  std::vector<OwnedFrame> frames;
  int64_t bytes = 0;  // all frames of the result, RoundDone included
};

struct OutJob {
  enum Kind { frame, publication, snapshot } kind = frame;
  OwnedFrame owned;                         // kind frame
  std::shared_ptr<const Publication> pub;   // kind publication
  int64_t theta_round = 0;                  // θ must still be this round's (fp32 and snapshots)
  size_t next = 0;                          // frames of the job sent so far
  bool cut = false;                         // drop the rest once the frame in flight is written
};

}  // namespace

struct Coordinator::Impl {
  struct Session;

  CoordinatorParams p;
  CoordinatorOptions opt;
  const ParamLayout& layout = p.layout;
  Codec codec;
  int n_nodes;
  int min_nodes;
  std::vector<uint64_t> fingerprints;           // per node id
  ChunkGrid grid;
  std::vector<std::vector<int>> node_chunks;    // owned grid chunks per node
  std::vector<std::vector<uint8_t>> node_owns;  // per node, per chunk
  std::string secret;

  std::vector<float> theta;
  std::vector<float> down_residual;  // lossy codecs: what the download has not carried yet
  std::unique_ptr<StreamingMerge> merge;
  int64_t round = 0, step = 0;
  uint64_t hash = 0;
  int64_t persisted_round = -1;

  Phase phase = Phase::waiting;
  struct NodeRound {
    std::vector<uint8_t> got;
    std::vector<uint32_t> crc;
    int got_n = 0;
    bool done = false;
    int64_t step = 0;
  };
  std::vector<NodeRound> nodes;
  bool timed_out = false;
  int64_t round_bytes_in = 0, round_late = 0;

  asio::io_context io;
  tcp::acceptor acceptor{io};
  tcp::endpoint bound;  // read by other threads (port(), bind_address()): set once in the constructor
  asio::steady_timer round_timer{io};
  std::unique_ptr<asio::signal_set> signals;
  std::set<std::shared_ptr<Session>> sessions;
  std::vector<std::weak_ptr<Session>> node_session;
  std::vector<float> scratch;
  std::vector<uint8_t> enc_scratch;
  bool stopped = false;

  mutable std::mutex stats_mu;
  CoordinatorStats stats_;
  int64_t refusal_logs = 0;

  Impl(CoordinatorParams params, CoordinatorOptions o);
  void log(const char* fmt, ...) const __attribute__((format(printf, 2, 3)));
  void set_phase(Phase p, int64_t r, const std::string& why);
  void accept();
  void on_push_chunk(Session& s, const wire::PushChunk* m);
  void on_push_done(Session& s, const wire::PushDone* m);
  bool check_push_round(Session& s, int64_t r);
  void maybe_close();
  void close_round(const std::string& why);
  void persist();
  void shutdown();
  void refused(const std::string& who, const std::string& reason);
  template <class F>
  void update_stats(F&& f) {
    std::lock_guard<std::mutex> lk(stats_mu);
    f(stats_);
  }
};

// ---- one connection ----------------------------------------------------------

struct Coordinator::Impl::Session : std::enable_shared_from_this<Session> {
  Impl& co;
  tcp::socket sock;
  std::string peer;
  enum class State { handshake, ready, closing, closed } state = State::handshake;
  int node_id = -1;
  std::array<uint8_t, kNonceBytes> nonce{};
  std::array<uint8_t, kHeaderBytes> hdr{};
  FrameHeader header;
  RecvBuffer payload;
  FrameWriter writer;
  std::deque<OutJob> outq;
  bool writing = false;
  bool snapshot_queued = false;
  int64_t awaiting = 0;       // round whose result this node waits for (0 = none)
  int64_t synced_round = -1;  // round whose θ this node holds (or is being sent); -1 = unknown
  asio::steady_timer hello_timer;

  Session(Impl& c, tcp::socket s) : co(c), sock(std::move(s)), writer(64 * 1024), hello_timer(c.io) {
    boost::system::error_code ec;
    auto ep = sock.remote_endpoint(ec);
    peer = ec ? "?" : ep.address().to_string() + ":" + std::to_string(ep.port());
  }

  std::string who() const { return node_id >= 0 ? "node " + std::to_string(node_id) + " (" + peer + ")" : peer; }

  void start() {
    tune_socket(sock);
    random_bytes(nonce.data(), nonce.size());
    send(own(writer.challenge(nonce)));
    hello_timer.expires_after(to_duration(co.opt.hello_timeout_s));
    hello_timer.async_wait([self = shared_from_this()](boost::system::error_code e) {
      if (!e && self->state == State::handshake) self->fail(wire::ErrorCode_timeout, "no Hello in time");
    });
    read_header();
  }

  uint32_t cap() const { return state == State::handshake ? kMaxHandshakeFrameBytes : kMaxFrameBytes; }

  void read_header() {
    asio::async_read(sock, asio::buffer(hdr), [self = shared_from_this()](boost::system::error_code ec, size_t) {
      self->on_header(ec);
    });
  }

  void on_header(boost::system::error_code ec) {
    if (state == State::closing || state == State::closed) return;
    if (ec) return read_failed(ec, false);
    co.round_bytes_in += kHeaderBytes;
    const HeaderCheck hc = parse_header(hdr.data(), cap(), &header);
    if (hc != HeaderCheck::ok) {
      // Refused before anything is allocated for the payload.
      return fail(hc == HeaderCheck::bad_version ? wire::ErrorCode_protocol_version : wire::ErrorCode_bad_frame,
                  header_problem(hc, header, cap()));
    }
    asio::async_read(sock, asio::buffer(payload.take(header.length), header.length), [self = shared_from_this()](boost::system::error_code e, size_t) {
      self->on_payload(e);
    });
  }

  void on_payload(boost::system::error_code ec) {
    if (state == State::closing || state == State::closed) return;
    if (ec) return read_failed(ec, true);
    co.round_bytes_in += header.length;
    co.update_stats([&](CoordinatorStats& s) { s.bytes_in += kHeaderBytes + header.length; });
    std::string why;
    const wire::Envelope* env = open_payload(payload.data(), payload.size(), header.crc, &why);
    if (!env) return fail(wire::ErrorCode_bad_frame, why);
    dispatch(env);
    if (state == State::handshake || state == State::ready) read_header();
  }

  void read_failed(boost::system::error_code ec, bool mid_frame) {
    if (ec == asio::error::operation_aborted) {
    } else if (mid_frame || state == State::handshake) {
      // A truncated frame, or a peer that left before authenticating.
      co.refused(who(), mid_frame ? "connection lost in the middle of a frame" : "connection closed before Hello");
    } else {
      co.log("%s disconnected (%s)", who().c_str(), ec.message().c_str());
    }
    close();
  }

  void dispatch(const wire::Envelope* env) {
    if (state == State::handshake) {
      if (env->msg_type() != wire::Message_Hello) return fail(wire::ErrorCode_unexpected, "expected Hello");
      return on_hello(env->msg_as_Hello());
    }
    switch (env->msg_type()) {
      case wire::Message_PushChunk: return co.on_push_chunk(*this, env->msg_as_PushChunk());
      case wire::Message_PushDone: return co.on_push_done(*this, env->msg_as_PushDone());
      case wire::Message_SnapshotRequest:
        if (snapshot_queued) return fail(wire::ErrorCode_unexpected, "snapshot already in progress");
        snapshot_queued = true;
        synced_round = co.round;
        co.update_stats([](CoordinatorStats& s) { ++s.snapshots; });
        co.log("%s: sending a snapshot of round %" PRId64, who().c_str(), co.round);
        {
          OutJob j;
          j.kind = OutJob::snapshot;
          j.theta_round = co.round;
          outq.push_back(std::move(j));
          pump();
        }
        return;
      default:
        return fail(wire::ErrorCode_unexpected, "unexpected message in this state");
    }
  }

  void on_hello(const wire::Hello* h) {
    if (h->protocol_version() != kProtocolVersion)
      return fail(wire::ErrorCode_protocol_version,
                  "protocol version mismatch: coordinator speaks " + std::to_string(kProtocolVersion) +
                      ", node sent " + std::to_string(h->protocol_version()));
    const auto run_id = str_view(h->run_id());
    if (run_id.size() > kMaxRunIdBytes || vec_size(h->proof()) != kProofBytes ||
        vec_size(h->node_nonce()) != kNonceBytes)
      return fail(wire::ErrorCode_bad_frame, "Hello fields out of bounds");
    const auto expect = hmac_sha256(co.secret, hello_proof_message(nonce, run_id, h->node_id(), h->fingerprint()));
    if (!digest_equal(expect, std::span<const uint8_t>(h->proof()->data(), kProofBytes)))
      return fail(wire::ErrorCode_auth, "authentication failed: the HMAC proof does not match the coordinator's secret");
    if (run_id != co.p.run_id)
      return fail(wire::ErrorCode_run_id, "run id mismatch: coordinator runs '" + co.p.run_id +
                                              "', node sent '" + std::string(run_id) + "'");
    const int id = h->node_id();
    if (id < 0 || id >= co.n_nodes)
      return fail(wire::ErrorCode_bad_node, "node id " + std::to_string(id) + " outside this run's 0.." +
                                                std::to_string(co.n_nodes - 1));
    if (h->fingerprint() != co.fingerprints[id])
      return fail(wire::ErrorCode_fingerprint,
                  "model fingerprint mismatch: coordinator " + hash_hex(co.fingerprints[id]) + ", node " +
                      hash_hex(h->fingerprint()) + " (different model config, layout or ownership)");
    if (!valid_codec(h->codec()) || Codec(h->codec()) != co.codec)
      return fail(wire::ErrorCode_codec, std::string("codec mismatch: coordinator uses ") + codec_name(co.codec) +
                                             ", node sent " +
                                             (valid_codec(h->codec()) ? codec_name(Codec(h->codec())) : "unknown"));
    if (auto other = co.node_session[id].lock(); other && other->state == State::ready)
      return fail(wire::ErrorCode_duplicate_node, "node " + std::to_string(id) + " is already connected");
    node_id = id;
    state = State::ready;
    hello_timer.cancel();
    co.node_session[id] = shared_from_this();
    WelcomeFields w;
    w.round = co.round;
    w.step = co.step;
    w.state_hash = co.hash;
    w.in_sync = h->sync_round() == co.round && h->state_hash() == co.hash;
    synced_round = w.in_sync ? co.round : -1;
    w.chunk_elems = uint32_t(co.grid.chunk_elems);
    w.n_nodes = co.n_nodes;
    w.proof = hmac_sha256(co.secret, welcome_proof_message(std::span<const uint8_t>(h->node_nonce()->data(), kNonceBytes), nonce));
    co.log("%s joined (its round %" PRId64 ", coordinator round %" PRId64 ", %s)", who().c_str(), h->sync_round(),
           co.round, w.in_sync ? "in sync" : "needs a snapshot");
    send(own(writer.welcome(w)));
  }

  void send(OwnedFrame f) {
    OutJob j;
    j.kind = OutJob::frame;
    j.owned = std::move(f);
    outq.push_back(std::move(j));
    pump();
  }

  void enqueue_publication(std::shared_ptr<const Publication> pub) {
    OutJob j;
    j.kind = OutJob::publication;
    j.pub = std::move(pub);
    j.theta_round = co.round;
    outq.push_back(std::move(j));
    pump();
  }

  // Refuses with a plain reason, then closes once the Error frame is written.
  void fail(wire::ErrorCode code, const std::string& reason) {
    if (state == State::closing || state == State::closed) return;
    if (code == wire::ErrorCode_stale_round) {
      co.update_stats([](CoordinatorStats& st) { ++st.refused; });
      co.log("%s: %s", who().c_str(), reason.c_str());
    } else {
      co.refused(who(), reason);
    }
    // Nothing more after the Error; a frame already in flight is finished first.
    if (writing && !outq.empty()) {
      outq.erase(outq.begin() + 1, outq.end());
      outq.front().cut = true;
    } else {
      outq.clear();
    }
    OutJob j;
    j.kind = OutJob::frame;
    j.owned = own(writer.error(code, reason));
    outq.push_back(std::move(j));
    state = State::closing;
    hello_timer.cancel();
    boost::system::error_code ec;
    sock.shutdown(tcp::socket::shutdown_receive, ec);
    pump();
  }

  // The next frame of the job at the head of the queue, or false when it is done.
  bool next_frame(OutJob& j, FrameView* v) {
    switch (j.kind) {
      case OutJob::frame:
        if (j.next > 0) return false;
        v->header = j.owned.bytes.data();
        v->body = j.owned.bytes.data() + kHeaderBytes;
        v->body_size = j.owned.bytes.size() - kHeaderBytes;
        return true;
      case OutJob::publication: {
        const Publication& p = *j.pub;
        if (j.next < p.chunks.size()) {
          if (!p.frames.empty()) {
            const OwnedFrame& f = p.frames[j.next];
            v->header = f.bytes.data();
            v->body = f.bytes.data() + kHeaderBytes;
            v->body_size = f.bytes.size() - kHeaderBytes;
            return true;
          }
          const GridChunk& c = co.grid.chunks[p.chunks[j.next]];
          ChunkTag t{p.round, p.step, 0, c.begin, c.end, Codec::fp32};
          const float* src = co.theta.data() + c.begin;
          *v = writer.round_chunk(t, size_t(c.size()) * 4,
                                  [&](uint8_t* dst) { std::memcpy(dst, src, size_t(c.size()) * 4); });
          return true;
        }
        if (j.next == p.chunks.size()) {
          *v = writer.round_done(p.round, p.step, uint32_t(p.chunks.size()), p.hash, p.participants, p.alpha);
          return true;
        }
        return false;
      }
      case OutJob::snapshot: {
        if (j.next < co.grid.chunks.size()) {
          const GridChunk& c = co.grid.chunks[j.next];
          const float* src = co.theta.data() + c.begin;
          *v = writer.snapshot_chunk(co.round, c.begin, c.end,
                                     [&](uint8_t* dst) { std::memcpy(dst, src, size_t(c.size()) * 4); });
          return true;
        }
        if (j.next == co.grid.chunks.size()) {
          *v = writer.snapshot_done(co.round, co.step, uint32_t(co.grid.chunks.size()), co.hash);
          return true;
        }
        return false;
      }
    }
    return false;
  }

  void pump() {
    if (writing || state == State::closed) return;
    while (!outq.empty()) {
      OutJob& j = outq.front();
      // fp32 results and snapshots are read from θ: if a round closed since the job
      // started, this node is behind and must resync.
      const bool reads_theta = j.kind == OutJob::snapshot || (j.kind == OutJob::publication && j.pub->frames.empty());
      if (reads_theta && j.theta_round != co.round && state != State::closing) {
        outq.pop_front();
        if (j.kind == OutJob::snapshot) snapshot_queued = false;
        fail(wire::ErrorCode_stale_round, "stale round: round " + std::to_string(co.round) +
                                              " closed while sending; resync from a snapshot");
        return;
      }
      FrameView v;
      if (!next_frame(j, &v)) {
        if (j.kind == OutJob::snapshot) snapshot_queued = false;
        outq.pop_front();
        continue;
      }
      writing = true;
      const size_t bytes = v.size();
      std::array<asio::const_buffer, 2> bufs{asio::buffer(v.header, kHeaderBytes), asio::buffer(v.body, v.body_size)};
      asio::async_write(sock, bufs, [self = shared_from_this(), bytes](boost::system::error_code ec, size_t) {
        self->writing = false;
        if (ec) {
          if (self->state != State::closing && self->state != State::closed && ec != asio::error::operation_aborted)
            self->co.log("%s: send failed (%s)", self->who().c_str(), ec.message().c_str());
          return self->close();
        }
        self->co.update_stats([&](CoordinatorStats& s) { s.bytes_out += int64_t(bytes); });
        if (!self->outq.empty()) {
          ++self->outq.front().next;
          if (self->outq.front().cut) self->outq.pop_front();
        }
        self->pump();
      });
      return;
    }
    if (state == State::closing) close();
  }

  void close() {
    if (state == State::closed) return;
    state = State::closed;
    hello_timer.cancel();
    boost::system::error_code ec;
    sock.shutdown(tcp::socket::shutdown_both, ec);
    sock.close(ec);
    outq.clear();
    auto self = shared_from_this();
    co.sessions.erase(self);
    co.update_stats([&](CoordinatorStats& s) { s.live_sessions = int64_t(co.sessions.size()); });
  }
};

// ---- the coordinator ------------------------------------------------------------

Coordinator::Impl::Impl(CoordinatorParams params, CoordinatorOptions o) : p(std::move(params)), opt(std::move(o)) {
  codec = p.codec;
  n_nodes = p.n_nodes;
  if (n_nodes < 1) throw NetError("coordinator: n_nodes must be ≥ 1");
  if (int(p.nodes.size()) != n_nodes)
    throw NetError("coordinator: " + std::to_string(p.nodes.size()) + " node descriptions for " +
                   std::to_string(n_nodes) + " nodes");
  min_nodes = int(std::clamp<int64_t>(p.min_nodes, 1, n_nodes));
  if (opt.chunk_elems < kInt8Block || opt.chunk_elems > kMaxChunkElems || opt.chunk_elems % kInt8Block)
    throw NetError("chunk_elems must be a multiple of " + std::to_string(kInt8Block) + " in [" +
                   std::to_string(kInt8Block) + ", " + std::to_string(kMaxChunkElems) + "]");
  grid = make_grid(layout, p.n_experts, opt.chunk_elems);
  for (const CoordinatorNode& node : p.nodes) {
    fingerprints.push_back(node.fingerprint);
    std::vector<int> chunks;
    std::vector<uint8_t> owns(grid.chunks.size(), 0);
    for (const Range& r : node.space.ranges())
      for (int ch : grid.chunks_in(r)) chunks.push_back(ch), owns[ch] = 1;
    node_chunks.push_back(std::move(chunks));
    node_owns.push_back(std::move(owns));
  }
  secret = p.secret;
  if (opt.max_connections <= 0) opt.max_connections = 4 * n_nodes + 16;

  // θ: the persisted state of this run when there is one, else the seeded init.
  theta.resize(size_t(layout.total));
  const std::string state_path = (std::filesystem::path(p.state_dir) / "state.bin").string();
  PersistedState ps;
  if (opt.fresh && std::filesystem::exists(state_path))
    log("--fresh: ignoring the persisted state in %s (it is overwritten at the first persist)", state_path.c_str());
  if (!opt.fresh && std::filesystem::exists(state_path)) {
    ps = load_state_file(state_path, theta, codec_is_lossy(codec) ? &down_residual : nullptr);
    if (ps.run_id != p.run_id)
      throw NetError(state_path + " belongs to run '" + ps.run_id + "', not '" + p.run_id +
                     "' (use another state_dir or run_id)");
    if (ps.fingerprint != fingerprints[0])
      throw NetError(state_path + " holds a different model (fingerprint " + hash_hex(ps.fingerprint) + " vs " +
                     hash_hex(fingerprints[0]) + ")");
    round = ps.round;
    step = ps.step;
    persisted_round = round;
    hash = state_hash(theta.data(), layout.total);
    if (hash != ps.state_hash) throw NetError(state_path + ": state hash does not match its θ");
    log("resumed round %" PRId64 " (step %" PRId64 ") from %s, state %s", round, step, state_path.c_str(),
        hash_hex(hash).c_str());
  } else {
    if (!p.init_theta) throw NetError("coordinator: no init_theta to start a fresh run from");
    p.init_theta(theta.data());
    hash = state_hash(theta.data(), layout.total);
    log("fresh run '%s': θ initialised from seed %" PRIu64 " (%" PRId64 " params), state %s",
        p.run_id.c_str(), p.seed, layout.total, hash_hex(hash).c_str());
  }
  if (codec_is_lossy(codec) && down_residual.empty()) down_residual.assign(size_t(layout.total), 0.0f);
  merge = std::make_unique<StreamingMerge>(grid);
  nodes.resize(n_nodes);
  for (auto& n : nodes) n.got.assign(grid.chunks.size(), 0), n.crc.assign(grid.chunks.size(), 0);
  node_session.resize(n_nodes);
  scratch.resize(size_t(opt.chunk_elems));
  enc_scratch.resize(encoded_bytes(Codec::fp32, opt.chunk_elems));

  // Bind: without a secret only loopback, unless the config says allow_insecure.
  const HostPort hp = parse_host_port(p.address);
  std::string host = hp.host;
  const int port = opt.port >= 0 ? opt.port : hp.port;
  if (secret.empty() && !p.allow_insecure && !is_loopback_host(host)) {
    log("no shared secret (secret_file / SPES_SECRET): binding loopback only instead of %s "
        "(set allow_insecure = true to override)", host.c_str());
    host = "127.0.0.1";
  }
  if (host == "localhost") host = "127.0.0.1";
  boost::system::error_code ec;
  const auto addr = asio::ip::make_address(host, ec);
  if (ec) throw NetError("coordinator bind address '" + host + "' is not an IP address");
  tcp::endpoint ep(addr, uint16_t(port));
  acceptor.open(ep.protocol());
  acceptor.set_option(tcp::acceptor::reuse_address(true));
  acceptor.bind(ep, ec);
  if (ec) throw NetError("cannot bind " + host + ":" + std::to_string(port) + ": " + ec.message());
  acceptor.listen(asio::socket_base::max_listen_connections);
  bound = acceptor.local_endpoint();
  log("listening on %s:%u (%s, %d nodes, min_nodes %d, round timeout %.0f s, codec %s%s)", host.c_str(),
      unsigned(acceptor.local_endpoint().port()), secret.empty() ? "no secret" : "HMAC auth", n_nodes, min_nodes,
      p.round_timeout_s, codec_name(codec), secret.empty() ? ", insecure" : "");
  stats_.round = round;
  stats_.step = step;
  stats_.state_hash = hash;
}

void Coordinator::Impl::log(const char* fmt, ...) const {
  if (!opt.log) return;
  va_list ap;
  va_start(ap, fmt);
  vlog_line("[coordinator]", fmt, ap);
  va_end(ap);
}

void Coordinator::Impl::refused(const std::string& who, const std::string& reason) {
  update_stats([](CoordinatorStats& s) { ++s.refused; });
  // Rate-limited: a fuzzer or a port scanner must not flood the log.
  ++refusal_logs;
  if (refusal_logs <= 20 || refusal_logs % 1000 == 0)
    log("refused %s: %s%s", who.c_str(), reason.c_str(),
        refusal_logs == 20 ? " (further refusals logged every 1000th)" : "");
}

void Coordinator::Impl::set_phase(Phase p, int64_t r, const std::string& why) {
  log("round %" PRId64 ": %s -> %s (%s)", r, phase_name(phase), phase_name(p), why.c_str());
  phase = p;
}

void Coordinator::Impl::accept() {
  acceptor.async_accept([this](boost::system::error_code ec, tcp::socket sock) {
    if (stopped) return;
    if (!ec) {
      update_stats([](CoordinatorStats& s) { ++s.connections; });
      if (int(sessions.size()) >= opt.max_connections) {
        refused("a connection", "too many connections");
        boost::system::error_code e;
        sock.close(e);
      } else {
        auto s = std::make_shared<Session>(*this, std::move(sock));
        sessions.insert(s);
        update_stats([&](CoordinatorStats& st) { st.live_sessions = int64_t(sessions.size()); });
        s->start();
      }
    }
    accept();
  });
}

bool Coordinator::Impl::check_push_round(Session& s, int64_t r) {
  if (r <= round) {
    ++round_late;
    update_stats([](CoordinatorStats& st) { ++st.late_pushes; });
    s.fail(wire::ErrorCode_stale_round, "stale round: round " + std::to_string(r) + " is closed (coordinator at round " +
                                            std::to_string(round) + "); resync from a snapshot");
    return false;
  }
  if (r > round + 1) {
    s.fail(wire::ErrorCode_bad_push, "push for round " + std::to_string(r) + " but the open round is " +
                                         std::to_string(round + 1));
    return false;
  }
  if (s.synced_round != round) {
    // Its Δ would be against some other θ: it must take a snapshot first.
    s.fail(wire::ErrorCode_stale_round, "node does not hold round " + std::to_string(round) +
                                            "'s state; resync from a snapshot");
    return false;
  }
  return true;
}

void Coordinator::Impl::on_push_chunk(Session& s, const wire::PushChunk* m) {
  if (m->node_id() != s.node_id) return s.fail(wire::ErrorCode_bad_push, "push for another node id");
  if (!check_push_round(s, m->round())) return;
  if (!valid_codec(m->codec()) || Codec(m->codec()) != codec) return s.fail(wire::ErrorCode_codec, "push codec mismatch");
  const int c = grid.find(m->begin(), m->end());
  if (c < 0 || !node_owns[s.node_id][c])
    return s.fail(wire::ErrorCode_bad_push, "push range [" + std::to_string(m->begin()) + ", " +
                                                std::to_string(m->end()) + ") is not a chunk this node owns");
  const GridChunk& ch = grid.chunks[c];
  const size_t n_bytes = vec_size(m->payload());
  if (n_bytes != encoded_bytes(codec, ch.size()))
    return s.fail(wire::ErrorCode_bad_push, "push payload of " + std::to_string(n_bytes) + " bytes, expected " +
                                                std::to_string(encoded_bytes(codec, ch.size())));
  const uint8_t* payload = m->payload()->data();
  if (crc32c(payload, n_bytes) != m->checksum()) return s.fail(wire::ErrorCode_bad_push, "push chunk checksum mismatch");
  NodeRound& nr = nodes[s.node_id];
  if (nr.got[c]) {  // a resend after a reconnect: idempotent
    if (nr.crc[c] != m->checksum()) return s.fail(wire::ErrorCode_bad_push, "resent chunk differs from the first push");
    return;
  }
  float* v = scratch.data();
  if (!decode(codec, payload, ch.size(), v)) return s.fail(wire::ErrorCode_bad_push, "push payload holds non-finite values");
  if (phase == Phase::waiting) {
    set_phase(Phase::collecting, round + 1, "first push, from node " + std::to_string(s.node_id));
    timed_out = false;
    round_timer.expires_after(to_duration(p.round_timeout_s));
    const int64_t r = round + 1;
    round_timer.async_wait([this, r](boost::system::error_code ec) {
      if (ec || phase != Phase::collecting || round + 1 != r) return;
      timed_out = true;
      int done = 0;
      for (const auto& n : nodes) done += n.done;
      log("round %" PRId64 ": timeout after %.1f s with %d of %d nodes done (min_nodes %d)", r,
          p.round_timeout_s, done, n_nodes, min_nodes);
      maybe_close();
    });
  }
  if (codec == Codec::fp32) merge->add_values(c, v);
  else merge->add_delta(c, theta.data(), v);
  nr.got[c] = 1;
  nr.crc[c] = m->checksum();
  ++nr.got_n;
  nr.step = std::max(nr.step, m->step());
}

void Coordinator::Impl::on_push_done(Session& s, const wire::PushDone* m) {
  if (m->node_id() != s.node_id) return s.fail(wire::ErrorCode_bad_push, "PushDone for another node id");
  if (!check_push_round(s, m->round())) return;
  NodeRound& nr = nodes[s.node_id];
  const int expect = int(node_chunks[s.node_id].size());
  if (nr.got_n != expect)
    return s.fail(wire::ErrorCode_bad_push, "PushDone after " + std::to_string(nr.got_n) + " of " +
                                                std::to_string(expect) + " chunks");
  nr.done = true;
  nr.step = std::max(nr.step, m->step());
  s.awaiting = m->round();
  maybe_close();
}

void Coordinator::Impl::maybe_close() {
  if (phase != Phase::collecting) return;
  int done = 0;
  for (const auto& n : nodes) done += n.done;
  if (done == n_nodes) close_round("all " + std::to_string(n_nodes) + " nodes pushed");
  else if (timed_out && done >= min_nodes)
    close_round("timeout, quorum " + std::to_string(done) + " of " + std::to_string(n_nodes));
}

void Coordinator::Impl::close_round(const std::string& why) {
  round_timer.cancel();
  set_phase(Phase::merging, round + 1, why);
  const auto t0 = Clock::now();
  const int64_t r = round + 1;
  int participants = 0;
  int64_t rstep = 0;
  std::string missing;
  for (int node = 0; node < n_nodes; ++node) {
    if (nodes[node].done) ++participants;
    else missing += (missing.empty() ? "" : ";") + std::to_string(node);
    if (nodes[node].got_n > 0) rstep = std::max(rstep, nodes[node].step);
  }
  const double alpha = merge_alpha_at(p.merge.alpha, p.merge.interval, p.merge.decay_steps, rstep);
  const std::vector<bool> changed = merge->close(theta.data(), layout, alpha, p.merge.topk);
  const double* target = merge->target();

  // θ_new − θ_old for the changed chunks. Lossy codecs: add the download residual,
  // encode, and apply the *decoded* update to θ — exactly what every node computes.
  auto pub = std::make_shared<Publication>();
  pub->round = r;
  pub->step = rstep;
  pub->participants = participants;
  pub->alpha = alpha;
  // Chunks are independent: encode/apply them in parallel, then hash θ in order.
  std::vector<int> ids;
  for (size_t c = 0; c < grid.chunks.size(); ++c)
    if (changed[c]) ids.push_back(int(c));
  pub->chunks = ids;
  if (codec_is_lossy(codec)) pub->frames.resize(ids.size());
  std::atomic<int> bad{0};
  parallel_for(int64_t(ids.size()), [&](int64_t k) {
    const GridChunk& ch = grid.chunks[size_t(ids[size_t(k)])];
    const int64_t n = ch.size();
    float* th = theta.data() + ch.begin;
    const double* tg = target + ch.begin;
    if (codec == Codec::fp32) {
      for (int64_t i = 0; i < n; ++i) th[i] = float(tg[i]);
      return;
    }
    std::vector<float> d(static_cast<size_t>(n));
    float* res = down_residual.data() + ch.begin;
    for (int64_t i = 0; i < n; ++i) d[size_t(i)] = float(tg[i] - double(th[i])) + res[i];
    FrameWriter w(encoded_bytes(codec, n) + 1024);
    ChunkTag t{r, rstep, 0, ch.begin, ch.end, codec};
    bool ok = true;
    const FrameView v = w.round_chunk(t, encoded_bytes(codec, n), [&](uint8_t* dst) {
      encode_delta(codec, d.data(), n, dst, res);
      ok = apply_update(codec, dst, n, th, th);
    });
    if (!ok) ++bad;
    pub->frames[size_t(k)] = own(v);
  });
  if (bad) throw NetError("internal: round " + std::to_string(r) + " produced a non-finite update");
  for (size_t k = 0; k < ids.size(); ++k)
    pub->bytes += codec_is_lossy(codec) ? int64_t(pub->frames[k].size())
                                        : int64_t(kHeaderBytes + 128 + grid.chunks[size_t(ids[k])].size() * 4);
  StateHasher hasher;
  hasher.update(theta.data(), layout.total);
  round = r;
  step = rstep;
  hash = hasher.digest();
  pub->hash = hash;
  const double merge_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  log("round %" PRId64 " merged: step %" PRId64 ", %d participant(s)%s%s, alpha %.4g, %zu of %zu chunks changed, "
      "%.1f ms, state %s",
      r, rstep, participants, missing.empty() ? "" : ", missing ", missing.c_str(), alpha, pub->chunks.size(),
      grid.chunks.size(), merge_ms, hash_hex(hash).c_str());

  // Persist before anyone can see the round: a restart never loses a published round.
  if (p.persist_every > 0 && round % p.persist_every == 0) persist();
  if (p.on_round) {
    try {
      p.on_round(theta, round);
    } catch (const std::exception& e) {
      log("round %" PRId64 ": on_round hook failed: %s", round, e.what());
    }
  }

  set_phase(Phase::publishing, round, std::to_string(participants) + " recipient(s)");
  // RoundDone frame bytes (small) are counted with the chunks.
  pub->bytes += int64_t(kHeaderBytes + 96);
  std::vector<std::shared_ptr<Session>> recipients;
  for (const auto& s : sessions)
    if (s->state == Session::State::ready && s->awaiting == r) recipients.push_back(s);
  // The row and the stats first: a node may see its result before this function returns.
  char row[512];
  std::snprintf(row, sizeof row, "%" PRId64 ",%" PRId64 ",%d,%s,%" PRId64 ",%" PRId64 ",%" PRId64 ",%.6g,%.2f,%s\n",
                r, rstep, participants, missing.c_str(), round_late, round_bytes_in,
                pub->bytes * int64_t(recipients.size()), alpha, merge_ms, hash_hex(hash).c_str());
  if (opt.csv) *opt.csv << row << std::flush;
  update_stats([&](CoordinatorStats& s) {
    s.round = round;
    s.step = step;
    s.state_hash = hash;
    s.csv_rows += row;
  });
  std::shared_ptr<const Publication> cpub = pub;
  for (const auto& s : recipients) {
    s->awaiting = 0;
    s->synced_round = r;
    s->enqueue_publication(cpub);
  }
  // Next round.
  merge->begin_round();
  for (auto& n : nodes) {
    std::fill(n.got.begin(), n.got.end(), 0);
    n.got_n = 0;
    n.done = false;
    n.step = 0;
  }
  round_bytes_in = 0;
  round_late = 0;
  timed_out = false;
  set_phase(Phase::waiting, round + 1, "round " + std::to_string(r) + " published");
}

void Coordinator::Impl::persist() {
  const auto t0 = Clock::now();
  PersistedState ps;
  ps.run_id = p.run_id;
  ps.fingerprint = fingerprints[0];
  ps.round = round;
  ps.step = step;
  ps.state_hash = hash;
  ps.codec = uint32_t(codec);
  const std::string path = (std::filesystem::path(p.state_dir) / "state.bin").string();
  save_state_file(path, ps, theta, codec_is_lossy(codec) ? &down_residual : nullptr);
  persisted_round = round;
  log("round %" PRId64 " persisted to %s (%.0f ms)", round, path.c_str(),
      std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
}

void Coordinator::Impl::shutdown() {
  if (stopped) return;
  stopped = true;
  log("stopping at round %" PRId64 " (state %s)", round, hash_hex(hash).c_str());
  if (persisted_round != round && p.persist_every > 0) {
    try {
      persist();
    } catch (const std::exception& e) {
      log("could not persist on stop: %s", e.what());
    }
  }
  boost::system::error_code ec;
  acceptor.close(ec);
  round_timer.cancel();
  if (signals) signals->cancel(ec);
  for (const auto& s : std::vector<std::shared_ptr<Session>>(sessions.begin(), sessions.end())) s->close();
  io.stop();
}

Coordinator::Coordinator(CoordinatorParams params, CoordinatorOptions opt)
    : impl_(std::make_unique<Impl>(std::move(params), std::move(opt))) {}

Coordinator::~Coordinator() = default;

uint16_t Coordinator::port() const { return impl_->bound.port(); }
std::string Coordinator::bind_address() const { return impl_->bound.address().to_string(); }

void Coordinator::run() {
  Impl& I = *impl_;
  if (I.opt.handle_signals) {
    I.signals = std::make_unique<asio::signal_set>(I.io, SIGINT, SIGTERM);
    I.signals->async_wait([&I](boost::system::error_code ec, int sig) {
      if (!ec) {
        I.log("signal %d", sig);
        I.shutdown();
      }
    });
  }
  I.accept();
  I.io.run();
}

void Coordinator::stop() {
  asio::post(impl_->io, [this] { impl_->shutdown(); });
}

CoordinatorStats Coordinator::stats() const {
  std::lock_guard<std::mutex> lk(impl_->stats_mu);
  return impl_->stats_;
}

const char* Coordinator::csv_header() {
  return "round,step,participants,missing_nodes,late_pushes,bytes_in,bytes_out,merge_alpha,merge_ms,state_hash";
}

}  // namespace spes::net
