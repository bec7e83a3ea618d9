// The coordinator's socket layer (net/README.md, Protocol): one Session per TCP
// connection — the Challenge → Hello → Welcome handshake with HMAC proofs, framing
// with a size cap per state (1 KiB before authentication), a MAC on every frame after
// the handshake in shared-secret mode, an out queue of jobs (single frames, round
// results, snapshots) drained by one write pump, and a watchdog (handshake, read,
// write and heartbeat deadlines) — and the SessionServer that accepts, counts,
// refuses and closes connections. Connections that have not authenticated live in a
// small pool of their own (the oldest is dropped for a newcomer), so idle or hostile
// sockets never take a node's place. What a push means for the round is the
// SessionHandler's business (net/coordinator.cpp); this layer knows frames, not
// rounds. Everything runs on the io_context's one thread.
#pragma once
#include <array>
#include <atomic>
#include <chrono>
#include <utility>  // before Asio: boost/asio/awaitable.hpp uses std::exchange
#include <boost/asio.hpp>
#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "net/frame.hpp"
#include "net/frame_mac.hpp"
#include "net/global_state.hpp"
#include "net/grid.hpp"
#include "net/line_log.hpp"
#include "net/publication.hpp"
#include "net/tls.hpp"

namespace spes::net {

class Session;
class SessionServer;

// What a Hello must match; fixed for the server's life.
struct HandshakeRules {
  std::string run_id;
  int n_nodes = 1;
  Codec codec = Codec::fp32;
  std::string secret;                  // HMAC key ("" = insecure mode: proofs with the empty key, no frame MACs)
  std::vector<uint64_t> fingerprints;  // per node id
  uint32_t chunk_elems = 0;            // the payload grid, announced in Welcome
  TlsFiles tls;                        // TLS 1.3 with node certificates (then no frame MACs); off when empty
  int64_t rolled_back_to = -1;         // announced in Welcome (net/round_archive)
};

// The connection budget and deadlines.
struct SessionLimits {
  double handshake_timeout_s = 5;      // a connection that does not authenticate by then is dropped
  int max_pending = 16;                // unauthenticated connections; the oldest makes way for a newcomer
  double heartbeat_timeout_s = 3;      // a node silent this long between frames is dropped (it beats every 1 s)
  double io_timeout_s = 60;            // one frame must be read / written within this
};

// The round side of the coordinator, called by sessions (io thread).
class SessionHandler {
 public:
  virtual ~SessionHandler() = default;
  // A node authenticated; it holds θ of node_round with state hash node_hash.
  // Returns whether it is in sync (else it needs a snapshot before pushing).
  virtual bool on_joined(Session& s, int64_t node_round, uint64_t node_hash) = 0;
  // A joined node's session stopped serving it (refused, closed or lost).
  virtual void on_left(Session& s) = 0;
  virtual void on_push_chunk(Session& s, const wire::PushChunk* m) = 0;
  virtual void on_push_done(Session& s, const wire::PushDone* m) = 0;
  // A snapshot of the completed round is being queued to this node.
  virtual void on_snapshot(Session& s) = 0;
  // The snapshot of `round` is complete (its SnapshotDone is being written): returns
  // whether that round ended the run (SnapshotDone.stop).
  virtual bool snapshot_ends_run(Session& s, int64_t round) = 0;
  // The node reports a round after which its first step was not finite.
  virtual void on_bad_round(Session& s, const wire::BadRound* m) = 0;
};

// Why connections were refused, for the status page: the Error code sent
// (wire::ErrorCode), or kRefusedEndedEarly for a connection that ended before it could
// be told (TLS handshake failed, closed before Hello or in the middle of a frame).
constexpr int kRefusedEndedEarly = int(wire::ErrorCode_MAX) + 1;
constexpr int kRefusalReasons = kRefusedEndedEarly + 1;
const char* refusal_reason_name(int reason);

// Bytes of one node's connections (read from any thread).
struct NodeTraffic {
  std::atomic<int64_t> up{0}, down{0};  // read from it, written to it
};

// Counters for CoordinatorStats (read from any thread).
struct SessionCounters {
  std::atomic<int64_t> connections{0};   // accepted
  std::atomic<int64_t> live_sessions{0};
  std::atomic<int64_t> refused{0};       // connections ended by an Error frame or a bad frame
  std::atomic<int64_t> busy{0};          // of which refused for the connection budget
  std::atomic<int64_t> dropped{0};       // sessions closed by a deadline (heartbeat, read, write)
  std::atomic<int64_t> snapshots{0};
  std::atomic<int64_t> bytes_in{0}, bytes_out{0};
  std::array<std::atomic<int64_t>, kRefusalReasons> refused_by{};  // `refused`, by reason
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  friend class SessionServer;
  Session(SessionServer& srv, boost::asio::ip::tcp::socket sock);
  void start();  // Challenge, watchdog, first read

  int node_id() const { return node_id_; }  // -1 before the handshake
  bool ready() const { return state_ == State::ready; }
  std::string who() const;
  // Refuses with a plain reason, then closes once the Error frame is written.
  void fail(wire::ErrorCode code, const std::string& reason);
  void enqueue_publication(std::shared_ptr<const Publication> pub);
  void close();

 private:
  enum class State { handshake, ready, closing, closed };
  using Clock = std::chrono::steady_clock;
  struct OutJob {
    enum Kind { frame, publication, snapshot } kind = frame;
    bool sealed = false;                     // frames carry a MAC (queued after the handshake)
    OwnedFrame owned;                        // kind frame
    std::shared_ptr<const Publication> pub;  // kind publication
    int64_t theta_round = 0;                 // θ must still be this round's (fp32 results and snapshots)
    std::vector<int> chunks;                 // kind snapshot: the grid chunks it sends
    size_t next = 0;                         // frames of the job sent so far
    bool cut = false;                        // drop the rest once the frame in flight is written
  };

  uint32_t cap() const;
  // Reads and writes go through TLS when it is on, else straight to the socket.
  template <class F>
  void with_stream(F&& f) {
    if (tls_) f(stream_);
    else f(stream_.next_layer());
  }
  boost::asio::ip::tcp::socket& socket() { return stream_.next_layer(); }
  void on_tls_handshake(boost::system::error_code ec);
  void begin();
  void read_header();
  void on_header(boost::system::error_code ec);
  void on_payload(boost::system::error_code ec);
  void read_failed(boost::system::error_code ec, bool mid_frame);
  void dispatch(const wire::Envelope* env);
  void on_hello(const wire::Hello* h);
  void send(OwnedFrame f);
  bool next_frame(OutJob& j, FrameView* v);
  void pump();
  void write(const FrameView& v, bool sealed);
  void left();
  void leave_handshake();
  void watch();
  void drop(const char* why);

  SessionServer& srv_;
  TlsStream stream_;
  bool tls_ = false;
  bool tls_done_ = false;  // the TLS handshake completed (or TLS is off)
  int cert_node_ = -1;     // the node id the peer's certificate names (TLS)
  std::string peer_;
  State state_ = State::handshake;
  int node_id_ = -1;
  bool member_ = false;  // joined, and on_left not yet reported
  std::array<uint8_t, kNonceBytes> nonce_{};
  std::array<uint8_t, kHeaderBytes> hdr_{};
  FrameHeader header_;
  RecvBuffer payload_;
  FrameWriter writer_;
  std::deque<OutJob> outq_;
  bool writing_ = false;
  bool snapshot_queued_ = false;
  FrameMac mac_;                            // on from the end of the handshake (shared-secret mode)
  std::array<uint8_t, kHeaderBytes> out_hdr_{};  // the frame in flight's header with kFlagMac
  Digest out_mac_{};
  Clock::time_point born_, last_rx_, write_since_;
  bool in_frame_ = false;                   // a header is read, its payload is not
  bool pending_ = true;                     // counted in the unauthenticated pool
  boost::asio::steady_timer watchdog_;
};

class SessionServer {
 public:
  // grid and state: θ as results and snapshots read it; they outlive the server.
  SessionServer(boost::asio::io_context& io, HandshakeRules rules, SessionLimits limits, const ChunkGrid& grid,
                const GlobalState& state, SessionHandler& handler, const LineLog& log);
  // Binds and listens (host must be an IP address). Throws NetError.
  boost::asio::ip::tcp::endpoint listen(const std::string& host, uint16_t port);
  void start();  // the accept loop
  void stop();   // no more connections; every session closed
  // The node's authenticated session, or null.
  std::shared_ptr<Session> node_session(int node) const;
  // Bytes read since the last call (the round's bytes_in column).
  int64_t take_round_bytes_in();
  const SessionCounters& counters() const { return counters_; }
  const NodeTraffic& traffic(int node) const { return node_traffic_.at(size_t(node)); }
  // A refused connection: counted (by reason), and logged at a bounded rate.
  void refused(const std::string& who, const std::string& reason, int why = kRefusedEndedEarly);

 private:
  friend class Session;
  void accept();
  void admit(boost::asio::ip::tcp::socket sock);
  void refuse_busy(boost::asio::ip::tcp::socket& sock, const std::string& why);
  // An Error frame written once, unencrypted and without waiting, then closed.
  static void write_plain_error(boost::asio::ip::tcp::socket& sock, wire::ErrorCode code, const std::string& reason);

  boost::asio::io_context& io_;
  boost::asio::ip::tcp::acceptor acceptor_;
  HandshakeRules rules_;
  std::unique_ptr<ssl::context> tls_ctx_;  // the TLS context, or a plain one that never handshakes
  const ChunkGrid& grid_;
  const GlobalState& state_;
  SessionHandler& handler_;
  const LineLog& log_;
  SessionLimits limits_;
  std::set<std::shared_ptr<Session>> sessions_;
  std::deque<std::weak_ptr<Session>> pending_;        // unauthenticated, oldest first (may hold stale entries)
  int pending_count_ = 0;
  std::vector<std::weak_ptr<Session>> node_session_;  // per node id
  int64_t round_bytes_in_ = 0;
  RateLimiter refusal_log_{10, 10.0};
  bool stopped_ = false;
  SessionCounters counters_;
  std::vector<NodeTraffic> node_traffic_;  // per node id
};

}  // namespace spes::net
