#include "net/status_server.hpp"

#include <array>
#include <chrono>
#include <list>
#include <optional>
#include <thread>
#include <utility>  // before Asio: boost/asio/awaitable.hpp uses std::exchange
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "engine/base/error.hpp"
#include "net/asio_util.hpp"
#include "net/status_page.hpp"

namespace spes::net {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

// A response body: the document's text, shared by every connection that sends it.
struct Document {
  http::status status = http::status::ok;
  const char* type = "text/plain; charset=utf-8";
  std::string body;
};

enum class Page { html, metrics, json, count };

std::shared_ptr<const Document> fixed(http::status st, std::string body) {
  auto d = std::make_shared<Document>();
  d->status = st;
  d->body = std::move(body);
  return d;
}

class HttpConnection;

// The server's state, on its thread.
struct Hub {
  StatusServer::Source source;
  StatusLimits limits;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer accept_retry{io};
  std::string host;
  uint16_t bound_port = 0;
  std::list<std::weak_ptr<HttpConnection>> open;  // oldest first
  std::array<std::shared_ptr<const Document>, size_t(Page::count)> cache;
  std::array<Clock::time_point, size_t(Page::count)> rendered_at{};
  const std::shared_ptr<const Document> not_found = fixed(http::status::not_found, "not found: try /, /metrics or /status.json\n");
  const std::shared_ptr<const Document> bad_method = fixed(http::status::method_not_allowed, "read-only: GET only\n");
  std::thread thread;

  Hub(StatusServer::Source s, StatusLimits l) : source(std::move(s)), limits(l) {}
  void accept();
  void admit(tcp::socket sock);
  std::shared_ptr<const Document> document(http::verb method, beast::string_view target);
  void stop();
};

// One client connection: read a request (bounded in size and time), answer it from
// the shared documents, and again while the client keeps the connection alive.
class HttpConnection : public std::enable_shared_from_this<HttpConnection> {
 public:
  HttpConnection(Hub& srv, tcp::socket sock)
      : srv_(srv), stream_(std::move(sock)), buffer_(srv.limits.max_header_bytes) {}
  void start() { read(); }
  void close() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.close();
  }

 private:
  void read() {
    parser_.emplace();
    parser_->header_limit(uint32_t(srv_.limits.max_header_bytes));
    parser_->body_limit(0);
    stream_.expires_after(to_duration(srv_.limits.request_timeout_s));
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->on_read(ec); });
  }

  // Any error (timeout, a header over the limit, a body, the client gone) closes.
  void on_read(beast::error_code ec) {
    if (ec) return close();
    const auto& req = parser_->get();
    doc_ = srv_.document(req.method(), req.target());
    res_ = {};
    res_.result(doc_->status);
    res_.version(req.version());
    res_.set(http::field::server, "spes-engine");
    res_.set(http::field::content_type, doc_->type);
    res_.set(http::field::cache_control, "no-store");
    if (doc_->status == http::status::method_not_allowed) res_.set(http::field::allow, "GET");
    res_.keep_alive(req.keep_alive());
    res_.body() = http::span_body<const char>::value_type(doc_->body.data(), doc_->body.size());
    res_.prepare_payload();
    stream_.expires_after(to_duration(srv_.limits.write_timeout_s));
    http::async_write(stream_, res_, [self = shared_from_this()](beast::error_code e, size_t) {
      if (e || !self->res_.keep_alive()) return self->close();
      self->doc_.reset();
      self->read();
    });
  }

  Hub& srv_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;  // at most max_header_bytes
  std::optional<http::request_parser<http::empty_body>> parser_;
  std::shared_ptr<const Document> doc_;  // kept while res_ points into it
  http::response<http::span_body<const char>> res_;
};

void Hub::accept() {
  acceptor.async_accept([this](beast::error_code ec, tcp::socket sock) {
    if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;
    if (ec) {  // e.g. out of file descriptors: try again shortly rather than spin
      accept_retry.expires_after(std::chrono::milliseconds(100));
      accept_retry.async_wait([this](beast::error_code e) {
        if (!e) accept();
      });
      return;
    }
    admit(std::move(sock));
    accept();
  });
}

// The newest connection is served; beyond max_connections the oldest makes way.
void Hub::admit(tcp::socket sock) {
  open.remove_if([](const std::weak_ptr<HttpConnection>& w) { return w.expired(); });
  while (int(open.size()) >= limits.max_connections) {
    if (auto oldest = open.front().lock()) oldest->close();
    open.pop_front();
  }
  beast::error_code ec;
  sock.set_option(tcp::no_delay(true), ec);
  auto c = std::make_shared<HttpConnection>(*this, std::move(sock));
  open.push_back(c);
  c->start();
}

std::shared_ptr<const Document> Hub::document(http::verb method, beast::string_view target) {
  if (method != http::verb::get) return bad_method;
  const beast::string_view path = target.substr(0, target.find('?'));
  Page page;
  if (path == "/" || path == "/index.html") page = Page::html;
  else if (path == "/metrics") page = Page::metrics;
  else if (path == "/status.json") page = Page::json;
  else return not_found;
  const size_t k = size_t(page);
  const auto now = Clock::now();
  if (cache[k] && now - rendered_at[k] < to_duration(limits.render_every_s)) return cache[k];
  auto d = std::make_shared<Document>();
  try {
    const RunStatus s = source();
    switch (page) {
      case Page::html: d->type = "text/html; charset=utf-8", d->body = status_html(s); break;
      case Page::metrics: d->type = "text/plain; version=0.0.4; charset=utf-8", d->body = status_metrics(s); break;
      default: d->type = "application/json", d->body = status_json(s); break;
    }
  } catch (const std::exception& e) {
    d->status = http::status::internal_server_error;
    d->type = "text/plain; charset=utf-8";
    d->body = std::string("status unavailable: ") + e.what() + "\n";
  }
  cache[k] = d;
  rendered_at[k] = now;
  return d;
}

void Hub::stop() {
  beast::error_code ec;
  acceptor.close(ec);
  accept_retry.cancel();
  for (const auto& w : open)
    if (auto c = w.lock()) c->close();
  open.clear();
}

}  // namespace

struct StatusServer::Impl : Hub {
  using Hub::Hub;
};

StatusServer::StatusServer(const std::string& host, uint16_t port, Source source, StatusLimits limits)
    : impl_(std::make_unique<Impl>(std::move(source), limits)) {
  Impl& I = *impl_;
  I.host = host == "localhost" ? "127.0.0.1" : host;
  beast::error_code ec;
  const auto addr = asio::ip::make_address(I.host, ec);
  if (ec) throw NetError("status_bind address '" + host + "' is not an IP address");
  const tcp::endpoint ep(addr, port);
  I.acceptor.open(ep.protocol(), ec);
  if (!ec) I.acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) I.acceptor.bind(ep, ec);
  if (!ec) I.acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) throw NetError("status_bind: cannot bind " + host + ":" + std::to_string(port) + ": " + ec.message());
  I.bound_port = I.acceptor.local_endpoint().port();
  I.accept();
  I.thread = std::thread([&I] { I.io.run(); });
}

StatusServer::~StatusServer() {
  Impl& I = *impl_;
  asio::post(I.io, [&I] { I.stop(); });
  // Closed connections finish their handlers; then nothing is left to run.
  asio::post(I.io, [&I] { I.io.stop(); });
  if (I.thread.joinable()) I.thread.join();
}

uint16_t StatusServer::port() const { return impl_->bound_port; }

std::string StatusServer::url() const {
  const bool v6 = impl_->host.find(':') != std::string::npos;
  return "http://" + (v6 ? "[" + impl_->host + "]" : impl_->host) + ":" + std::to_string(impl_->bound_port) + "/";
}

}  // namespace spes::net
