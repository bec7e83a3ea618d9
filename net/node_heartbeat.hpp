// A node's heartbeats between rounds: the coordinator frees a node that stays
// silent, and between rounds nothing else is written, so a helper thread sends a
// heartbeat each second the link is connected and idle. During a round the link
// sends its own while it waits (net/node_link.hpp). The thread takes its turn on
// the link through the client's mutex, which a round holds throughout.
#pragma once
#include <condition_variable>
#include <mutex>
#include <thread>

#include "net/line_log.hpp"
#include "net/node_link.hpp"

namespace spes::net {

class IdleHeartbeat {
 public:
  // Starts the thread; `turn` guards `link`.
  IdleHeartbeat(NodeLink& link, std::mutex& turn, const LineLog& log);
  ~IdleHeartbeat();  // stops and joins it
  IdleHeartbeat(const IdleHeartbeat&) = delete;
  IdleHeartbeat& operator=(const IdleHeartbeat&) = delete;

 private:
  void loop();
  NodeLink& link_;
  std::mutex& turn_;
  const LineLog& log_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace spes::net
