// The coordinator's read-only HTTP server (net/README.md, Watching a run): GET /,
// /metrics and /status.json (net/status_page), on a port of its own, over
// Boost.Beast.
//
// It runs on a thread and io_context of its own, not on the sync loop's: a round's
// close holds the coordinator's thread for the merge and the fsync of the state
// file, during which the page still answers, and nothing an HTTP client does runs
// on the thread that reads pushes. What the sync loop pays is a copy of a small
// struct under a mutex at its events (net/run_status).
//
// Bounded against slow or hostile clients:
//   - at most max_connections open; a newcomer beyond that closes the oldest (an
//     idle socket cannot keep a scraper out for long, and never grows the count);
//   - a request's header at most max_header_bytes (Beast's parser limit, and the
//     read buffer's size), no body: a longer header or any body closes the
//     connection;
//   - a whole request must arrive within request_timeout_s of the connection or of
//     the previous response, a response must be written within write_timeout_s;
//   - the documents are rendered at most once per render_every_s and shared by
//     every connection (one copy each, whatever the request rate).
// So its memory is at most max_connections × (max_header_bytes + a socket) plus
// one copy of each document.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "net/run_status.hpp"

namespace spes::net {

struct StatusLimits {
  int max_connections = 32;
  size_t max_header_bytes = 8192;
  double request_timeout_s = 10;
  double write_timeout_s = 10;
  double render_every_s = 0.5;
};

class StatusServer {
 public:
  using Source = std::function<RunStatus()>;  // called on the server's thread
  // Binds host:port (host an IP address or "localhost"; port 0: a free one) and
  // starts serving on a thread of its own. Throws NetError naming the address.
  StatusServer(const std::string& host, uint16_t port, Source source, StatusLimits limits = {});
  ~StatusServer();  // stops, joins its thread
  StatusServer(const StatusServer&) = delete;
  StatusServer& operator=(const StatusServer&) = delete;

  uint16_t port() const;
  std::string url() const;  // http://host:port/

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spes::net
