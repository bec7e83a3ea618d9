// The node side of a sync round (see sync_client.hpp): connect and authenticate,
// push Δ in grid chunks, receive and apply the round result, resync from a
// snapshot when behind; deadlines on every socket operation, retries with backoff.
#include "net/sync_client.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

#include <boost/asio.hpp>

#include "engine/base/error.hpp"
#include "engine/base/parallel.hpp"
#include "net/address.hpp"
#include "net/asio_util.hpp"
#include "net/background_job.hpp"
#include "net/codec.hpp"
#include "net/digest.hpp"
#include "net/frame.hpp"
#include "net/frame_mac.hpp"
#include "net/grid.hpp"
#include "net/line_log.hpp"
#include "net/tls.hpp"

namespace spes::net {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

// Worth retrying: the connection broke, timed out, or the peer said something
// we could not use. The coordinator may be restarting.
struct Transient : NetError {
  using NetError::NetError;
};
// The coordinator sent an Error frame.
struct Refused : NetError {
  wire::ErrorCode code;
  Refused(wire::ErrorCode c, const std::string& why) : NetError(why), code(c) {}
};

struct OwnedChunk {
  int chunk;            // grid index
  int64_t owned_off;    // offset in owned space
};

}  // namespace

struct SyncClient::Impl {
  SyncClientParams p;  // initial_params cleared after the constructor
  const ParamLayout& layout = p.layout;
  const OwnedSpace& space = p.space;
  SyncClientOptions opt;
  const Codec codec = p.codec;
  HostPort addr;
  const int node = p.node_id;
  LineLog log;

  // Sync state (checkpointed).
  int64_t round = 0;
  std::vector<float> base;      // owned space
  std::vector<float> residual;  // owned space, lossy codecs
  std::vector<float> pending;   // residual of the push in flight (committed with the round)

  // Connection.
  asio::io_context io;
  std::unique_ptr<ssl::context> tls_ctx = p.tls.on() ? tls_context(p.tls, false) : plain_context();
  std::unique_ptr<TlsStream> stream = std::make_unique<TlsStream>(io, *tls_ctx);  // a fresh one per connection
  tcp::socket& sock() { return stream->next_layer(); }
  // Reads and writes go through TLS when it is on, else straight to the socket.
  template <class F>
  void with_stream(F&& f) {
    if (p.tls.on()) f(*stream);
    else f(sock());
  }
  bool connected = false;
  int64_t coordinator_round = 0;  // the coordinator's completed round, from its Welcome
  bool force_snapshot = false;  // params no longer hold "θ_old + local work"
  ChunkGrid grid;
  std::vector<OwnedChunk> owned_chunks;
  std::vector<int64_t> owned_off;  // per grid chunk: its offset in owned space, or -1
  FrameWriter writer{64 * 1024};
  int threads = 1;
  std::array<std::vector<FrameWriter>, 2> push_banks;  // frames built while the other bank is sent
  RecvBuffer rx;
  std::array<RecvBuffer, 2> round_rx;  // a round chunk is applied while the next one is read
  std::array<uint8_t, kHeaderBytes> hdr{};
  std::mt19937_64 rng;
  int64_t bytes_up = 0, bytes_down = 0;
  FrameMac mac;                                  // shared-secret mode, after the handshake
  std::array<uint8_t, kHeaderBytes> out_hdr{};   // header of the frame being written (kFlagMac set)
  Digest out_mac{};

  // Heartbeats: every second the node is connected and not writing, so the
  // coordinator can tell a dead node (silent) from a busy one. While a round
  // waits, read_frame sends them; between rounds, a thread does. `mu` makes the
  // two take turns on the socket (sync_round holds it throughout).
  static constexpr double kHeartbeatS = 1.0;
  std::mutex mu;
  std::condition_variable hb_cv;
  bool hb_stop = false;
  Clock::time_point last_write{};
  OwnedFrame hb_frame = own(FrameWriter(64).heartbeat());
  std::array<uint8_t, kHeaderBytes> hb_hdr{};
  Digest hb_mac{};
  bool hb_writing = false;
  std::thread hb_thread;

  // Overlapped rounds (start_round / finish_round).
  std::vector<float> inflight;  // θ as pushed, then θ_global of that round
  std::vector<float> pushed;    // owned space: θ as pushed
  std::thread inflight_thread;
  RoundReport inflight_stats;
  std::exception_ptr inflight_error;

  Impl(const SyncClientParams& params, SyncClientOptions op)
      : p(params), opt(std::move(op)), addr(parse_host_port(p.coordinator)),
        log("[node " + std::to_string(p.node_id) + "]", opt.log) {
    if (int64_t(p.initial_params.size()) != layout.total)
      throw NetError("node " + std::to_string(node) + ": initial θ has " + std::to_string(p.initial_params.size()) +
                     " values, the layout " + std::to_string(layout.total));
    check_secret(p.secret, "node " + std::to_string(node));
    check_insecure("node " + std::to_string(node) + ": coordinator", addr.host, !p.secret.empty(), p.tls.on(),
                   p.allow_insecure);
    if (opt.io_timeout_s <= 0) opt.io_timeout_s = std::max(60.0, p.round_timeout_s + 120.0);
    threads = opt.threads > 0 ? opt.threads : int(std::max(1u, std::thread::hardware_concurrency()));
    for (auto& bank : push_banks) bank.resize(size_t(threads));
    base.resize(size_t(space.size()));
    gather_owned(p.initial_params.data(), base.data());
    p.initial_params = {};
    if (codec_is_lossy(codec)) residual.assign(base.size(), 0.0f), pending.assign(base.size(), 0.0f);
    std::random_device rd;
    rng.seed((uint64_t(rd()) << 32) ^ rd() ^ uint64_t(node));
    hb_thread = std::thread([this] { heartbeat_loop(); });
  }

  ~Impl() {
    {
      std::lock_guard<std::mutex> lk(mu);
      hb_stop = true;
    }
    hb_cv.notify_all();
    hb_thread.join();
  }

  // Between rounds: a heartbeat each second while connected; a failure just
  // disconnects (the next round reconnects).
  void heartbeat_loop() {
    std::unique_lock<std::mutex> lk(mu);
    while (!hb_cv.wait_for(lk, to_duration(kHeartbeatS / 2), [&] { return hb_stop; })) {
      if (!connected || Clock::now() - last_write < to_duration(kHeartbeatS)) continue;
      try {
        write_frame(FrameView{hb_frame.bytes.data(), hb_frame.bytes.data() + kHeaderBytes,
                              hb_frame.bytes.size() - kHeaderBytes},
                    false);
      } catch (const std::exception& e) {
        log("heartbeat failed (%s); reconnecting at the next round", e.what());
        disconnect();
      }
    }
  }

  // The header (with kFlagMac and the MAC when sealing) of a frame about to be written.
  std::array<asio::const_buffer, 3> frame_buffers(const FrameView& v, std::array<uint8_t, kHeaderBytes>& hdr_out,
                                                  Digest& mac_out) {
    std::memcpy(hdr_out.data(), v.header, kHeaderBytes);
    if (mac.on()) {
      set_header_flags(hdr_out.data(), kFlagMac);
      mac_out = mac.seal(hdr_out.data(), v.body, v.body_size);
    }
    return {asio::buffer(hdr_out), asio::buffer(v.body, v.body_size),
            asio::buffer(mac_out.data(), mac.on() ? kMacBytes : 0)};
  }

  void gather_owned(const float* params, float* out) const { space.gather(params, out); }
  void scatter_owned(const float* in, float* params) const { space.scatter(in, params); }

  uint64_t base_hash(const float* params) const {
    StateHasher h;
    int64_t at = 0;
    for (const OwnedSegment& s : space.segments()) {
      h.update(params + at, s.flat.begin - at);
      h.update(base.data() + s.packed_begin, s.flat.size());
      at = s.flat.end;
    }
    h.update(params + at, layout.total - at);
    return h.digest();
  }

  // ---- I/O with deadlines: async operations driven by run_for ----------------

  // `beat`: while waiting (a read), send a heartbeat each second without one.
  template <class Start>
  void run_op(Start&& start, double timeout_s, const char* what, bool beat = false) {
    boost::system::error_code result = asio::error::would_block;
    start([&](boost::system::error_code ec, auto&&...) { result = ec; });
    const auto deadline = Clock::now() + to_duration(timeout_s);
    for (;;) {
      // Checked before every wait, not only after a slow one: a long stream of
      // quick reads (a big result or snapshot) must not leave the node silent.
      if (beat && connected && !hb_writing && Clock::now() - last_write >= to_duration(kHeartbeatS)) {
        const FrameView v{hb_frame.bytes.data(), hb_frame.bytes.data() + kHeaderBytes,
                          hb_frame.bytes.size() - kHeaderBytes};
        hb_writing = true;
        last_write = Clock::now();
        with_stream([&](auto& s) {
          asio::async_write(s, frame_buffers(v, hb_hdr, hb_mac),
                            [this](boost::system::error_code, size_t) { hb_writing = false; });
        });
      }
      const auto left = deadline - Clock::now();
      if (left <= Clock::duration::zero()) break;
      io.restart();
      io.run_for(std::min<Clock::duration>(left, to_duration(beat ? kHeartbeatS / 2 : timeout_s)));
      if (result != asio::error::would_block) break;
    }
    if (hb_writing) {  // finish the heartbeat in flight: the next frame's MAC follows it
      io.restart();
      io.run_for(to_duration(std::min(timeout_s, 5.0)));
    }
    if (result == asio::error::would_block || hb_writing) {
      boost::system::error_code ec;
      sock().close(ec);
      io.restart();
      io.run();
      throw Transient(std::string("timeout ") + what);
    }
    // In TLS 1.3 the coordinator judges this node's certificate after the client's
    // handshake is done: its verdict arrives as an alert on the first read. Final.
    if (result && result.category() == asio::error::get_ssl_category())
      throw Refused(wire::ErrorCode_auth, std::string("TLS error ") + what + ": " + tls_error(result, *stream) +
                                              " (the coordinator rejected this node's certificate?)");
    if (result) throw Transient(std::string(what) + ": " + result.message());
  }

  void write_frame(const FrameView& v, bool count = true) {
    const auto bufs = frame_buffers(v, out_hdr, out_mac);
    try {
      run_op([&](auto&& h) { with_stream([&](auto& s) { asio::async_write(s, bufs, h); }); },
             count ? opt.io_timeout_s : 5.0, "sending to the coordinator");
    } catch (const Transient&) {
      // The coordinator refuses with an Error frame and closes; our next write then
      // fails. Its reason is still in the receive queue: say it rather than retry.
      read_pending_error();
      throw;
    }
    last_write = Clock::now();
    if (count) bytes_up += int64_t(v.size() + (mac.on() ? kMacBytes : 0));
  }

  // Throws Refused when an Error frame can still be read (briefly); else returns.
  void read_pending_error() {
    if (!sock().is_open()) return;
    try {
      read_frame(kMaxFrameBytes, 0.5);
    } catch (const Refused&) {
      throw;
    } catch (const NetError&) {
    }
  }

  // Reads one frame (heartbeats while waiting for it); an Error frame becomes Refused.
  const wire::Envelope* read_frame(uint32_t cap, double timeout_s) { return read_frame(cap, timeout_s, rx); }
  const wire::Envelope* read_frame(uint32_t cap, double timeout_s, RecvBuffer& rx) {
    run_op([&](auto&& h) { with_stream([&](auto& s) { asio::async_read(s, asio::buffer(hdr), h); }); }, timeout_s,
           "waiting for the coordinator", true);
    FrameHeader fh;
    const HeaderCheck hc = parse_header(hdr.data(), cap, &fh);
    if (hc == HeaderCheck::bad_version) throw Refused(wire::ErrorCode_protocol_version, header_problem(hc, fh, cap));
    if (hc != HeaderCheck::ok) throw Transient("bad frame from the coordinator: " + header_problem(hc, fh, cap));
    if (bool(fh.flags & kFlagMac) != mac.on()) throw Transient("bad frame from the coordinator: MAC flag");
    const size_t n = fh.length + (mac.on() ? kMacBytes : 0);
    uint8_t* buf = rx.take(n);
    run_op([&](auto&& h) { with_stream([&](auto& s) { asio::async_read(s, asio::buffer(buf, n), h); }); },
           opt.io_timeout_s, "reading from the coordinator", true);
    bytes_down += int64_t(kHeaderBytes + n);
    if (mac.on() && !mac.open(hdr.data(), buf, fh.length, buf + fh.length))
      throw Transient("frame MAC mismatch from the coordinator (tampered, replayed or reordered frame)");
    std::string why;
    const wire::Envelope* env = open_payload(buf, fh.length, fh.crc, &why);
    if (!env) throw Transient("bad frame from the coordinator: " + why);
    if (env->msg_type() == wire::Message_Error) {
      const auto* e = env->msg_as_Error();
      throw Refused(e->code(), std::string(str_view(e->reason()).substr(0, kMaxReasonBytes)));
    }
    return env;
  }

  void disconnect() {
    boost::system::error_code ec;
    sock().shutdown(tcp::socket::shutdown_both, ec);
    sock().close(ec);
    connected = false;
    hb_writing = false;
    mac.stop();
  }

  // A certificate problem on either side is final (Refused); a connection that
  // broke or timed out is worth retrying.
  void tls_handshake() {
    expect_peer_host(*stream, addr.host);
    boost::system::error_code result = asio::error::would_block;
    stream->async_handshake(ssl::stream_base::client, [&](boost::system::error_code ec) { result = ec; });
    io.restart();
    io.run_for(to_duration(opt.connect_timeout_s));
    if (result == asio::error::would_block) {
      boost::system::error_code ec;
      sock().close(ec);
      io.restart();
      io.run();
      throw Transient("timeout in the TLS handshake with the coordinator");
    }
    if (!result) return;
    const std::string why = "TLS handshake with the coordinator failed: " + tls_error(result, *stream);
    if (result.category() == asio::error::get_ssl_category())
      throw Refused(wire::ErrorCode_auth, why + " (is the coordinator running with TLS, with this run's CA?)");
    throw Transient(why);
  }

  // Connects and authenticates; returns whether the node is in sync.
  bool connect(const float* params) {
    disconnect();
    tcp::resolver resolver(io);
    boost::system::error_code ec;
    auto endpoints = resolver.resolve(addr.host, std::to_string(addr.port), ec);
    if (ec) throw Transient("cannot resolve " + addr.host + ": " + ec.message());
    stream = std::make_unique<TlsStream>(io, *tls_ctx);
    run_op([&](auto&& h) { asio::async_connect(sock(), endpoints, h); }, opt.connect_timeout_s,
           ("connecting to " + addr.host + ":" + std::to_string(addr.port)).c_str());
    tune_socket(sock());
    if (p.tls.on()) tls_handshake();

    const wire::Envelope* env = read_frame(kMaxHandshakeFrameBytes, opt.connect_timeout_s);
    if (env->msg_type() != wire::Message_Challenge) throw Transient("coordinator did not send a Challenge");
    const auto* ch = env->msg_as_Challenge();
    if (ch->protocol_version() != kProtocolVersion)
      throw Refused(wire::ErrorCode_protocol_version,
                    "protocol version mismatch: coordinator speaks " + std::to_string(ch->protocol_version()) +
                        ", this node " + std::to_string(kProtocolVersion));
    if (vec_size(ch->nonce()) != kNonceBytes) throw Transient("bad Challenge from the coordinator");
    std::array<uint8_t, kNonceBytes> server_nonce;
    std::memcpy(server_nonce.data(), ch->nonce()->data(), kNonceBytes);

    HelloFields h;
    h.run_id = p.run_id;
    h.node_id = node;
    h.fingerprint = p.fingerprint;
    h.codec = codec;
    h.sync_round = round;
    h.state_hash = force_snapshot ? 0 : base_hash(params);
    random_bytes(h.node_nonce.data(), h.node_nonce.size());
    h.proof = hmac_sha256(p.secret, hello_proof_message(server_nonce, h.run_id, node, p.fingerprint));
    write_frame(writer.hello(h));

    env = read_frame(kMaxFrameBytes, opt.io_timeout_s);
    if (env->msg_type() != wire::Message_Welcome) throw Transient("coordinator did not send Welcome");
    const auto* w = env->msg_as_Welcome();
    const auto expect = hmac_sha256(p.secret, welcome_proof_message(h.node_nonce, server_nonce));
    if (vec_size(w->proof()) != kProofBytes ||
        !digest_equal(expect, std::span<const uint8_t>(w->proof()->data(), kProofBytes)))
      throw Refused(wire::ErrorCode_auth, "the coordinator failed to prove the shared secret");
    const int64_t ce = w->chunk_elems();
    if (ce < kInt8Block || ce > kMaxChunkElems || ce % kInt8Block)
      throw Transient("coordinator announced a bad chunk size " + std::to_string(ce));
    if (w->n_nodes() != p.n_nodes)
      throw Refused(wire::ErrorCode_bad_node, "coordinator runs " + std::to_string(w->n_nodes()) + " nodes, config says " +
                                                  std::to_string(p.n_nodes));
    if (grid.chunk_elems != ce) {
      grid = make_grid(layout, p.n_experts, ce);
      owned_chunks.clear();
      owned_off.assign(grid.chunks.size(), -1);
      for (const Range& r : space.ranges())
        for (int c : grid.chunks_in(r)) {
          owned_off[c] = space.packed_offset({grid.chunks[c].begin, grid.chunks[c].end});
          owned_chunks.push_back({c, owned_off[c]});
        }
    }
    connected = true;
    coordinator_round = w->round();
    if (!p.secret.empty() && !p.tls.on()) mac.start(session_key(p.secret, server_nonce, h.node_nonce), FrameMac::node);
    const bool in_sync = w->in_sync() && !force_snapshot;
    log("connected to %s:%u (coordinator round %" PRId64 ", ours %" PRId64 ", %s)", addr.host.c_str(),
        unsigned(addr.port), w->round(), round, in_sync ? "in sync" : "snapshot needed");
    return in_sync;
  }

  // A coordinator behind this node lost rounds the node has seen (restored from an
  // old state, or restarted --fresh): its snapshot would silently reset the node.
  // The node stops instead, θ and round untouched, so the operator can restart the
  // coordinator from the right state (or start a new run on purpose).
  void refuse_reset_if_ahead() {
    if (coordinator_round >= round) return;
    disconnect();
    throw NetError("node " + std::to_string(node) + " holds round " + std::to_string(round) +
                   ", ahead of the coordinator at round " + std::to_string(coordinator_round) +
                   " (it lost published rounds: restarted from an old state or with --fresh?); refusing to be reset "
                   "to an older θ; restart the coordinator from this run's state, or start a new run (no --resume)");
  }

  // Changed-only when params still hold θ of our round outside the owned ranges (and
  // sync_base inside): the coordinator then sends only the chunks changed since, so
  // the experts of nodes that missed rounds do not travel. A wrong guess shows in the
  // state hash; force_snapshot stays set, so the next attempt asks for everything.
  void snapshot(float* params, RoundReport& st) {
    refuse_reset_if_ahead();
    const bool partial = !force_snapshot;  // after a failed snapshot it stays set: everything next time
    write_frame(writer.snapshot_request(partial ? round : -1));
    if (partial) scatter_owned(base.data(), params);  // θ of our round: the local work is dropped
    force_snapshot = true;  // params are overwritten from here on
    uint32_t got = 0;
    for (;;) {
      const wire::Envelope* env = read_frame(kMaxFrameBytes, opt.io_timeout_s);
      if (env->msg_type() == wire::Message_SnapshotChunk) {
        const auto* m = env->msg_as_SnapshotChunk();
        const int c = grid.find(m->begin(), m->end());
        if (c < 0 || vec_size(m->payload()) != size_t(m->end() - m->begin()) * 4 ||
            crc32c(m->payload()->data(), vec_size(m->payload())) != m->checksum())
          throw Transient("bad snapshot chunk from the coordinator");
        std::memcpy(params + m->begin(), m->payload()->data(), vec_size(m->payload()));
        ++got;
        continue;
      }
      if (env->msg_type() != wire::Message_SnapshotDone) throw Transient("unexpected message during a snapshot");
      const auto* d = env->msg_as_SnapshotDone();
      const uint64_t h = state_hash(params, layout.total);
      if ((!partial && got != grid.chunks.size()) || d->chunks() != got || h != d->state_hash())
        throw Transient("snapshot incomplete or its hash does not match");
      round = d->round();
      gather_owned(params, base.data());
      std::fill(residual.begin(), residual.end(), 0.0f);
      force_snapshot = false;
      st.round = round;
      st.state_hash = h;
      st.resynced = true;
      log("resynced from a snapshot of round %" PRId64 " (%u of %zu chunks, state %s)", round, got,
          grid.chunks.size(), hash_hex(h).c_str());
      return;
    }
  }

  // Encodes the owned chunks on `threads` threads, one chunk each, a bank of frames
  // ahead of the socket: the workers build bank b^1 while this thread sends bank b.
  // Small chunks (tests, tiny models) are encoded inline: a thread costs more than them.
  void push(const float* params, int64_t step) {
    const int64_t r = round + 1;
    const bool overlap = grid.chunk_elems >= (int64_t(1) << 16) && threads > 1;
    const size_t n = owned_chunks.size(), per_bank = overlap ? size_t(threads) : 1;
    std::array<std::vector<FrameView>, 2> views{std::vector<FrameView>(per_bank), std::vector<FrameView>(per_bank)};
    std::atomic<int64_t> bad{-1};  // a chunk with non-finite parameters
    auto build = [&](int b, size_t first) {
      parallel_for(int64_t(std::min(per_bank, n - first)), threads, [&](int64_t k) {
        const OwnedChunk& oc = owned_chunks[first + size_t(k)];
        const GridChunk& c = grid.chunks[oc.chunk];
        const float* res = residual.empty() ? nullptr : residual.data() + oc.owned_off;
        float* res_out = pending.empty() ? nullptr : pending.data() + oc.owned_off;
        ChunkTag t{r, step, node, c.begin, c.end, codec};
        auto encode = [&](uint8_t* dst) {
          return encode_update(codec, params + c.begin, base.data() + oc.owned_off, res, res_out, c.size(), dst);
        };
        FrameWriter& w = push_banks[b][size_t(k)];
        if (codec == Codec::sparse) {  // its size is known once encoded
          thread_local std::vector<uint8_t> payload;
          payload.resize(encoded_bytes(codec, c.size()));
          if (!encode(payload.data())) bad = oc.chunk;
          const size_t bytes = payload_bytes(codec, payload.data(), c.size());
          views[b][size_t(k)] = w.push_chunk(t, bytes, [&](uint8_t* dst) { std::memcpy(dst, payload.data(), bytes); });
        } else {
          views[b][size_t(k)] = w.push_chunk(t, encoded_bytes(codec, c.size()), [&](uint8_t* dst) {
            if (!encode(dst)) bad = oc.chunk;
          });
        }
      });
    };
    BackgroundJob job;  // after everything it touches: its destructor joins
    if (n > 0) build(0, 0);
    for (size_t first = 0, b = 0; first < n; first += per_bank, b ^= 1) {
      if (bad >= 0) {
        const GridChunk& c = grid.chunks[size_t(bad.load())];
        throw NetError("node " + std::to_string(node) + ": non-finite parameters in [" + std::to_string(c.begin) +
                       ", " + std::to_string(c.end) + ") at step " + std::to_string(step) + "; not pushing them");
      }
      const bool more = first + per_bank < n;
      if (more && overlap) job.start([&build, b, next = first + per_bank] { build(int(b ^ 1), next); });
      for (size_t k = 0; k < std::min(per_bank, n - first); ++k) write_pushed(views[b][k]);
      job.wait();
      if (more && !overlap) build(int(b ^ 1), first + per_bank);
    }
    write_pushed(writer.push_done(r, node, step, uint32_t(n)));
  }

  // A push the coordinator refused mid-way (an Error frame, then it closes) shows
  // here as a failed write: read the Error, if it came, so the node learns why.
  void write_pushed(const FrameView& v) {
    try {
      write_frame(v);
    } catch (const Transient&) {
      try {
        read_frame(kMaxFrameBytes, 1.0);
      } catch (const Refused&) {
        throw;
      } catch (const std::exception&) {
      }
      throw;
    }
  }

  void receive_result(float* params, RoundReport& st) {
    const int64_t r = round + 1;
    uint32_t got = 0;
    bool reset = false;
    // Chunks arrive in ascending order, so θ is final up to each chunk's end: hash it
    // as it comes, and refresh sync_base from the owned chunks as they land.
    StateHasher hasher;
    int64_t hashed = 0;
    const auto t_wait = Clock::now();
    auto t_first = t_wait;
    BackgroundJob apply;  // applies chunk k while chunk k+1 is read (after what it touches: joins first)
    for (int b = 0;; b ^= 1) {
      const wire::Envelope* env = read_frame(kMaxFrameBytes, opt.io_timeout_s, round_rx[size_t(b)]);
      if (!reset) {
        t_first = Clock::now();
        st.wait_ms = std::chrono::duration<double, std::milli>(t_first - t_wait).count();
        // θ_old over the owned ranges is sync_base: the local work has been pushed.
        force_snapshot = true;  // until the round is complete, params are neither old nor new
        scatter_owned(base.data(), params);
        reset = true;
      }
      if (env->msg_type() == wire::Message_RoundChunk) {
        const auto* m = env->msg_as_RoundChunk();
        const int c = grid.find(m->begin(), m->end());
        const int64_t n = m->end() - m->begin();
        if (m->round() != r || c < 0 || !valid_codec(m->codec()) || Codec(m->codec()) != codec ||
            !payload_size_ok(codec, vec_size(m->payload()) ? m->payload()->data() : nullptr, vec_size(m->payload()), n) ||
            crc32c(m->payload()->data(), vec_size(m->payload())) != m->checksum())
          throw Transient("bad round chunk from the coordinator");
        if (m->begin() < hashed) throw Transient("round chunks out of order");
        const int64_t end = m->end();
        apply.start([this, m, c, n, end, params, &hasher, hashed] {
          float* x = params + m->begin();
          if (!apply_update(codec, m->payload()->data(), n, x, x, threads)) throw Transient("malformed round chunk");
          if (owned_off[c] >= 0) std::memcpy(base.data() + owned_off[c], x, size_t(n) * 4);
          hasher.update(params + hashed, end - hashed);
        });
        hashed = end;
        ++got;
        continue;
      }
      apply.wait();
      if (env->msg_type() != wire::Message_RoundDone) throw Transient("unexpected message while waiting for the round");
      const auto* d = env->msg_as_RoundDone();
      if (d->round() != r || d->chunks() != got) throw Transient("incomplete round result");
      hasher.update(params + hashed, layout.total - hashed);
      const uint64_t h = hasher.digest();
      if (h != d->state_hash()) {
        log("state hash mismatch after round %" PRId64 ": node %s, coordinator %s; resyncing from a snapshot", r,
            hash_hex(h).c_str(), hash_hex(d->state_hash()).c_str());
        throw Transient("state hash mismatch");
      }
      st.pull_ms = std::chrono::duration<double, std::milli>(Clock::now() - t_first).count();
      round = r;  // sync_base already holds the new owned values
      std::swap(residual, pending);
      force_snapshot = false;
      log("round %" PRId64 " synced: %d participant(s), merge alpha %.4g, state %s", r, d->participants(),
          d->merge_alpha(), hash_hex(h).c_str());
      st.round = r;
      st.state_hash = h;
      st.participants = d->participants();
      st.merge_alpha = d->merge_alpha();
      return;
    }
  }

  RoundReport sync_round(float* params, int64_t step) {
    const auto t0 = Clock::now();
    RoundReport st;
    bytes_up = bytes_down = 0;
    const auto give_up = t0 + to_duration(opt.retry_for_s);
    int attempt = 0;
    for (;;) {
      try {
        if (!connected && !connect(params)) {
          snapshot(params, st);
          break;
        }
        const auto tp = Clock::now();
        push(params, step);
        st.push_ms = std::chrono::duration<double, std::milli>(Clock::now() - tp).count();
        receive_result(params, st);
        break;
      } catch (const Refused& e) {
        disconnect();
        switch (e.code) {
          case wire::ErrorCode_stale_round:
            log("%s", e.what());
            continue;  // reconnecting finds the node behind: snapshot
          case wire::ErrorCode_duplicate_node:  // our previous connection may not be gone yet
          case wire::ErrorCode_busy:
          case wire::ErrorCode_timeout:
          case wire::ErrorCode_shutting_down:
          case wire::ErrorCode_bad_frame:
            if (Clock::now() > give_up) throw NetError("coordinator keeps refusing node " + std::to_string(node) + ": " + e.what());
            backoff(attempt++, e.what());
            continue;
          default:
            throw NetError("coordinator " + addr.host + ":" + std::to_string(addr.port) + " refused node " +
                           std::to_string(node) + ": " + e.what());
        }
      } catch (const Transient& e) {
        disconnect();
        if (Clock::now() > give_up)
          throw NetError("node " + std::to_string(node) + ": coordinator " + addr.host + ":" +
                         std::to_string(addr.port) + " unreachable for " + std::to_string(int(opt.retry_for_s)) +
                         " s (" + e.what() + ")");
        backoff(attempt++, e.what());
      }
    }
    st.ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    st.bytes_up = bytes_up;
    st.bytes_down = bytes_down;
    return st;
  }

  void backoff(int attempt, const char* why) {
    const double base_s = std::min(opt.backoff_max_s, opt.backoff_min_s * std::pow(2.0, std::min(attempt, 30)));
    std::uniform_real_distribution<double> jitter(0.5, 1.5);
    const double s = base_s * jitter(rng);
    log("%s; retrying in %.2f s", why, s);
    std::this_thread::sleep_for(to_duration(s));
  }
};

SyncClient::SyncClient(const SyncClientParams& params, SyncClientOptions opt)
    : impl_(std::make_unique<Impl>(params, std::move(opt))) {}

SyncClient::~SyncClient() {
  if (impl_->inflight_thread.joinable()) impl_->inflight_thread.join();
}

void SyncClient::start_round(const float* params, int64_t step) {
  Impl& I = *impl_;
  if (I.inflight_thread.joinable()) throw NetError("internal: a sync round is already in flight");
  I.inflight.assign(params, params + I.layout.total);
  I.pushed.resize(size_t(I.space.size()));
  I.gather_owned(params, I.pushed.data());
  I.inflight_error = nullptr;
  I.inflight_thread = std::thread([&I, step] {
    try {
      I.inflight_stats = I.sync_round(I.inflight.data(), step);
    } catch (...) {
      I.inflight_error = std::current_exception();
    }
  });
}

bool SyncClient::round_in_flight() const { return impl_->inflight_thread.joinable(); }

RoundReport SyncClient::finish_round(float* params) {
  Impl& I = *impl_;
  I.inflight_thread.join();
  if (I.inflight_error) std::rethrow_exception(std::exchange(I.inflight_error, nullptr));
  const float* g = I.inflight.data();
  if (I.inflight_stats.resynced) {  // a snapshot replaced θ: the local work is dropped
    std::memcpy(params, g, size_t(I.layout.total) * 4);
    return I.inflight_stats;
  }
  int64_t at = 0;
  for (const OwnedSegment& s : I.space.segments()) {
    std::memcpy(params + at, g + at, size_t(s.flat.begin - at) * 4);
    const float* p = I.pushed.data() + s.packed_begin;
    for (int64_t i = 0; i < s.flat.size(); ++i) {
      float& x = params[s.flat.begin + i];
      x = g[s.flat.begin + i] + (x - p[i]);
    }
    at = s.flat.end;
  }
  std::memcpy(params + at, g + at, size_t(I.layout.total - at) * 4);
  return I.inflight_stats;
}

RoundReport SyncClient::sync_round(float* params, int64_t step) {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->sync_round(params, step);
}

SyncState SyncClient::state() const { return {impl_->round, impl_->base, impl_->residual}; }

void SyncClient::restore(const SyncState& s) {
  Impl& I = *impl_;
  std::lock_guard<std::mutex> lk(I.mu);
  I.disconnect();
  I.force_snapshot = false;
  I.round = s.round;
  if (!s.base.empty()) {
    if (int64_t(s.base.size()) != I.space.size())
      throw NetError("saved sync base has " + std::to_string(s.base.size()) + " values, node owns " +
                     std::to_string(I.space.size()));
    I.base = s.base;
  }
  if (codec_is_lossy(I.codec)) {
    if (s.residual.size() == I.base.size()) I.residual = s.residual;
    else std::fill(I.residual.begin(), I.residual.end(), 0.0f);
  }
}

int64_t SyncClient::round() const { return impl_->round; }
uint64_t SyncClient::base_hash(const float* params) const { return impl_->base_hash(params); }
void SyncClient::disconnect() {
  std::lock_guard<std::mutex> lk(impl_->mu);
  impl_->disconnect();
}

}  // namespace spes::net
