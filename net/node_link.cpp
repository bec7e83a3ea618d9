// A node's connection to the coordinator (see node_link.hpp). Every socket
// operation is asynchronous, driven by io_context::run_for until its deadline, so a
// coordinator that goes silent costs a timeout, never a hang.
#include "net/node_link.hpp"

#include <algorithm>
#include <cstring>

#include "net/asio_util.hpp"

namespace spes::net {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

NodeLink::NodeLink(HostPort coordinator, const TlsFiles& tls, double connect_timeout_s, double io_timeout_s)
    : addr_(std::move(coordinator)), tls_(tls.on()), connect_timeout_s_(connect_timeout_s),
      io_timeout_s_(io_timeout_s), tls_ctx_(tls.on() ? tls_context(tls, false) : plain_context()),
      stream_(std::make_unique<TlsStream>(io_, *tls_ctx_)), heartbeat_(own(FrameWriter(64).heartbeat())) {}

// ---- connecting -------------------------------------------------------------------

void NodeLink::open() {
  disconnect();
  tcp::resolver resolver(io_);
  boost::system::error_code ec;
  auto endpoints = resolver.resolve(addr_.host, std::to_string(addr_.port), ec);
  if (ec) throw Transient("cannot resolve " + addr_.host + ": " + ec.message());
  stream_ = std::make_unique<TlsStream>(io_, *tls_ctx_);
  run_op([&](auto&& h) { asio::async_connect(socket(), endpoints, h); }, connect_timeout_s_,
         ("connecting to " + addr_.host + ":" + std::to_string(addr_.port)).c_str());
  tune_socket(socket());
  if (tls_) tls_handshake();
}

// A certificate problem on either side is final (Refused); a connection that broke
// or timed out is worth retrying.
void NodeLink::tls_handshake() {
  expect_peer_host(*stream_, addr_.host);
  boost::system::error_code result = asio::error::would_block;
  stream_->async_handshake(ssl::stream_base::client, [&](boost::system::error_code ec) { result = ec; });
  io_.restart();
  io_.run_for(to_duration(connect_timeout_s_));
  if (result == asio::error::would_block) {
    boost::system::error_code ec;
    socket().close(ec);
    io_.restart();
    io_.run();
    throw Transient("timeout in the TLS handshake with the coordinator");
  }
  if (!result) return;
  const std::string why = "TLS handshake with the coordinator failed: " + tls_error(result, *stream_);
  if (result.category() == asio::error::get_ssl_category())
    throw Refused(wire::ErrorCode_auth, why + " (is the coordinator running with TLS, with this run's CA?)");
  throw Transient(why);
}

void NodeLink::authenticated(const Digest* session_key) {
  connected_ = true;
  if (session_key) mac_.start(*session_key, FrameMac::node);
}

void NodeLink::disconnect() {
  boost::system::error_code ec;
  socket().shutdown(tcp::socket::shutdown_both, ec);
  socket().close(ec);
  connected_ = false;
  heartbeat_writing_ = false;
  mac_.stop();
}

// ---- operations with deadlines ------------------------------------------------------

// Reads and writes go through TLS when it is on, else straight to the socket.
template <class F>
void NodeLink::with_stream(F&& f) {
  if (tls_) f(*stream_);
  else f(socket());
}

// Starts the operation and runs the io_context until it completes or timeout_s
// passes (then the socket is closed: Transient). `beat`: a read, during which a
// heartbeat goes out each second nothing else was written.
template <class Start>
void NodeLink::run_op(Start&& start, double timeout_s, const char* what, bool beat) {
  boost::system::error_code result = asio::error::would_block;
  start([&](boost::system::error_code ec, auto&&...) { result = ec; });
  const auto deadline = Clock::now() + to_duration(timeout_s);
  for (;;) {
    // Checked before every wait, not only after a slow one: a long stream of quick
    // reads (a big result or snapshot) must not leave the node silent.
    if (beat) beat_while_waiting();
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) break;
    io_.restart();
    io_.run_for(std::min<Clock::duration>(left, to_duration(beat ? kHeartbeatS / 2 : timeout_s)));
    if (result != asio::error::would_block) break;
  }
  if (heartbeat_writing_) {  // finish the heartbeat in flight: the next frame's MAC follows it
    io_.restart();
    io_.run_for(to_duration(std::min(timeout_s, 5.0)));
  }
  if (result == asio::error::would_block || heartbeat_writing_) {
    boost::system::error_code ec;
    socket().close(ec);
    io_.restart();
    io_.run();
    throw Transient(std::string("timeout ") + what);
  }
  // In TLS 1.3 the coordinator judges this node's certificate after the client's
  // handshake is done: its verdict arrives as an alert on the first read. Final.
  // Any other TLS error (a record failing its MAC: damage on the path) is retried.
  if (result && tls_certificate_refused(result))
    throw Refused(wire::ErrorCode_auth, std::string("TLS error ") + what + ": " + tls_error(result, *stream_) +
                                            " (the coordinator rejected this node's certificate?)");
  if (result) throw Transient(std::string(what) + ": " + result.message());
}

// Starts writing a heartbeat (completed by the wait it precedes) when one is due.
void NodeLink::beat_while_waiting() {
  if (!connected_ || heartbeat_writing_ || Clock::now() - last_write_ < to_duration(kHeartbeatS)) return;
  const FrameView v{heartbeat_.bytes.data(), heartbeat_.bytes.data() + kHeaderBytes,
                    heartbeat_.bytes.size() - kHeaderBytes};
  heartbeat_writing_ = true;
  last_write_ = Clock::now();
  with_stream([&](auto& s) {
    asio::async_write(s, frame_buffers(v, heartbeat_header_, heartbeat_mac_),
                      [this](boost::system::error_code, size_t) { heartbeat_writing_ = false; });
  });
}

// ---- frames -----------------------------------------------------------------------

// The header (with kFlagMac and the MAC when sealing) of a frame about to be written.
std::array<asio::const_buffer, 3> NodeLink::frame_buffers(const FrameView& v,
                                                         std::array<uint8_t, kHeaderBytes>& header, Digest& mac) {
  std::memcpy(header.data(), v.header, kHeaderBytes);
  if (mac_.on()) {
    set_header_flags(header.data(), kFlagMac);
    mac = mac_.seal(header.data(), v.body, v.body_size);
  }
  return {asio::buffer(header), asio::buffer(v.body, v.body_size),
          asio::buffer(mac.data(), mac_.on() ? kMacBytes : 0)};
}

void NodeLink::write(const FrameView& v) { write_frame(v, io_timeout_s_, true); }

bool NodeLink::heartbeat_due() const {
  return connected_ && Clock::now() - last_write_ >= to_duration(kHeartbeatS);
}

void NodeLink::write_heartbeat() {
  write_frame(FrameView{heartbeat_.bytes.data(), heartbeat_.bytes.data() + kHeaderBytes,
                        heartbeat_.bytes.size() - kHeaderBytes},
              5.0, false);
}

void NodeLink::write_frame(const FrameView& v, double timeout_s, bool count) {
  const auto bufs = frame_buffers(v, tx_header_, tx_mac_);
  try {
    run_op([&](auto&& h) { with_stream([&](auto& s) { asio::async_write(s, bufs, h); }); }, timeout_s,
           "sending to the coordinator");
  } catch (const Transient&) {
    // The coordinator refuses with an Error frame and closes; our next write then
    // fails. Its reason is still in the receive queue: say it rather than retry.
    read_pending_error();
    throw;
  }
  last_write_ = Clock::now();
  if (count) bytes_up_ += int64_t(v.size() + (mac_.on() ? kMacBytes : 0));
}

// Throws Refused when an Error frame can still be read (briefly); else returns.
void NodeLink::read_pending_error() {
  if (!socket().is_open()) return;
  try {
    read(kMaxFrameBytes, 0.5);
  } catch (const Refused&) {
    throw;
  } catch (const NetError&) {
  }
}

const wire::Envelope* NodeLink::read(uint32_t cap, double timeout_s, RecvBuffer& into) {
  run_op([&](auto&& h) { with_stream([&](auto& s) { asio::async_read(s, asio::buffer(rx_header_), h); }); },
         timeout_s, "waiting for the coordinator", true);
  FrameHeader fh;
  const HeaderCheck hc = parse_header(rx_header_.data(), cap, &fh);
  if (hc == HeaderCheck::bad_version) throw Refused(wire::ErrorCode_protocol_version, header_problem(hc, fh, cap));
  if (hc != HeaderCheck::ok) throw Transient("bad frame from the coordinator: " + header_problem(hc, fh, cap));
  if (bool(fh.flags & kFlagMac) != mac_.on()) throw Transient("bad frame from the coordinator: MAC flag");
  const size_t n = fh.length + (mac_.on() ? kMacBytes : 0);
  uint8_t* buf = into.take(n);
  run_op([&](auto&& h) { with_stream([&](auto& s) { asio::async_read(s, asio::buffer(buf, n), h); }); },
         io_timeout_s_, "reading from the coordinator", true);
  bytes_down_ += int64_t(kHeaderBytes + n);
  if (mac_.on() && !mac_.open(rx_header_.data(), buf, fh.length, buf + fh.length))
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

}  // namespace spes::net
