// The coordinator's sessions and their server (see session.hpp).
#include "net/session.hpp"

#include <cinttypes>
#include <cstring>
#include <utility>

#include "engine/base/error.hpp"
#include "net/asio_util.hpp"
#include "net/digest.hpp"

namespace spes::net {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

// ---- one connection ----------------------------------------------------------

Session::Session(SessionServer& srv, tcp::socket sock)
    : srv_(srv),
      stream_(std::move(sock), *srv.tls_ctx_),
      tls_(srv.rules_.tls.on()),
      tls_done_(!tls_),
      writer_(64 * 1024),
      watchdog_(srv.io_) {
  boost::system::error_code ec;
  auto ep = socket().remote_endpoint(ec);
  peer_ = ec ? "?" : ep.address().to_string() + ":" + std::to_string(ep.port());
}

std::string Session::who() const {
  return node_id_ >= 0 ? "node " + std::to_string(node_id_) + " (" + peer_ + ")" : peer_;
}

void Session::start() {
  tune_socket(socket());
  born_ = last_rx_ = Clock::now();
  watch();
  if (!tls_) return begin();
  stream_.async_handshake(ssl::stream_base::server,
                          [self = shared_from_this()](boost::system::error_code ec) { self->on_tls_handshake(ec); });
}

void Session::on_tls_handshake(boost::system::error_code ec) {
  if (state_ != State::handshake) return;
  if (ec) {
    srv_.refused(who(), "TLS handshake failed: " + tls_error(ec, stream_));
    return close();
  }
  tls_done_ = true;
  cert_node_ = peer_node_id(stream_);
  if (cert_node_ < 0) return fail(wire::ErrorCode_auth, "the certificate names no node (CN node-<id>)");
  begin();
}

void Session::begin() {
  random_bytes(nonce_.data(), nonce_.size());
  send(own(writer_.challenge(nonce_)));
  read_header();
}

// Every deadline of the session, checked a few times a second: cheaper and
// simpler than one timer per operation, and a dead peer is noticed within the
// deadline plus one tick.
void Session::watch() {
  watchdog_.expires_after(std::chrono::milliseconds(250));
  watchdog_.async_wait([self = shared_from_this()](boost::system::error_code e) {
    if (e || self->state_ == State::closed) return;
    const SessionLimits& l = self->srv_.limits_;
    const auto now = Clock::now();
    const double rx_s = std::chrono::duration<double>(now - self->last_rx_).count();
    const double tx_s = std::chrono::duration<double>(now - self->write_since_).count();
    char why[160];
    if (self->writing_ && tx_s > l.io_timeout_s) {
      std::snprintf(why, sizeof why, "the peer does not read: a frame not written within %.3g s", l.io_timeout_s);
      return self->drop(why);
    }
    if (self->state_ == State::handshake &&
        std::chrono::duration<double>(now - self->born_).count() > l.handshake_timeout_s) {
      if (!self->tls_done_)  // most likely a plaintext node: it waits for a Challenge and reads this instead
        return self->fail(wire::ErrorCode_auth,
                          "this coordinator requires TLS: no TLS handshake in time (set [spes] tls_ca)");
      std::snprintf(why, sizeof why, "no Hello within %.3g s", l.handshake_timeout_s);
      return self->fail(wire::ErrorCode_timeout, why);
    }
    if (self->state_ == State::ready && self->in_frame_ && rx_s > l.io_timeout_s) {
      std::snprintf(why, sizeof why, "a frame not completed within %.3g s", l.io_timeout_s);
      return self->drop(why);
    }
    if (self->state_ == State::ready && !self->in_frame_ && rx_s > l.heartbeat_timeout_s) {
      std::snprintf(why, sizeof why, "silent for %.1f s (no heartbeat): node id freed", rx_s);
      return self->drop(why);
    }
    self->watch();
  });
}

// A deadline passed: the peer is gone or not reading, so no Error frame (it
// would not be read either); the socket and its buffers are freed now.
void Session::drop(const char* why) {
  ++srv_.counters_.dropped;
  srv_.log_("%s: %s; dropped", who().c_str(), why);
  close();
}

void Session::leave_handshake() {
  if (!pending_) return;
  pending_ = false;
  --srv_.pending_count_;
}

uint32_t Session::cap() const { return state_ == State::handshake ? kMaxHandshakeFrameBytes : kMaxFrameBytes; }

void Session::read_header() {
  with_stream([&](auto& s) {
    asio::async_read(s, asio::buffer(hdr_), [self = shared_from_this()](boost::system::error_code ec, size_t) {
      self->on_header(ec);
    });
  });
}

void Session::on_header(boost::system::error_code ec) {
  if (state_ == State::closing || state_ == State::closed) return;
  if (ec) return read_failed(ec, false);
  last_rx_ = Clock::now();
  srv_.round_bytes_in_ += kHeaderBytes;
  const HeaderCheck hc = parse_header(hdr_.data(), cap(), &header_);
  if (hc != HeaderCheck::ok) {
    // Refused before anything is allocated for the payload.
    return fail(hc == HeaderCheck::bad_version ? wire::ErrorCode_protocol_version : wire::ErrorCode_bad_frame,
                header_problem(hc, header_, cap()));
  }
  const bool sealed = mac_.on();
  // A frame failing its MAC is a connection fault, not a verdict on the node: a
  // flipped byte on the path must not stop it for good (bad_frame: it reconnects).
  // Only the handshake's refusals (secret, run, node id) are final.
  if (bool(header_.flags & kFlagMac) != sealed)
    return fail(wire::ErrorCode_bad_frame, sealed ? "frame without a MAC after the handshake" : "unexpected frame MAC");
  in_frame_ = true;
  const size_t n = header_.length + (sealed ? kMacBytes : 0);
  with_stream([&](auto& s) {
    asio::async_read(s, asio::buffer(payload_.take(n), n),
                     [self = shared_from_this()](boost::system::error_code e, size_t) { self->on_payload(e); });
  });
}

void Session::on_payload(boost::system::error_code ec) {
  if (state_ == State::closing || state_ == State::closed) return;
  if (ec) return read_failed(ec, true);
  in_frame_ = false;
  last_rx_ = Clock::now();
  srv_.round_bytes_in_ += header_.length;
  srv_.counters_.bytes_in += int64_t(kHeaderBytes + payload_.size());
  if (node_id_ >= 0) srv_.node_traffic_[size_t(node_id_)].up += int64_t(kHeaderBytes + payload_.size());
  // The MAC before anything of the payload is looked at; CRC32C after, for transport damage.
  if (mac_.on() && !mac_.open(hdr_.data(), payload_.data(), header_.length, payload_.data() + header_.length))
    return fail(wire::ErrorCode_bad_frame, "frame MAC mismatch (tampered, replayed or reordered frame)");
  std::string why;
  const wire::Envelope* env = open_payload(payload_.data(), header_.length, header_.crc, &why);
  if (!env) return fail(wire::ErrorCode_bad_frame, why);
  dispatch(env);
  if (state_ == State::handshake || state_ == State::ready) read_header();
}

void Session::read_failed(boost::system::error_code ec, bool mid_frame) {
  if (ec == asio::error::operation_aborted) {
  } else if (mid_frame || state_ == State::handshake) {
    // A truncated frame, or a peer that left before authenticating.
    srv_.refused(who(), mid_frame ? "connection lost in the middle of a frame" : "connection closed before Hello");
  } else {
    srv_.log_("%s disconnected (%s)", who().c_str(), ec.message().c_str());
  }
  close();
}

void Session::dispatch(const wire::Envelope* env) {
  if (state_ == State::handshake) {
    if (env->msg_type() != wire::Message_Hello) return fail(wire::ErrorCode_unexpected, "expected Hello");
    return on_hello(env->msg_as_Hello());
  }
  switch (env->msg_type()) {
    case wire::Message_Heartbeat: return;  // its arrival reset the read deadline
    case wire::Message_PushChunk: return srv_.handler_.on_push_chunk(*this, env->msg_as_PushChunk());
    case wire::Message_PushDone: return srv_.handler_.on_push_done(*this, env->msg_as_PushDone());
    case wire::Message_BadRound: return srv_.handler_.on_bad_round(*this, env->msg_as_BadRound());
    case wire::Message_SnapshotRequest: {
      if (snapshot_queued_) return fail(wire::ErrorCode_unexpected, "snapshot already in progress");
      snapshot_queued_ = true;
      srv_.handler_.on_snapshot(*this);
      ++srv_.counters_.snapshots;
      srv_.log_("%s: sending a snapshot of round %" PRId64 " (since round %" PRId64 ")", who().c_str(),
                srv_.state_.round, env->msg_as_SnapshotRequest()->since_round());
      OutJob j;
      j.kind = OutJob::snapshot;
      j.sealed = mac_.on();
      j.theta_round = srv_.state_.round;
      // Changed-only: the chunks changed after the round the node says it holds (it
      // checks the state hash at the end and asks for everything if it was wrong).
      const int64_t since = env->msg_as_SnapshotRequest()->since_round();
      const bool partial = since >= 0 && since <= srv_.state_.round;
      for (size_t c = 0; c < srv_.grid_.chunks.size(); ++c)
        if (!partial || srv_.state_.chunk_round[c] > since) j.chunks.push_back(int(c));
      outq_.push_back(std::move(j));
      return pump();
    }
    default:
      return fail(wire::ErrorCode_unexpected, "unexpected message in this state");
  }
}

void Session::on_hello(const wire::Hello* h) {
  const HandshakeRules& r = srv_.rules_;
  if (h->protocol_version() != kProtocolVersion)
    return fail(wire::ErrorCode_protocol_version, "protocol version mismatch: coordinator speaks " +
                                                      std::to_string(kProtocolVersion) + ", node sent " +
                                                      std::to_string(h->protocol_version()));
  const auto run_id = str_view(h->run_id());
  if (run_id.size() > kMaxRunIdBytes || vec_size(h->proof()) != kProofBytes || vec_size(h->node_nonce()) != kNonceBytes)
    return fail(wire::ErrorCode_bad_frame, "Hello fields out of bounds");
  const auto expect = hmac_sha256(r.secret, hello_proof_message(nonce_, run_id, h->node_id(), h->fingerprint()));
  if (!digest_equal(expect, std::span<const uint8_t>(h->proof()->data(), kProofBytes)))
    return fail(wire::ErrorCode_auth, "authentication failed: the HMAC proof does not match the coordinator's secret");
  if (run_id != r.run_id)
    return fail(wire::ErrorCode_run_id,
                "run id mismatch: coordinator runs '" + r.run_id + "', node sent '" + std::string(run_id) + "'");
  const int id = h->node_id();
  if (id < 0 || id >= r.n_nodes)
    return fail(wire::ErrorCode_bad_node,
                "node id " + std::to_string(id) + " outside this run's 0.." + std::to_string(r.n_nodes - 1));
  if (h->fingerprint() != r.fingerprints[size_t(id)])
    return fail(wire::ErrorCode_fingerprint, "model fingerprint mismatch: coordinator " +
                                                 hash_hex(r.fingerprints[size_t(id)]) + ", node " +
                                                 hash_hex(h->fingerprint()) +
                                                 " (different model config, layout or ownership)");
  if (!valid_codec(h->codec()) || Codec(h->codec()) != r.codec)
    return fail(wire::ErrorCode_codec, std::string("codec mismatch: coordinator uses ") + codec_name(r.codec) +
                                           ", node sent " +
                                           (valid_codec(h->codec()) ? codec_name(Codec(h->codec())) : "unknown"));
  if (tls_ && id != cert_node_)
    return fail(wire::ErrorCode_auth, "certificate names node " + std::to_string(cert_node_) + ", Hello claims node " +
                                          std::to_string(id));
  if (srv_.node_session(id))
    return fail(wire::ErrorCode_duplicate_node, "node " + std::to_string(id) + " is already connected");
  node_id_ = id;
  state_ = State::ready;
  leave_handshake();
  srv_.node_session_[size_t(id)] = shared_from_this();
  member_ = true;
  const GlobalState& g = srv_.state_;
  WelcomeFields w;
  w.round = g.round;
  w.step = g.step;
  w.state_hash = g.hash;
  w.in_sync = srv_.handler_.on_joined(*this, h->sync_round(), h->state_hash());
  w.chunk_elems = r.chunk_elems;
  w.n_nodes = r.n_nodes;
  w.rolled_back_to = r.rolled_back_to;
  w.proof = hmac_sha256(r.secret, welcome_proof_message(std::span<const uint8_t>(h->node_nonce()->data(), kNonceBytes), nonce_));
  srv_.log_("%s joined (its round %" PRId64 ", coordinator round %" PRId64 ", %s)", who().c_str(), h->sync_round(),
            g.round, w.in_sync ? "in sync" : "needs a snapshot");
  send(own(writer_.welcome(w)));
  // Every frame after Welcome (and after Hello, the node's side) carries a MAC.
  if (!r.secret.empty() && !tls_)
    mac_.start(session_key(r.secret, nonce_, std::span<const uint8_t>(h->node_nonce()->data(), kNonceBytes)),
               FrameMac::coordinator);
}

void Session::send(OwnedFrame f) {
  OutJob j;
  j.kind = OutJob::frame;
  j.sealed = mac_.on();
  j.owned = std::move(f);
  outq_.push_back(std::move(j));
  pump();
}

void Session::enqueue_publication(std::shared_ptr<const Publication> pub) {
  OutJob j;
  j.kind = OutJob::publication;
  j.sealed = mac_.on();
  j.pub = std::move(pub);
  j.theta_round = srv_.state_.round;
  outq_.push_back(std::move(j));
  pump();
}

void Session::left() {
  if (!member_) return;
  member_ = false;
  srv_.handler_.on_left(*this);
}

void Session::fail(wire::ErrorCode code, const std::string& reason) {
  if (state_ == State::closing || state_ == State::closed) return;
  if (code == wire::ErrorCode_stale_round) {
    ++srv_.counters_.refused;
    ++srv_.counters_.refused_by[code];
    srv_.log_("%s: %s", who().c_str(), reason.c_str());
  } else {
    srv_.refused(who(), reason, code);
  }
  if (!tls_done_) {  // no TLS channel yet to carry the Error: it goes in plaintext
    SessionServer::write_plain_error(socket(), code, reason);
    return close();
  }
  // Nothing more after the Error; a frame already in flight is finished first.
  if (writing_ && !outq_.empty()) {
    outq_.erase(outq_.begin() + 1, outq_.end());
    outq_.front().cut = true;
  } else {
    outq_.clear();
  }
  OutJob j;
  j.kind = OutJob::frame;
  j.sealed = mac_.on();
  j.owned = own(writer_.error(code, reason));
  outq_.push_back(std::move(j));
  state_ = State::closing;
  leave_handshake();
  left();
  boost::system::error_code ec;
  socket().shutdown(tcp::socket::shutdown_receive, ec);
  pump();
}

// The next frame of the job at the head of the queue, or false when it is done.
bool Session::next_frame(OutJob& j, FrameView* v) {
  const ChunkGrid& grid = srv_.grid_;
  const GlobalState& g = srv_.state_;
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
        const GridChunk& c = grid.chunks[size_t(p.chunks[j.next])];
        const ChunkTag t{p.round, p.step, 0, c.begin, c.end, p.codec};
        if (p.lossy()) {  // the payload encoded once at round close
          const int64_t at = p.payload_at[j.next];
          const size_t bytes = size_t(p.payload_bytes[j.next]);
          *v = writer_.round_chunk(t, bytes, [&](uint8_t* dst) { p.payloads->read(at, bytes, dst); });
        } else {  // fp32: θ_new itself, from the committed state file
          *v = writer_.round_chunk(t, size_t(c.size()) * 4,
                                   [&](uint8_t* dst) { g.file->read(Section::theta, c.begin, c.size(), dst); });
        }
        return true;
      }
      if (j.next == p.chunks.size()) {
        *v = writer_.round_done(p.round, p.step, uint32_t(p.chunks.size()), p.hash, p.participants, p.alpha,
                                 p.stop);
        return true;
      }
      return false;
    }
    case OutJob::snapshot: {
      if (j.next < j.chunks.size()) {
        const GridChunk& c = grid.chunks[size_t(j.chunks[j.next])];
        *v = writer_.snapshot_chunk(g.round, c.begin, c.end,
                                    [&](uint8_t* dst) { g.file->read(Section::theta, c.begin, c.size(), dst); });
        return true;
      }
      if (j.next == j.chunks.size()) {
        *v = writer_.snapshot_done(g.round, g.step, uint32_t(j.chunks.size()), g.hash,
                                   srv_.handler_.snapshot_ends_run(*this, g.round));
        return true;
      }
      return false;
    }
  }
  return false;
}

void Session::pump() {
  if (writing_ || state_ == State::closed) return;
  while (!outq_.empty()) {
    OutJob& j = outq_.front();
    // fp32 results and snapshots are read from θ: if a round closed since the job
    // started, this node is behind and must resync.
    const bool reads_theta = j.kind == OutJob::snapshot || (j.kind == OutJob::publication && !j.pub->lossy());
    if (reads_theta && j.theta_round != srv_.state_.round && state_ != State::closing) {
      const bool was_snapshot = j.kind == OutJob::snapshot;
      outq_.pop_front();
      if (was_snapshot) snapshot_queued_ = false;
      fail(wire::ErrorCode_stale_round, "stale round: round " + std::to_string(srv_.state_.round) +
                                            " closed while sending; resync from a snapshot");
      return;
    }
    FrameView v;
    bool more = false;
    try {
      more = next_frame(j, &v);
    } catch (const NetError& e) {  // the state or spill file could not be read: this node retries later
      if (j.kind == OutJob::snapshot) snapshot_queued_ = false;
      outq_.pop_front();
      srv_.log_("%s: %s", who().c_str(), e.what());
      return fail(wire::ErrorCode_busy, "the coordinator could not read its state; try again");
    }
    if (!more) {
      if (j.kind == OutJob::snapshot) snapshot_queued_ = false;
      outq_.pop_front();
      continue;
    }
    return write(v, j.sealed);
  }
  if (state_ == State::closing) close();
}

void Session::write(const FrameView& v, bool sealed) {
  writing_ = true;
  write_since_ = Clock::now();
  std::memcpy(out_hdr_.data(), v.header, kHeaderBytes);
  if (sealed) {
    set_header_flags(out_hdr_.data(), kFlagMac);
    out_mac_ = mac_.seal(out_hdr_.data(), v.body, v.body_size);
  }
  const size_t bytes = v.size() + (sealed ? kMacBytes : 0);
  std::array<asio::const_buffer, 3> bufs{asio::buffer(out_hdr_), asio::buffer(v.body, v.body_size),
                                         asio::buffer(out_mac_.data(), sealed ? kMacBytes : 0)};
  with_stream([&](auto& s) {
    asio::async_write(s, bufs, [self = shared_from_this(), bytes](boost::system::error_code ec, size_t) {
      self->writing_ = false;
      if (ec) {
        if (self->state_ != State::closing && self->state_ != State::closed && ec != asio::error::operation_aborted)
          self->srv_.log_("%s: send failed (%s)", self->who().c_str(), ec.message().c_str());
        return self->close();
      }
      self->srv_.counters_.bytes_out += int64_t(bytes);
      if (self->node_id_ >= 0) self->srv_.node_traffic_[size_t(self->node_id_)].down += int64_t(bytes);
      if (!self->outq_.empty()) {
        ++self->outq_.front().next;
        if (self->outq_.front().cut) self->outq_.pop_front();
      }
      self->pump();
    });
  });
}

void Session::close() {
  if (state_ == State::closed) return;
  state_ = State::closed;
  leave_handshake();
  left();
  watchdog_.cancel();
  payload_.release();
  boost::system::error_code ec;
  socket().shutdown(tcp::socket::shutdown_both, ec);
  socket().close(ec);
  outq_.clear();
  auto self = shared_from_this();
  srv_.sessions_.erase(self);
  srv_.counters_.live_sessions = int64_t(srv_.sessions_.size());
}

// ---- the server ------------------------------------------------------------------

SessionServer::SessionServer(asio::io_context& io, HandshakeRules rules, SessionLimits limits, const ChunkGrid& grid,
                             const GlobalState& state, SessionHandler& handler, const LineLog& log)
    : io_(io),
      acceptor_(io),
      rules_(std::move(rules)),
      tls_ctx_(rules_.tls.on() ? tls_context(rules_.tls, true) : plain_context()),
      grid_(grid),
      state_(state),
      handler_(handler),
      log_(log),
      limits_(limits),
      node_session_(size_t(rules_.n_nodes)),
      node_traffic_(size_t(rules_.n_nodes)) {}

tcp::endpoint SessionServer::listen(const std::string& host, uint16_t port) {
  boost::system::error_code ec;
  const auto addr = asio::ip::make_address(host, ec);
  if (ec) throw NetError("coordinator bind address '" + host + "' is not an IP address");
  tcp::endpoint ep(addr, port);
  acceptor_.open(ep.protocol());
  acceptor_.set_option(tcp::acceptor::reuse_address(true));
  acceptor_.bind(ep, ec);
  if (ec) throw NetError("cannot bind " + host + ":" + std::to_string(port) + ": " + ec.message());
  acceptor_.listen(asio::socket_base::max_listen_connections);
  return acceptor_.local_endpoint();
}

void SessionServer::start() { accept(); }

void SessionServer::accept() {
  acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket sock) {
    if (stopped_) return;
    if (!ec) admit(std::move(sock));
    accept();
  });
}

// Nodes (at most one session per node id) and unauthenticated connections have
// separate budgets: a newcomer takes the place of the oldest unauthenticated
// connection, so idle sockets cannot keep a node out, and a node that connects
// finishes its handshake in one round trip, long before it could be pushed out.
void SessionServer::admit(tcp::socket sock) {
  ++counters_.connections;
  // Sessions still flushing their Error are bounded too (a flood of refusals).
  const size_t hard_cap = size_t(rules_.n_nodes) + 2 * size_t(limits_.max_pending) + 16;
  if (sessions_.size() >= hard_cap) return refuse_busy(sock, "too many connections");
  while (pending_count_ >= limits_.max_pending && !pending_.empty()) {
    auto oldest = pending_.front().lock();
    pending_.pop_front();
    if (oldest && !oldest->ready() && oldest->pending_) {
      ++counters_.busy;
      oldest->fail(wire::ErrorCode_busy, "busy: too many unauthenticated connections; the oldest makes way");
    }
  }
  while (!pending_.empty() && pending_.front().expired()) pending_.pop_front();
  auto s = std::make_shared<Session>(*this, std::move(sock));
  sessions_.insert(s);
  pending_.push_back(s);
  ++pending_count_;
  counters_.live_sessions = int64_t(sessions_.size());
  s->start();
}

// A busy Error written straight into the socket's (empty) send buffer, then closed:
// no session, nothing to wait for.
void SessionServer::refuse_busy(tcp::socket& sock, const std::string& why) {
  ++counters_.busy;
  refused("a connection", why, wire::ErrorCode_busy);
  write_plain_error(sock, wire::ErrorCode_busy, "busy: " + why);
}

void SessionServer::write_plain_error(tcp::socket& sock, wire::ErrorCode code, const std::string& reason) {
  FrameWriter w(256);
  const FrameView v = w.error(code, reason);
  boost::system::error_code e;
  sock.non_blocking(true, e);
  std::array<asio::const_buffer, 2> bufs{asio::buffer(v.header, kHeaderBytes), asio::buffer(v.body, v.body_size)};
  sock.write_some(bufs, e);
  sock.shutdown(tcp::socket::shutdown_both, e);
  sock.close(e);
}

void SessionServer::stop() {
  stopped_ = true;
  boost::system::error_code ec;
  acceptor_.close(ec);
  for (const auto& s : std::vector<std::shared_ptr<Session>>(sessions_.begin(), sessions_.end())) s->close();
}

std::shared_ptr<Session> SessionServer::node_session(int node) const {
  auto s = node_session_.at(size_t(node)).lock();
  return s && s->ready() ? s : nullptr;
}

const char* refusal_reason_name(int reason) {
  return reason == kRefusedEndedEarly ? "ended_early" : wire::EnumNameErrorCode(wire::ErrorCode(reason));
}

int64_t SessionServer::take_round_bytes_in() { return std::exchange(round_bytes_in_, 0); }

void SessionServer::refused(const std::string& who, const std::string& reason, int why) {
  ++counters_.refused;
  ++counters_.refused_by[size_t(why)];
  int64_t left_out = 0;
  if (!refusal_log_.admit(RateLimiter::Clock::now(), &left_out)) return;
  if (left_out > 0)
    log_("refused %s: %s (%" PRId64 " more refusals not logged)", who.c_str(), reason.c_str(), left_out);
  else
    log_("refused %s: %s", who.c_str(), reason.c_str());
}

}  // namespace spes::net
