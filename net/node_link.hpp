// A node's connection to the coordinator: TCP, then TLS 1.3 when it is on; frames
// (net/frame.hpp) sealed with a MAC in shared-secret mode (net/frame_mac.hpp); a
// deadline on every operation. It knows no message of the protocol but heartbeats
// and Error frames; the handshake and the round are its users'.
//
// Its failures come in two kinds, and the kind decides what the client does next:
//   Transient  the connection broke or timed out, or the coordinator sent something
//              we could not use: worth another try (it may be restarting)
//   Refused    the coordinator said no: an Error frame (its code says whether a
//              retry can help), or its TLS verdict on this node's certificate
//
// Heartbeats: the coordinator frees a node that stays silent, so while a read waits
// the link sends one each second it has not written; between rounds the client's
// heartbeat thread asks for them (net/node_heartbeat.hpp).
//
// Not thread-safe: its users take turns (the client's mutex).
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <utility>  // before Asio: boost/asio/awaitable.hpp uses std::exchange
#include <boost/asio.hpp>

#include "engine/base/error.hpp"
#include "net/address.hpp"
#include "net/digest.hpp"
#include "net/frame.hpp"
#include "net/frame_mac.hpp"
#include "net/tls.hpp"

namespace spes::net {

struct Transient : NetError {
  using NetError::NetError;
};

struct Refused : NetError {
  wire::ErrorCode code;
  Refused(wire::ErrorCode c, const std::string& why) : NetError(why), code(c) {}
};

class NodeLink {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr double kHeartbeatS = 1.0;

  NodeLink(HostPort coordinator, const TlsFiles& tls, double connect_timeout_s, double io_timeout_s);
  NodeLink(const NodeLink&) = delete;
  NodeLink& operator=(const NodeLink&) = delete;

  const HostPort& coordinator() const { return addr_; }
  double connect_timeout_s() const { return connect_timeout_s_; }
  double io_timeout_s() const { return io_timeout_s_; }

  // A new connection (the old one closed): TCP, then the TLS handshake when it is on.
  void open();
  // The handshake is done: heartbeats may go, and with a session key (shared-secret
  // mode) every frame from here on carries a MAC.
  void authenticated(const Digest* session_key);
  bool connected() const { return connected_; }
  void disconnect();

  // One frame, counted in bytes_up. A failed write reads the coordinator's Error
  // frame if one is waiting (it refuses, then closes): Refused says why.
  void write(const FrameView& v);
  // One frame (heartbeats while it waits), into `into` or the link's own buffer,
  // valid until the next read into the same buffer. An Error frame throws Refused.
  const wire::Envelope* read(uint32_t cap, double timeout_s, RecvBuffer& into);
  const wire::Envelope* read(uint32_t cap, double timeout_s) { return read(cap, timeout_s, rx_); }

  // Between rounds: whether a heartbeat is due (connected, nothing written for a
  // second), and sending it.
  bool heartbeat_due() const;
  void write_heartbeat();

  // Bytes of the frames written and read since reset_counters().
  int64_t bytes_up() const { return bytes_up_; }
  int64_t bytes_down() const { return bytes_down_; }
  void reset_counters() { bytes_up_ = bytes_down_ = 0; }

 private:
  template <class Start>
  void run_op(Start&& start, double timeout_s, const char* what, bool beat = false);
  template <class F>
  void with_stream(F&& f);
  void beat_while_waiting();
  std::array<boost::asio::const_buffer, 3> frame_buffers(const FrameView& v, std::array<uint8_t, kHeaderBytes>& header,
                                                         Digest& mac);
  void write_frame(const FrameView& v, double timeout_s, bool count);
  void read_pending_error();
  void tls_handshake();
  boost::asio::ip::tcp::socket& socket() { return stream_->next_layer(); }

  const HostPort addr_;
  const bool tls_;
  const double connect_timeout_s_, io_timeout_s_;
  boost::asio::io_context io_;
  std::unique_ptr<ssl::context> tls_ctx_;
  std::unique_ptr<TlsStream> stream_;  // a fresh one per connection
  bool connected_ = false;             // authenticated: heartbeats may go
  FrameMac mac_;
  int64_t bytes_up_ = 0, bytes_down_ = 0;

  RecvBuffer rx_;
  std::array<uint8_t, kHeaderBytes> rx_header_{};
  std::array<uint8_t, kHeaderBytes> tx_header_{};  // of the frame being written (kFlagMac set when sealing)
  Digest tx_mac_{};

  Clock::time_point last_write_{};
  const OwnedFrame heartbeat_;
  std::array<uint8_t, kHeaderBytes> heartbeat_header_{};
  Digest heartbeat_mac_{};
  bool heartbeat_writing_ = false;  // one sent while waiting, not yet written out
};

}  // namespace spes::net
