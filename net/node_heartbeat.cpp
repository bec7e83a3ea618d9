#include "net/node_heartbeat.hpp"

#include "net/asio_util.hpp"

namespace spes::net {

IdleHeartbeat::IdleHeartbeat(NodeLink& link, std::mutex& turn, const LineLog& log)
    : link_(link), turn_(turn), log_(log), thread_([this] { loop(); }) {}

IdleHeartbeat::~IdleHeartbeat() {
  {
    std::lock_guard<std::mutex> lk(turn_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

// Looks twice a second, so a heartbeat goes within 1.5 s of the last write. A
// failure just disconnects: the next round reconnects.
void IdleHeartbeat::loop() {
  std::unique_lock<std::mutex> lk(turn_);
  while (!wake_.wait_for(lk, to_duration(NodeLink::kHeartbeatS / 2), [&] { return stop_; })) {
    if (!link_.heartbeat_due()) continue;
    try {
      link_.write_heartbeat();
    } catch (const std::exception& e) {
      log_("heartbeat failed (%s); reconnecting at the next round", e.what());
      link_.disconnect();
    }
  }
}

}  // namespace spes::net
